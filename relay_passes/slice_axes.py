"""Slices along a negative axis of a tensor with a symbolic dim.

TVM 0.27 legalizes such a ``strided_slice`` through topi's ``dynamic_strided_slice_with_axes``,
which does not count a negative axis from the end: "Check failed: axis < src_tensor_dim (-1
vs. 2)". torch.export writes ``x[..., 1:]``, ``x.narrow(-1, ...)`` and ``torch.diff(x, dim=-1)``
with ``axes=(-1,)``, so transformers' decoders (their packed-sequence check), CodeGen, Phi-3 and
Mamba imported with a dynamic batch failed to build. :data:`LEGALIZE_MAP`, given to
``LegalizeOps``, counts the axes from the front first and legalizes as TVM does.
"""

from __future__ import annotations

import tvm
from tvm import relax


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


_TVM_LEGALIZE = tvm.ir.Op.get("relax.strided_slice").get_attr("FLegalize")

LEGALIZE_MAP = {"relax.strided_slice": _legalize_strided_slice}

__all__ = ["LEGALIZE_MAP"]
