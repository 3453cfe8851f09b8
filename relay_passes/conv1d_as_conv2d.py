"""Conv1dAsConv2d: run 1-D convolutions as 2-D ones of height 1, on the conv2d kernels.

TVM legalizes ``conv1d`` with TOPI's generic loops, which no CPU rule of tvmamp schedules: a
wav2vec-style feature extractor (a 16 000-sample waveform through three conv1d + GELU layers)
took 32 ms at O2 against onnxruntime's 1.1 ms. A 1-D convolution is a 2-D one whose input and
kernel have height 1, so each static-shape ``NCW``/``OIW`` ``conv1d`` (and ``IOW``
``conv1d_transpose``) becomes

    reshape(conv2d(reshape(x, [N, C, 1, W]), reshape(w, [F, C / g, 1, K]),
                   strides=(1, s), padding=(0, left, 0, right), dilation=(1, d), groups=g),
            [N, F, OW])

and from there takes every conv2d path (the direct conv, im2col + bf16 GEMM, grouped and
depthwise kernels, the sub-pixel transposed conv). The reshapes are free views of contiguous
tensors. Convs over a symbolic batch (a model exported with a dynamic batch axis) are
rewritten too: the conv2d paths take a symbolic batch, where TVM's loops ran a conv1d stack
150 times slower than its static build. Other dynamic shapes (a symbolic length goes to
:mod:`.conv_as_gemm`) and other layouts are left to TVM's legalization.
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax import PyExprMutator

from tvmamp.tensors import static_shape, static_shape_but_batch

from .bindings import rewrite_functions

_CONV1D = tvm.ir.Op.get("relax.nn.conv1d")
_CONV1D_T = tvm.ir.Op.get("relax.nn.conv1d_transpose")
_LAYOUTS = {_CONV1D: ("NCW", "OIW", "NCW"), _CONV1D_T: ("NCW", "IOW", "NCW")}


@tvm.transform.module_pass(opt_level=0, name="tvmamp.Conv1dAsConv2d")
class Conv1dAsConv2d:
    """Rewrite each NCW conv1d / conv1d_transpose (static, or over a symbolic batch) as a
    height-1 conv2d."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        """Rewrite the 1-D convolutions of every Relax function of ``mod``."""
        return rewrite_functions(mod, _Rewriter(mod))


@relax.expr_functor.mutator
class _Rewriter(PyExprMutator):
    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if call.op not in _LAYOUTS or not _rewritable(call):
            return call
        data, weight = call.args
        (n, c, w), (k0, k1, kw) = static_shape_but_batch(data.ty), static_shape(weight.ty)
        attrs = call.attrs
        data4 = relax.op.reshape(data, (n, c, 1, w))
        weight4 = relax.op.reshape(weight, (k0, k1, 1, kw))
        left, right = (int(p) for p in attrs.padding)
        options = {
            "strides": (1, int(attrs.strides[0])),
            "padding": (0, left, 0, right),
            "dilation": (1, int(attrs.dilation[0])),
            "groups": int(attrs.groups),
            "out_dtype": attrs.out_dtype,
        }
        if call.op == _CONV1D:
            conv = relax.op.nn.conv2d(data4, weight4, **options)
        else:
            extra = (0, int(attrs.output_padding[0]))
            conv = relax.op.nn.conv2d_transpose(
                data4, weight4, output_padding=extra, kernel_layout="IOHW", **options
            )
        out = self.builder_.emit(conv)
        return relax.op.reshape(out, call.ty.shape)


def _rewritable(call: relax.Call) -> bool:
    attrs = call.attrs
    layouts = (attrs.data_layout, attrs.kernel_layout, attrs.out_layout)
    data, weight = call.args
    shapes = (
        static_shape_but_batch(data.ty),
        static_shape(weight.ty),
        static_shape_but_batch(call.ty),
    )
    return layouts == _LAYOUTS[call.op] and None not in shapes and len(attrs.padding) == 2
