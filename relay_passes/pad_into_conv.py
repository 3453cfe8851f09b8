"""FoldPadIntoConv: a zero pad of a convolution's spatial axes becomes the conv's own padding.

Exporters often pad explicitly before a convolution: an ONNX ``Pad`` for ``padding="same"``
(timm's ConvMixer and its TensorFlow ports, tf2onnx graphs) or a ``F.pad`` in the model.
The pad is then a copy of its own, and the conv reads a tensor that is no longer what the
conv-to-GEMM rewrite follows: under a dynamic batch, ConvMixer's depthwise convs went back to
NCHW for the pad and its transposes (26 of 133 ms in the pad's copy alone). Here::

    conv(pad(x, [0, 0, 0, 0, t, b, l, r]), w, padding=[T, L, B, R])
        -> conv(x, w, padding=[T + t, L + l, B + b, R + r])

for NCW, NCHW and NCDHW ``conv1d``/``conv2d``/``conv3d`` whose pad is constant zeros on the
spatial axes only (batch and channels unpadded, no negative widths). The pad stays where
something else reads it.
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax import PyExprMutator

from .bindings import rebuilt_conv, rewrite_functions

_PAD = tvm.ir.Op.get("relax.nn.pad")
_LAYOUTS = {
    tvm.ir.Op.get("relax.nn.conv1d"): "NCW",
    tvm.ir.Op.get("relax.nn.conv2d"): "NCHW",
    tvm.ir.Op.get("relax.nn.conv3d"): "NCDHW",
}


@tvm.transform.module_pass(opt_level=0, name="tvmamp.FoldPadIntoConv")
class FoldPadIntoConv:
    """Fold each zero pad of a convolution's spatial axes into its padding."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        """Fold the pads of the convolutions of every Relax function of ``mod``."""
        return rewrite_functions(mod, _Rewriter(mod))


@relax.expr_functor.mutator
class _Rewriter(PyExprMutator):
    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if call.op not in _LAYOUTS:
            return call
        layout = _LAYOUTS[call.op]
        attrs = call.attrs
        data = call.args[0]
        pad = self.lookup_binding(data) if isinstance(data, relax.Var) else None
        widths = _spatial_widths(pad, len(layout))
        if widths is None or str(attrs.data_layout) != layout:
            return call
        spatial = len(layout) - 2
        padding = [int(p) for p in attrs.padding]
        if len(padding) != 2 * spatial:
            return call
        # conv padding: all the "before" widths, then all the "after" ones
        before = [p + w for p, w in zip(padding[:spatial], widths[0::2], strict=True)]
        after = [p + w for p, w in zip(padding[spatial:], widths[1::2], strict=True)]
        return rebuilt_conv(call, pad.args[0], call.args[1], padding=before + after)


def _spatial_widths(pad: relax.Expr | None, rank: int) -> list[int] | None:
    """The ``[before, after]`` widths of each spatial axis of a constant zero ``pad`` of a
    ``rank``-D tensor that leaves its batch and channels alone, else None."""
    if not isinstance(pad, relax.Call) or pad.op != _PAD:
        return None
    attrs = pad.attrs
    widths = [int(w) for w in attrs.pad_width]
    if str(attrs.pad_mode) != "constant" or float(attrs.pad_value) != 0.0:
        return None
    if len(widths) != 2 * rank or any(widths[:4]) or min(widths) < 0:
        return None
    return widths[4:]


__all__ = ["FoldPadIntoConv"]
