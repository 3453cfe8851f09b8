"""Let bf16 GEMMs read a run-time weight ``W[N, K]`` in place for ``x @ W.T``.

A Linear layer is ``matmul(x, permute_dims(W))``. With a constant weight the transpose is folded
at compile time, but in a training step the weights are inputs: every step ran a transpose
kernel over the bf16 copy of each weight, then packed the transposed copy for the GEMM.

:class:`FuseWeightTranspose` rewrites ``matmul(x, permute_dims(w))`` with bf16 ``x`` and a
non-constant 2-D bf16 ``w`` into one ``call_tir`` of ``out[..., n] = sum_k x[..., k] * w[n, k]``
(accumulated in the matmul's output dtype). The bf16 GEMM rule then packs ``w`` straight from
``[N, K]``: each 16 x 32 tile of bf16 pairs is a 16 x 16 transpose of 32-bit values, done in
registers (:func:`tvmamp.schedules.cpu.bf16_common.pack_pairs_t_intrin`). Only shapes whose
tiles are whole and need no padding (``N % 32 == 0``, ``K % 32 == 0``) are rewritten; the
others keep the transpose kernel, which is faster than a gathering pack.
"""

from __future__ import annotations

import tvm
from tvm import relax, te
from tvm.ir.expr import Constant
from tvm.relax import PyExprMutator

from tvmamp.tensors import static_shape, type_dtype

_MATMUL = tvm.ir.Op.get("relax.matmul")
_PERMUTE = tvm.ir.Op.get("relax.permute_dims")
# Ops that only convert or move a weight's values: a constant stays a constant through them.
_PASS_THROUGH = {tvm.ir.Op.get("relax.astype"), _PERMUTE}
# Whole tiles of the transposing pack (16 rows of N, 32 bf16 of K) in whole column tiles of the
# GEMM (32 columns by default): a padded weight would be packed by a gathering copy.
TILE_N, TILE_K = 32, 32


@tvm.transform.module_pass(opt_level=0, name="tvmamp.FuseWeightTranspose")
class FuseWeightTranspose:
    """Rewrite ``matmul(x, permute_dims(w))`` on run-time bf16 weights into an NT matmul."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        """Rewrite every Relax function of ``mod``; the unused transposes are removed."""
        rewriter = _Rewriter(mod)
        for gvar, func in mod.functions_items():
            if isinstance(func, relax.Function):
                rewriter.builder_.update_func(gvar, rewriter.visit_expr(func))
        return relax.transform.DeadCodeElimination()(rewriter.builder_.get())


def nt_matmul(x: te.Tensor, w: te.Tensor, out_dtype: str) -> te.Tensor:
    """``out[..., m, n] = sum_k x[..., m, k] * w[n, k]``, products and sum in ``out_dtype``."""
    k = te.reduce_axis((0, x.shape[-1]), name="k")
    return te.compute(
        (*x.shape[:-1], w.shape[0]),
        lambda *i: te.sum(
            x[(*i[:-1], k)].astype(out_dtype) * w[i[-1], k].astype(out_dtype), axis=k
        ),
        name="T_matmul_NT",
    )


@relax.expr_functor.mutator
class _Rewriter(PyExprMutator):
    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if call.op != _MATMUL:
            return call
        x, b = call.args
        weight = self._transposed_weight(b)
        if weight is None or type_dtype(x.ty) != "bfloat16":
            return call
        x_shape, w_shape = static_shape(x.ty), static_shape(weight.ty)
        if x_shape is None or w_shape is None or len(w_shape) != 2:
            return call
        n, k = w_shape
        if n % TILE_N or k % TILE_K or x_shape[-1] != k:
            return call
        out_dtype = type_dtype(call.ty)
        return self.builder_.call_te(nt_matmul, x, weight, out_dtype, primfunc_name_hint="matmul")

    def _transposed_weight(self, b: relax.Expr) -> relax.Expr | None:
        """``w`` when ``b`` is ``permute_dims(w)`` of a 2-D bf16 value that is not constant."""
        value = self.lookup_binding(b) if isinstance(b, relax.Var) else b
        if not (isinstance(value, relax.Call) and value.op == _PERMUTE):
            return None
        axes = value.attrs.axes
        weight = value.args[0]
        if axes is not None and [int(a) for a in axes] != [1, 0]:
            return None
        if type_dtype(weight.ty) != "bfloat16" or self._is_constant(weight):
            return None
        return weight

    def _is_constant(self, expr: relax.Expr) -> bool:
        """Whether ``expr`` is a constant, or a cast or transpose of one (folded when built)."""
        while True:
            if isinstance(expr, Constant):
                return True
            value = self.lookup_binding(expr) if isinstance(expr, relax.Var) else expr
            if not (isinstance(value, relax.Call) and value.op in _PASS_THROUGH):
                return False
            expr = value.args[0]
