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
from tvm import relax, te, tirx, topi
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


def _isnan(x: te.Tensor) -> te.Tensor:
    """``isnan(x)``; TVM's ``isnan`` takes no bfloat16, so low floats are widened (exactly)."""
    wide = (
        (lambda v: v)
        if str(x.dtype) in ("float32", "float64")
        else (lambda v: tirx.Cast("float32", v))
    )
    return te.compute(x.shape, lambda *i: tirx.isnan(wide(x(*i))), name="isnan")


def _keeping_nan(extremum):
    """``extremum(a, b)`` (TVM's broadcasting ``maximum``/``minimum``), but a NaN operand is
    the result; a scalar constant operand (``clamp``'s bound) is not checked."""

    def compute(a, b):
        out = extremum(a, b)
        for operand in (b, a):  # a's NaN wins where both are NaN, as in torch
            if isinstance(operand, te.Tensor):
                out = topi.where(_isnan(operand), operand, out)
        return out

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
    "relax.maximum": _float_only("relax.maximum", _keeping_nan(topi.maximum), True),
    "relax.minimum": _float_only("relax.minimum", _keeping_nan(topi.minimum), True),
}

__all__ = ["LEGALIZE_MAP"]
