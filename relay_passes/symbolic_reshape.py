"""Keep a reshape over symbolic sizes a view where TVM would make it a slow copy kernel.

A reshape of a dense tensor needs no kernel: Relax's ``RewriteDataflowReshape`` turns a
legalized reshape back into a view (``vm.builtin.reshape``) when TVM's
``has_reshape_pattern`` proves that its kernel copies element ``i`` to element ``i``. Over
symbolic sizes that proof can fail: XLNet's relative shift reshapes ``(batch, heads, 2 * seq -
1, seq)`` to ``(batch, heads, seq, 2 * seq - 1)``, the flattened indices were not simplified,
``AnnotateTIROpPattern`` called the kernel opaque, and it ran as a copy whose every index is a
chain of ``//`` and ``%`` by symbolic sizes: 1.2 ms a call for 262,000 elements, a third of the
model.

:data:`LEGALIZE_MAP`, given to ``LegalizeOps``, leaves such a reshape a Relax ``reshape``
(lowered to the view), and legalizes every other reshape as TVM does: a static one, or one whose
kernel TVM recognises, may still fuse with its neighbours.
"""

from __future__ import annotations

import tvm
from tvm import relax, te, topi

from tvmamp.tensors import static_shape


def _legalize_reshape(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    x = call.args[0]
    shape = call.ty.shape
    if not isinstance(x.ty.shape, relax.ShapeExpr) or not isinstance(shape, relax.ShapeExpr):
        return _TVM_LEGALIZE(bb, call)
    if static_shape(x.ty) is not None and static_shape(call.ty) is not None:
        return _TVM_LEGALIZE(bb, call)
    data = te.placeholder(list(x.ty.shape), x.ty.dtype, "data")
    kernel = te.create_prim_func([data, topi.reshape(data, list(shape))])
    if relax.analysis.has_reshape_pattern(kernel):
        return _TVM_LEGALIZE(bb, call)
    return call  # not legalized: a view


_TVM_LEGALIZE = tvm.ir.Op.get("relax.reshape").get_attr("FLegalize")

LEGALIZE_MAP = {"relax.reshape": _legalize_reshape}

__all__ = ["LEGALIZE_MAP"]
