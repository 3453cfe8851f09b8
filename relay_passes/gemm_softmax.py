"""Attention scores and their softmax in one kernel: ``softmax(epilogue(A @ B))``.

``FuseOps`` ends a kernel at a reduction, so attention's ``Q @ K^T`` (with its scale or mask
epilogue) writes its fp32 scores out (4 MB for a TransformerEncoderLayer of 8 x 128 tokens) and
the softmax kernel reads them back. :class:`FuseGemmSoftmax` runs between ``FuseOps`` and
``FuseTIR`` and merges such a pair of fused functions into one, which the CPU rule
``schedules/cpu/bf16_softmax.py`` schedules a row block at a time: the block's scores stay in
L1 between the GEMM and the softmax, and only the probabilities are written.

A pair is merged when the first function computes one bf16 x bf16 -> fp32 GEMM of two of its
parameters and elementwise or broadcast ops of the same output shape, the second starts with a
softmax over the last axis (a kernel of :mod:`.fast_math`, marked :data:`ROW_SOFTMAX`) followed
by elementwise ops, nothing else reads the scores, and the target's schedule takes the merged
kernel.
"""

from __future__ import annotations

from collections.abc import Callable

import tvm
import tvm_ffi
from tvm import relax, tirx

from tvmamp.tensors import static_shape

from .bindings import rebind, use_counts
from .fused_functions import (
    BROADCAST,
    ELEMWISE,
    all_within,
    bf16_gemm_calls,
    fused_kernel,
    merged_function,
    prim_func,
    primitive_calls,
)

# The PrimFunc attribute FastMath sets on a softmax over the last axis.
ROW_SOFTMAX = "tvmamp.row_softmax"


def _is_scores(mod: tvm.IRModule, func: relax.Function) -> bool:
    """One bf16 GEMM on the function's parameters, and elementwise or broadcast ops (its
    epilogue, and what that reads, such as a mask made from a boolean one) keeping its shape."""
    calls = primitive_calls(func)
    if not calls or static_shape(func.body.body.ty) is None:
        return False
    gemms = bf16_gemm_calls(mod, calls)
    if len(gemms) != 1:
        return False
    (gemm,) = gemms
    params = list(func.params)
    if not all(any(a.same_as(p) for p in params) for a in gemm.args[1].fields):
        return False
    if not all_within(mod, [c for c in calls if c is not gemm], BROADCAST):
        return False
    return tvm_ffi.structural_equal(gemm.ty, func.body.body.ty)


def _is_softmax(mod: tvm.IRModule, func: relax.Function) -> bool:
    """One parameter and one tensor result; a row softmax over the last axis, then elementwise
    ops."""
    calls = primitive_calls(func)
    if not calls or len(func.params) != 1 or static_shape(func.body.body.ty) is None:
        return False
    first = prim_func(mod, calls[0])
    if first is None or not (first.attrs and first.attrs.get(ROW_SOFTMAX)):
        return False
    args = calls[0].args[1].fields
    if len(args) != 1 or not args[0].same_as(func.params[0]):
        return False
    return all_within(mod, calls[1:], ELEMWISE)


@relax.expr_functor.mutator
class _Rewriter(relax.PyExprMutator):
    """Replaces each pair's softmax call by a call of the merged function (added once), where
    ``schedules`` takes the merged kernel."""

    def __init__(self, mod: tvm.IRModule, schedules: Callable[[tirx.PrimFunc], bool]):
        super().__init__(mod)
        self.mod = mod
        self.schedules = schedules
        self.pairs: dict = {}
        self.merged: dict = {}  # (scores function, softmax function) -> merged GlobalVar or None

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        pair = self.pairs.get(binding.var)
        gvar = self._merged_function(pair[1]) if pair is not None else None
        if gvar is None:
            super().visit_var_binding_(binding)
            return
        call = relax.Call(gvar, [self.visit_expr(a) for a in pair[0].args])
        rebind(self, binding.var, call, binding.var.name)

    def _merged_function(self, key: tuple):
        """The merged function of ``key``'s pair (added to the module), or None when the
        target's schedule declines its kernel."""
        if key not in self.merged:
            name = f"{key[0].name_hint}_{key[1].name_hint.removeprefix('fused_')}"
            func = merged_function(name, self.mod[key[0]], self.mod[key[1]])
            ok = self.schedules(fused_kernel(self.mod, func, name))
            self.merged[key] = self.builder_.add_func(func, name) if ok else None
        return self.merged[key]


@tvm.transform.module_pass(opt_level=0, name="tvmamp.FuseGemmSoftmax")
class FuseGemmSoftmax:
    """Merge each fused ``epilogue(A @ B)`` kernel into the softmax kernel that alone reads it.

    Parameters
    ----------
    schedules : callable
        ``schedules(kernel) -> bool`` for a merged kernel (the PrimFunc ``FuseTIR`` makes of
        it): whether the target's schedule takes it. A pair whose kernel it declines stays two
        kernels, so a merged kernel never falls to a generic schedule.
    """

    def __init__(self, schedules: Callable[[tirx.PrimFunc], bool]):
        self.schedules = schedules

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        """Merge the pairs in every non-primitive Relax function of ``mod``."""
        rewriter = _Rewriter(mod, self.schedules)
        for gvar, func in mod.functions_items():
            if isinstance(func, relax.Function) and not (
                func.attrs and func.attrs.get("Primitive")
            ):
                rewriter.pairs = self._pairs(mod, func)
                if rewriter.pairs:
                    rewriter.builder_.update_func(gvar, rewriter.visit_expr(func))
        if not any(rewriter.merged.values()):
            return mod
        return relax.transform.DeadCodeElimination()(rewriter.builder_.get())

    def _pairs(self, mod: tvm.IRModule, func: relax.Function) -> dict:
        """The softmax binding's var -> (the scores call, the two functions) of each pair whose
        bindings are in one block."""
        uses = use_counts(func)
        pairs = {}
        for block in func.body.blocks:
            values = {b.var: b.value for b in block.bindings}
            for var, value in values.items():
                pair = self._pair(mod, value, values, uses)
                if pair is not None:
                    pairs[var] = pair
        return pairs

    def _pair(self, mod: tvm.IRModule, value: relax.Expr, values: dict, uses: dict):
        """``(scores call, (scores function, softmax function))`` when ``value`` calls a softmax
        function on the result of a scores function that nothing else reads, else None."""
        if not isinstance(value, relax.Call) or not isinstance(value.op, tvm.ir.GlobalVar):
            return None
        if len(value.args) != 1 or not isinstance(value.args[0], relax.Var):
            return None
        scores_var = value.args[0]
        scores_call = values.get(scores_var)
        if uses.get(scores_var) != 1 or not isinstance(scores_call, relax.Call):
            return None
        if not isinstance(scores_call.op, tvm.ir.GlobalVar):
            return None
        first, second = mod[scores_call.op], mod[value.op]
        if not (isinstance(first, relax.Function) and isinstance(second, relax.Function)):
            return None
        if not (_is_scores(mod, first) and _is_softmax(mod, second)):
            return None
        return scores_call, (scores_call.op, value.op)


__all__ = ["ROW_SOFTMAX", "FuseGemmSoftmax"]
