"""Pad the symbolic rows of a bf16 matmul to whole row tiles, so that its GEMM kernel runs.

A matmul whose rows are only known at run time (one expert's share of the tokens in a
mixture-of-experts layer, ``tvmamp.frontends.torch_moe``; a dynamic sequence length) has a
symbolic row extent. The CPU bf16 GEMM rule schedules such a kernel only when it can read the
left operand in place, i.e. when the rows are provably whole register tiles: the padded copy it
makes for static shapes would be a bf16 buffer inside the kernel, which TVM promotes to fp32
(docs/CPU_BF16.md). Without the rule the kernel is left unscheduled: a scalar loop, 100 times
slower.

Here ``matmul(a, b)`` with symbolic rows ``m`` not provably a multiple of ``tile`` becomes::

    padded = concat([a, zeros(..., ceil(m / tile) * tile - m, k)], axis=-2)
    matmul(padded, b)[..., :m, :]

The padded rows are zeros and are sliced off, so the result is the same (:func:`first_rows`:
a view where TVM cannot prove the slice covered). A batched ``a``
against a 2-D ``b`` is padded as one matrix of all its rows (:meth:`_Rewriter._flattened`),
also where only its batch is symbolic and its rows are no whole tiles (ViT's 65 tokens under a
dynamic batch: in the kernel, rows padded to tiles would be a copy of ``a``).
"""

from __future__ import annotations

import functools
import operator

import tvm
from tvm import relax, tirx
from tvm.relax import PyExprMutator
from tvm.sym.analyzer import Analyzer

from .bindings import rewrite_functions

_MATMUL = tvm.ir.Op.get("relax.matmul")


def whole_tiles(rows, tile: int):
    """``rows`` rounded up to a multiple of ``tile`` (a PrimExpr when ``rows`` is one); ``rows``
    itself where it is one already (``batch * 8192`` rows of 8), so that kernels over those
    rows need no padded rows (whose index clamp kept a video net's NCHW-to-rows copy off the
    transpose schedule: 20.8 ms at 4.7 % of the copy peak)."""
    if is_whole(rows, tile):
        return rows
    return (rows + tile - 1) // tile * tile


def is_whole(rows, tile: int) -> bool:
    """Whether symbolic ``rows`` are provably whole ``tile`` rows (no padding)."""
    if isinstance(rows, int | tirx.IntImm):
        return False
    return Analyzer().can_prove(tirx.floormod(rows, tile) == 0)


def first_rows(out: relax.Expr, rows, padded) -> relax.Expr:
    """The first ``rows`` of ``out`` (a result over ``padded`` rows, on axis 0 or -2).

    A slice, which FuseOps fuses into the GEMM that computes ``out`` (its epilogue). Where
    TVM cannot prove that the padded rows cover the slice (``rows = b * 50``: ``8 * ((50 * b
    + 7) // 8) >= 50 * b`` fails where 50 and the tile share a factor; ``b * (h // 4 * 2) *
    (w // 4 * 2)`` alike), such a kernel was no stage pipeline and no rule scheduled it (a
    scalar loop, 100x slower): there the rows of a 2-D ``out`` are a view, and the ops after
    it run in a kernel of their own.
    """
    axis = out.ty.ndim - 2
    if axis == 0 and not Analyzer().can_prove(padded - rows >= 0):
        return relax.op.memory.view(out, relax.ShapeExpr([rows, *out.ty.shape.values[1:]]))
    return relax.op.strided_slice(out, [axis], [0], [rows], assume_inbound=True)


def needs_padding(rows, tile: int) -> bool:
    """Whether a row extent is symbolic and not provably a multiple of ``tile``."""
    if isinstance(rows, tirx.IntImm):
        return False
    return not Analyzer().can_prove(tirx.floormod(rows, tile) == 0)


@tvm.transform.module_pass(opt_level=0, name="tvmamp.PadSymbolicRows")
class PadSymbolicRows:
    """Pad the symbolic rows of each bf16 ``matmul`` to a multiple of ``tile``.

    Parameters
    ----------
    tile : int
        The row tile of the GEMM kernel (``CPUMatmulBF16.Config.tile_i``).
    """

    def __init__(self, tile: int):
        self.tile = tile

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return rewrite_functions(mod, _Rewriter(mod, self.tile))


@relax.expr_functor.mutator
class _Rewriter(PyExprMutator):
    def __init__(self, mod: tvm.IRModule, tile: int):
        super().__init__(mod)
        self.tile = tile

    def visit_call_(self, call):
        call = self.visit_expr_post_order(call)
        if call.op != _MATMUL or not self._applies(call):
            return call
        a, b = call.args
        shape = list(a.ty.shape)
        if len(shape) > 2 and b.ty.ndim == 2:
            return self._flattened(a, b, call.attrs.out_dtype)
        rows, depth = shape[-2], shape[-1]
        padded = whole_tiles(rows, self.tile)
        zeros = relax.op.zeros(relax.ShapeExpr([*shape[:-2], padded - rows, depth]), a.ty.dtype)
        a = self.builder_.emit(relax.op.concat([a, zeros], axis=len(shape) - 2))
        out = self.builder_.emit(relax.op.matmul(a, b, out_dtype=call.attrs.out_dtype))
        return first_rows(out, rows, padded)

    def _flattened(self, a, b, out_dtype):
        """``a[..., rows, k] @ b[k, n]`` as one GEMM over all of ``a``'s rows, padded.

        Padding only the second-to-last axis of a batched ``a`` leaves the kernel a GEMM over
        a symbolic batch of padded row blocks, whose row slice FuseOps makes the first block
        of its epilogue; that slice covers fewer rows than the GEMM and cannot be inlined into
        it, so the kernel was left a scalar loop (an MPT exported with symbolic batch and
        length ran 200x slower). The flattened rows pad and slice like a 2-D ``a``.
        """
        shape = list(a.ty.shape)
        rows = functools.reduce(operator.mul, shape[:-1])
        flat = self.builder_.emit(relax.op.reshape(a, relax.ShapeExpr([rows, shape[-1]])))
        product = relax.op.matmul(flat, b, out_dtype=out_dtype)
        if needs_padding(rows, self.tile):
            product = self.visit_call_(product)
        out = self.builder_.emit(product)
        return relax.op.reshape(out, relax.ShapeExpr([*shape[:-1], b.ty.shape[-1]]))

    def _applies(self, call) -> bool:
        a, b = call.args
        a_ty, b_ty = a.ty, b.ty
        if not isinstance(a_ty, relax.TensorType) or not isinstance(b_ty, relax.TensorType):
            return False
        if a_ty.shape is None or b_ty.shape is None or a_ty.ndim < 2 or b_ty.ndim < 2:
            return False
        if str(a_ty.dtype) != "bfloat16" or str(b_ty.dtype) != "bfloat16":
            return False
        a_shape, b_shape = list(a_ty.shape), list(b_ty.shape)
        static = all(isinstance(e, tirx.IntImm) for e in (a_shape[-1], *b_shape[-2:]))
        if b_ty.ndim == 2:  # flattened: a symbolic batch over rows of no whole tiles counts
            rows = functools.reduce(operator.mul, a_shape[:-1])
            return static and needs_padding(rows, self.tile)
        return static and needs_padding(a_shape[-2], self.tile)
