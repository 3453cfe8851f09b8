"""Legalization of ReLU, clip, maximum and minimum that keeps NaN, as torch and numpy do.

TVM legalizes these ops with ``max``/``min``, which LLVM lowers to ``maxnum``/``minnum`` or
``vmaxps``: a NaN operand gives the other operand, so ``relu(NaN)`` is 0 and ``clip(NaN, 0, 6)``
is 0. A NaN that a model produces (an fp16 overflow turned into ``inf - inf`` by a norm, say)
then vanishes at the next ReLU, and the output is finite and wrong where torch's is NaN: a conv
over an image with two NaN pixels, then a ReLU, gave 144 NaN in torch and none in TVM. In
training the loss can stay finite, and then dynamic loss scaling does not skip the step.

:data:`LEGALIZE_MAP`, given to ``LegalizeOps``, computes them with selects on comparisons that
a NaN fails: ``relu(x) = x < 0 ? 0 : x``; ``clip`` raises to ``lo``, then lowers to ``hi``, the
same way (all ``hi`` where ``lo > hi``, as in numpy and ONNX); ``maximum``/``minimum`` return a
NaN operand itself. Integer ops keep TVM's rules.
Reductions (``max``, ``argmax``) and max pooling still skip NaN (docs/DEBUGGING.md).
"""

from __future__ import annotations

import tvm
from tvm import relax, te, tirx
from tvm.relax.transform.legalize_ops.common import _try_convert_to_scalar_const


def _is_float(dtype) -> bool:
    return str(dtype).startswith(("float", "bfloat"))


def _relu(x: te.Tensor) -> te.Tensor:
    zero = tirx.const(0, x.dtype)
    return te.compute(x.shape, lambda *i: tirx.Select(x(*i) < zero, zero, x(*i)), name="relu")


def _clip(x: te.Tensor, lo, hi) -> te.Tensor:
    lo, hi = tirx.Cast(x.dtype, lo), tirx.Cast(x.dtype, hi)

    def clipped(*i):  # the lower bound first, as numpy and ONNX: all hi where lo > hi
        raised = tirx.Select(x(*i) < lo, lo, x(*i))
        return tirx.Select(raised > hi, hi, raised)

    return te.compute(x.shape, clipped, name="clip")


def isnan(value: tirx.PrimExpr) -> tirx.PrimExpr:
    """``isnan(value)`` from its bits: the exponent all ones and the mantissa not zero.

    TVM's vectoriser scalarises a loop that calls ``tirx.isnan`` (LLVM then rebuilt the loop
    from gathers and scatters: a NaN-keeping ``maximum`` of two tensors ran 10x slower), and
    ``x != x`` simplifies to false. Integer compares of the bits vectorise. Low floats are
    widened to float32 first (exactly).
    """
    if str(value.ty.dtype) == "float64":
        bits, magnitude, infinity = "int64", 0x7FFFFFFFFFFFFFFF, 0x7FF0000000000000
    else:
        if str(value.ty.dtype) != "float32":
            value = tirx.Cast("float32", value)
        bits, magnitude, infinity = "int32", 0x7FFFFFFF, 0x7F800000
    word = tirx.bitwise_and(tirx.reinterpret(bits, value), tirx.const(magnitude, bits))
    return word > tirx.const(infinity, bits)


def _is_one(dim) -> bool:
    return isinstance(dim, tirx.IntImm) and dim.value == 1


def _broadcast_shape(a, b) -> list:
    """The numpy broadcast of the shapes of ``a`` and ``b`` (a scalar has shape ``()``)."""
    shapes = [list(t.shape) if isinstance(t, te.Tensor) else [] for t in (a, b)]
    ndim = max(len(shape) for shape in shapes)
    padded = [[tirx.IntImm("int64", 1)] * (ndim - len(s)) + s for s in shapes]
    return [db if _is_one(da) else da for da, db in zip(*padded)]


def _at(operand, index: tuple, dtype: str):
    """``operand`` at the broadcast ``index``; a scalar as ``dtype``."""
    if isinstance(operand, (int, float)):
        return tirx.const(operand, dtype)
    if not isinstance(operand, te.Tensor):
        return tirx.Cast(dtype, operand)
    offset = len(index) - len(operand.shape)
    return operand(*(0 if _is_one(d) else index[offset + k] for k, d in enumerate(operand.shape)))


def _extremum(larger: bool):
    """``maximum`` (``larger``) or ``minimum`` of ``a`` and ``b``, broadcast, in one select:
    ``b`` where it lies further out, else ``a`` (so a NaN ``a`` stays), and ``b`` where it
    is NaN; a scalar operand (``clamp``'s bound) is not checked for NaN."""

    def compute(a, b):
        dtype = (a if isinstance(a, te.Tensor) else b).dtype

        def value(*index):
            x, y = _at(a, index, dtype), _at(b, index, dtype)
            out = tirx.Select(x < y if larger else y < x, y, x)
            return tirx.Select(isnan(y), y, out) if isinstance(b, te.Tensor) else out

        return te.compute(_broadcast_shape(a, b), value, name="maximum" if larger else "minimum")

    return compute


def _float_only(op_name: str, te_func, scalar_operands: bool = False):
    """A legalization that applies ``te_func`` to float calls and TVM's rule to the rest."""

    def legalize(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
        out = call.ty
        if not isinstance(out, relax.TensorType) or not _is_float(out.dtype):
            return tvm.ir.Op.get(op_name).get_attr("FLegalize")(bb, call)
        args = list(call.args)
        if scalar_operands:  # one scalar constant operand becomes a PrimExpr, as in TVM's rule
            args[1] = _try_convert_to_scalar_const(args[1])
            if isinstance(args[1], relax.Expr):
                args[0] = _try_convert_to_scalar_const(args[0])
        name = op_name.rsplit(".", 1)[-1]
        return bb.call_te(te_func, *args, primfunc_name_hint=name)

    return legalize


LEGALIZE_MAP = {
    "relax.nn.relu": _float_only("relax.nn.relu", _relu),
    "relax.clip": _float_only("relax.clip", _clip),
    "relax.maximum": _float_only("relax.maximum", _extremum(larger=True), True),
    "relax.minimum": _float_only("relax.minimum", _extremum(larger=False), True),
}

__all__ = ["LEGALIZE_MAP", "isnan"]
