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
from tvm import relax, s_tir, tirx

from tvmamp.tensors import static_shape

from .bindings import rebind, use_counts

# The PrimFunc attribute FastMath sets on a softmax over the last axis.
ROW_SOFTMAX = "tvmamp.row_softmax"
# relax.transform.AnnotateTIROpPattern's kinds (TVM's OpPatternKind) allowed around the pair.
_ELEMWISE = 0
_BROADCAST = 1
_OUT_ELEMWISE_FUSABLE = 4


def _calls(func: relax.Function) -> list[relax.Call] | None:
    """The ``call_tir`` values of a primitive function of one dataflow block, in order."""
    if len(func.body.blocks) != 1:
        return None
    values = [b.value for b in func.body.blocks[0].bindings]
    call_tir = tvm.ir.Op.get("relax.call_tir")
    return values if all(isinstance(v, relax.Call) and v.op == call_tir for v in values) else None


def _prim_func(mod: tvm.IRModule, call: relax.Call) -> tirx.PrimFunc | None:
    func = mod[call.args[0]]
    return func if isinstance(func, tirx.PrimFunc) else None


def _pattern(func: tirx.PrimFunc | None) -> int | None:
    value = func.attrs.get("op_pattern") if func is not None and func.attrs is not None else None
    return None if value is None else int(value)


def _all_within(mod: tvm.IRModule, calls: list[relax.Call], kind: int) -> bool:
    """Whether every PrimFunc ``calls`` call has an op pattern of at most ``kind``."""
    patterns = [_pattern(_prim_func(mod, c)) for c in calls]
    return all(p is not None and p <= kind for p in patterns)


def _is_bf16_gemm(func: tirx.PrimFunc) -> bool:
    """One reduction block reading two bf16 buffers into fp32 (a legalized matmul)."""
    sch = s_tir.Schedule(func)
    blocks = [sch.get(b) for b in sch.get_child_blocks(sch.get_sblock("root"))]
    if len(blocks) != 1:
        return False
    (block,) = blocks
    reads = [str(r.source.dtype) for r in block.reads]
    reduces = any(iv.iter_type == tirx.IterVar.CommReduce for iv in block.iter_vars)
    return reduces and reads == ["bfloat16"] * 2 and str(block.writes[0].source.dtype) == "float32"


def _is_scores(mod: tvm.IRModule, func: relax.Function) -> bool:
    """One bf16 GEMM on the function's parameters, and elementwise or broadcast ops (its
    epilogue, and what that reads, such as a mask made from a boolean one) keeping its shape."""
    calls = _calls(func)
    if not calls or static_shape(func.body.body.ty) is None:
        return False
    gemms = [c for c in calls if _pattern(_prim_func(mod, c)) == _OUT_ELEMWISE_FUSABLE]
    if len(gemms) != 1 or not _is_bf16_gemm(_prim_func(mod, gemms[0])):
        return False
    (gemm,) = gemms
    params = list(func.params)
    if not all(any(a.same_as(p) for p in params) for a in gemm.args[1].fields):
        return False
    if not _all_within(mod, [c for c in calls if c is not gemm], _BROADCAST):
        return False
    return tvm_ffi.structural_equal(gemm.ty, func.body.body.ty)


def _is_softmax(mod: tvm.IRModule, func: relax.Function) -> bool:
    """One parameter and one tensor result; a row softmax over the last axis, then elementwise
    ops."""
    calls = _calls(func)
    if not calls or len(func.params) != 1 or static_shape(func.body.body.ty) is None:
        return False
    first = _prim_func(mod, calls[0])
    if first is None or not (first.attrs and first.attrs.get(ROW_SOFTMAX)):
        return False
    args = calls[0].args[1].fields
    if len(args) != 1 or not args[0].same_as(func.params[0]):
        return False
    return _all_within(mod, calls[1:], _ELEMWISE)


def _merged(name: str, scores: relax.Function, softmax: relax.Function) -> relax.Function:
    """One primitive function: ``softmax``'s body on the result of ``scores``'s."""
    builder = relax.BlockBuilder()
    params = [relax.Var(p.name, p.ty) for p in scores.params]
    remap = dict(zip(scores.params, params, strict=True))
    with builder.function(name, params, attrs={"Primitive": True}, private=True):
        with builder.dataflow():
            for func in (scores, softmax):
                if func is softmax:
                    remap[softmax.params[0]] = remap[scores.body.body]
                for binding in func.body.blocks[0].bindings:
                    call = binding.value
                    args = [remap.get(a, a) for a in call.args[1].fields]
                    new = relax.call_tir(call.args[0], args, out_ty=call.ty_args[0])
                    last = binding.var.same_as(softmax.body.body)
                    emit = builder.emit_output if last else builder.emit
                    remap[binding.var] = emit(new, binding.var.name)
        builder.emit_func_output(remap[softmax.body.body])
    return builder.get()[name]


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
            func = _merged(name, self.mod[key[0]], self.mod[key[1]])
            ok = self.schedules(_fused_kernel(self.mod, func, name))
            self.merged[key] = self.builder_.add_func(func, name) if ok else None
        return self.merged[key]


def _fused_kernel(mod: tvm.IRModule, func: relax.Function, name: str) -> tirx.PrimFunc:
    """The PrimFunc ``FuseTIR`` makes of the primitive function ``func`` (named ``name``)."""
    prim_funcs = {g: f for g, f in mod.functions_items() if isinstance(f, tirx.PrimFunc)}
    builder = relax.BlockBuilder(tvm.IRModule(prim_funcs))
    gvar = builder.add_func(func, name)
    params = [relax.Var(p.name, p.ty) for p in func.params]
    with builder.function("main", params):
        with builder.dataflow():
            out = builder.emit_output(relax.Call(gvar, params))
        builder.emit_func_output(out)
    fused = relax.transform.FuseTIR()(builder.get())
    return next(f for g, f in fused.functions_items() if g.name_hint == name)


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
