"""Let bf16 GEMMs read a run-time fp32 weight ``W`` in place (a training step's Linear layers).

A Linear layer is ``matmul(x, permute_dims(astype(W)))`` at O2, and its input gradient
``matmul(dy, astype(W))``. With a constant weight the cast and the transpose are folded at
compile time, but in a training step the weights are inputs: every step ran a cast kernel and a
transpose kernel over each weight, then packed the result for each GEMM.

:class:`FuseWeightTranspose` rewrites, for bf16 ``x`` and a non-constant 2-D weight,

- ``matmul(x, permute_dims(w))`` into one ``call_tir`` of ``out[..., n] = sum_k x[..., k] *
  w[n, k]`` (:func:`nt_matmul`), and
- ``matmul(x, astype(W, "bfloat16"))`` with an fp32 ``W`` into ``out[..., n] = sum_k x[..., k] *
  bf16(W[k, n])`` (:func:`nn_matmul`),

where ``w`` may itself be ``astype(W, "bfloat16")`` of an fp32 ``W``: the rounding then stays a
block of its own in the kernel, which the bf16 GEMM rule inlines into its packing of ``B``
(``vcvtneps2bf16`` on the way). The pack reads ``W[N, K]`` as 16 x 16 register transposes of
bf16 pairs (:func:`tvmamp.schedules.cpu.bf16_common.pack_pairs_t_intrin`), or ``W[K, N]``
two rows at a time (:func:`~tvmamp.schedules.cpu.bf16_common.pack_pairs_intrin`). Only shapes
whose tiles are whole and need no padding (``N % 32 == 0``, ``K % 32 == 0``) are rewritten.
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
_ASTYPE = tvm.ir.Op.get("relax.astype")
_PASS_THROUGH = {_ASTYPE, _PERMUTE}
# Whole tiles of the transposing pack (16 rows of N, 32 bf16 of K) in whole column tiles of the
# GEMM (32 columns by default): a padded weight would be packed by a gathering copy.
TILE_N, TILE_K = 32, 32


@tvm.transform.module_pass(opt_level=0, name="tvmamp.FuseWeightTranspose")
class FuseWeightTranspose:
    """Rewrite bf16 matmuls on run-time weights (``x @ w.T``, ``x @ astype(W)``) into NT/NN
    matmuls that read the weight, fp32 or bf16, in place (see the module docstring)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        """Rewrite every Relax function of ``mod``; the unused transposes are removed."""
        rewriter = _Rewriter(mod)
        for gvar, func in mod.functions_items():
            if isinstance(func, relax.Function):
                rewriter.builder_.update_func(gvar, rewriter.visit_expr(func))
        return relax.transform.DeadCodeElimination()(rewriter.builder_.get())


def nt_matmul(x: te.Tensor, w: te.Tensor, out_dtype: str) -> te.Tensor:
    """``out[..., m, n] = sum_k x[..., m, k] * w[n, k]``, products and sum in ``out_dtype``.

    An fp32 ``w`` is rounded to ``x``'s dtype first, in a block of its own (the GEMM rule packs
    the weight straight from fp32).
    """
    w = _rounded(w, x.dtype)
    k = te.reduce_axis((0, x.shape[-1]), name="k")
    return te.compute(
        (*x.shape[:-1], w.shape[0]),
        lambda *i: te.sum(
            x[(*i[:-1], k)].astype(out_dtype) * w[i[-1], k].astype(out_dtype), axis=k
        ),
        name="T_matmul_NT",
    )


def nn_matmul(x: te.Tensor, w: te.Tensor, out_dtype: str) -> te.Tensor:
    """``out[..., m, n] = sum_k x[..., m, k] * w[k, n]`` with an fp32 ``w`` rounded first."""
    w = _rounded(w, x.dtype)
    k = te.reduce_axis((0, x.shape[-1]), name="k")
    return te.compute(
        (*x.shape[:-1], w.shape[1]),
        lambda *i: te.sum(
            x[(*i[:-1], k)].astype(out_dtype) * w[k, i[-1]].astype(out_dtype), axis=k
        ),
        name="T_matmul_NN",
    )


def _rounded(w: te.Tensor, dtype: str) -> te.Tensor:
    if w.dtype == dtype:
        return w
    return te.compute(w.shape, lambda *i: w(*i).astype(dtype), name="T_weight_cast")


@relax.expr_functor.mutator
class _Rewriter(PyExprMutator):
    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if call.op != _MATMUL or type_dtype(call.args[0].ty) != "bfloat16":
            return call
        x, b = call.args
        transposed = self._transposed(b)
        weight = self._run_time_weight(transposed if transposed is not None else b)
        x_shape = static_shape(x.ty)
        w_shape = static_shape(weight.ty) if weight is not None else None
        if x_shape is None or w_shape is None or len(w_shape) != 2:
            return call
        if transposed is None and type_dtype(weight.ty) != "float32":
            return call  # a plain bf16 x @ w: nothing to fuse
        n, k = w_shape if transposed is not None else w_shape[::-1]
        if n % TILE_N or k % TILE_K or x_shape[-1] != k:
            return call
        make = nt_matmul if transposed is not None else nn_matmul
        out_dtype = type_dtype(call.ty)
        return self.builder_.call_te(make, x, weight, out_dtype, primfunc_name_hint="matmul")

    def _transposed(self, b: relax.Expr) -> relax.Expr | None:
        """``w`` when ``b`` is ``permute_dims(w)`` of a 2-D value (``axes`` [1, 0] or None)."""
        value = self._value(b)
        if not (isinstance(value, relax.Call) and value.op == _PERMUTE):
            return None
        axes = value.attrs.axes
        if axes is not None and [int(a) for a in axes] != [1, 0]:
            return None
        return value.args[0]

    def _run_time_weight(self, w: relax.Expr) -> relax.Expr | None:
        """What the GEMM reads for the bf16 operand ``w``: the fp32 tensor it rounds when ``w``
        is ``astype(fp32 value, "bfloat16")``, else ``w``; None for a constant or non-bf16."""
        if type_dtype(w.ty) != "bfloat16" or self._is_constant(w):
            return None
        value = self._value(w)
        if isinstance(value, relax.Call) and value.op == _ASTYPE:
            source = value.args[0]
            if type_dtype(source.ty) == "float32":
                return source
        return w

    def _value(self, expr: relax.Expr) -> relax.Expr:
        return self.lookup_binding(expr) if isinstance(expr, relax.Var) else expr

    def _is_constant(self, expr: relax.Expr) -> bool:
        """Whether ``expr`` is a constant, or a cast or transpose of one (folded when built)."""
        while True:
            if isinstance(expr, Constant):
                return True
            value = self.lookup_binding(expr) if isinstance(expr, relax.Var) else expr
            if not (isinstance(value, relax.Call) and value.op in _PASS_THROUGH):
                return False
            expr = value.args[0]
