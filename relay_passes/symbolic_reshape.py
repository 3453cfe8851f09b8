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
kernel TVM recognises, may still fuse with its neighbours. A reshape to the shape its input
already has is no op at all: TVM made it a copy kernel where its result leaves the dataflow
block (``RewriteDataflowReshape`` turns only dataflow-internal reshapes into views), and a
decoder's ``present = Reshape(concat(past, new))`` copied its whole cache on every step,
2.4 of 8 ms at 2048 cached positions (``relay_passes/decode_step.py``'s one-sequence copy).
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import relax, te, tirx, topi

from tvmamp.tensors import static_shape


def _legalize_reshape(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    x = call.args[0]
    shape = call.ty.shape
    if not isinstance(x.ty.shape, relax.ShapeExpr) or not isinstance(shape, relax.ShapeExpr):
        return _TVM_LEGALIZE(bb, call)
    if _same_shape(x.ty.shape.values, shape.values):
        return x
    if static_shape(x.ty) is not None and static_shape(call.ty) is not None:
        return _TVM_LEGALIZE(bb, call)
    data = te.placeholder(list(x.ty.shape), x.ty.dtype, "data")
    kernel = te.create_prim_func([data, topi.reshape(data, list(shape))])
    if _is_reshape(kernel):
        return _TVM_LEGALIZE(bb, call)
    return call  # not legalized: a view


def _same_shape(a, b) -> bool:
    """Whether the shapes ``a`` and ``b`` are the same expressions. Only the same: a reshape of
    ``[n, s + p]`` to ``[n, p + s]`` replaced by its input, FuseTIR mapped ``s`` to ``p`` in a
    fused softmax behind it (an ill-formed kernel)."""
    return tvm_ffi.structural_equal(a, b)


def _is_reshape(kernel: tirx.PrimFunc) -> bool | None:
    """TVM's ``has_reshape_pattern``, or None where its analysis raises (see
    :func:`RewriteDataflowReshape`)."""
    try:
        return bool(relax.analysis.has_reshape_pattern(kernel))
    except tvm.error.InternalError:
        return None


@tvm.transform.module_pass(opt_level=0, name="tvmamp.RewriteDataflowReshape")
def RewriteDataflowReshape(mod: tvm.IRModule, _ctx) -> tvm.IRModule:  # noqa: N802 (a pass)
    """Relax's ``RewriteDataflowReshape`` (reshape kernels back to views), past the kernels
    whose reshape analysis raises.

    TVM 0.27's ``has_reshape_pattern`` fails a ``CanProveDivisible`` check on some transposes
    over a sum of a symbolic and a static size: onnxruntime's GPT-2 decoder transposes its keys,
    ``(batch, past + seq, heads, dim)`` with a symbolic past and a static seq, and the build
    stopped with an InternalError. Such a kernel is no reshape: it is swapped for a stub with
    its signature (which the analysis rejects) while the pass runs, and put back after.
    """
    try:
        return relax.transform.RewriteDataflowReshape()(mod)
    except tvm.error.InternalError:  # analysed only where TVM's own analysis failed
        pass
    unreadable = {
        gv: func
        for gv, func in mod.functions_items()
        if isinstance(func, tirx.PrimFunc) and _is_reshape(func) is None
    }
    mod = mod.clone()
    for gv, func in unreadable.items():
        mod[gv] = func.with_body(tirx.Evaluate(0))
    mod = relax.transform.RewriteDataflowReshape()(mod)
    for gv, func in unreadable.items():
        mod[gv] = func
    return mod


_TVM_LEGALIZE = tvm.ir.Op.get("relax.reshape").get_attr("FLegalize")

LEGALIZE_MAP = {"relax.reshape": _legalize_reshape}

__all__ = ["LEGALIZE_MAP", "RewriteDataflowReshape"]
