"""Slices of tensors with a symbolic dim that TVM 0.27's legalizer does not build.

TVM 0.27 legalizes such a ``strided_slice`` through topi's ``dynamic_strided_slice_with_axes``,
which does not count a negative axis from the end: "Check failed: axis < src_tensor_dim (-1
vs. 2)". torch.export writes ``x[..., 1:]``, ``x.narrow(-1, ...)`` and ``torch.diff(x, dim=-1)``
with ``axes=(-1,)``, so transformers' decoders (their packed-sequence check), CodeGen, Phi-3 and
Mamba imported with a dynamic batch failed to build. :data:`LEGALIZE_MAP`, given to
``LegalizeOps``, counts the axes from the front first and legalizes as TVM does.

A ``slice_scatter`` over a whole symbolic axis (torch.export writes ``y[:, :, 1:] = x`` as one
across the batch, from 0 to ``batch`` by 1: Funnel's relative shift) failed in topi, which needs
a constant extent ("Expect value to be constant int"); its result is its source, which covers
the whole tensor.
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.sym import Analyzer


def _legalize_strided_slice(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    x, axes = call.args[0], call.args[1]
    ndim = getattr(x.ty, "ndim", -1)
    if ndim > 0 and isinstance(axes, relax.Tuple):
        values = [int(a) for a in axes.fields if isinstance(a, tvm.tirx.IntImm)]
        if len(values) == len(axes.fields) and any(a < 0 for a in values):
            positive = [a % ndim if -ndim <= a < 0 else a for a in values]
            call = bb.normalize(
                relax.op.strided_slice(
                    x, positive, *call.args[2:], assume_inbound=call.attrs.assume_inbound
                )
            )
    return _TVM_LEGALIZE(bb, call)


def _legalize_slice_scatter(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    data, src = call.args[0], call.args[1]
    bounds = list(call.args[2:5])  # PrimExprs
    shape, src_shape = (getattr(v.ty, "shape", None) for v in (data, src))
    if isinstance(shape, relax.ShapeExpr) and isinstance(src_shape, relax.ShapeExpr):
        extent = shape.values[int(call.attrs.axis)]
        whole = (
            all(tvm.ir.is_prim_expr(b) for b in bounds)
            and _equal(bounds[0], 0)
            and _equal(bounds[1], extent)
            and _equal(bounds[2], 1)
        )
        same = len(shape.values) == len(src_shape.values) and all(
            _equal(a, b) for a, b in zip(shape.values, src_shape.values)
        )
        if whole and same and not isinstance(extent, tvm.tirx.IntImm):
            return src
    return _TVM_SLICE_SCATTER(bb, call)


def _equal(a, b) -> bool:
    return bool(Analyzer().can_prove_equal(a, b))


_TVM_LEGALIZE = tvm.ir.Op.get("relax.strided_slice").get_attr("FLegalize")
_TVM_SLICE_SCATTER = tvm.ir.Op.get("relax.slice_scatter").get_attr("FLegalize")

LEGALIZE_MAP = {
    "relax.strided_slice": _legalize_strided_slice,
    "relax.slice_scatter": _legalize_slice_scatter,
}

__all__ = ["LEGALIZE_MAP"]
