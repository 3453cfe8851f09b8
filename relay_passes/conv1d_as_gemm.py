"""Conv1dAsGemm: a 1-D convolution over a symbolic length as an explicit im2col and a GEMM.

:class:`.conv1d_as_conv2d.Conv1dAsConv2d` sends static-shape ``conv1d`` to the conv2d paths,
which all need static shapes. Over a symbolic length (an audio model exported with a dynamic
number of samples, ConvBERT with a dynamic sequence) a ``conv1d`` was TVM's generic loops, that
no CPU rule schedules: wav2vec 2.0's feature extractor and positional conv ran at 2 GFLOP/s,
50 times slower than the static build. Here an ``NCW``/``OIW`` ``conv1d`` of ``g`` groups over a
symbolic length becomes::

    x'   = permute(reshape(pad(x), [n, g, c/g, w']), [1, 0, 3, 2])     # [g, n, w', c/g]
    cols = take(x', ow * stride + tap * dilation, axis=2)             # [g, n, ow, k, c/g]
    out  = matmul(reshape(cols, [g, n * ow, k * c/g]), w')            # w': [g, k * c/g, f/g]
    out  = reshape(permute(reshape(out, [g, n, ow, f/g]), [1, 0, 3, 2]), [n, f, ow])

(without the group axis when ``g`` is 1), so that the GEMM, over ``n * ow`` symbolic rows that
:class:`.symbolic_rows.PadSymbolicRows` pads, runs on the bf16 (or fp32) GEMM kernels and the
gather is one vectorised copy of channel vectors. The columns take ``k / stride`` times the
input's memory: for wav2vec 2.0's positional conv (128 taps, stride 1), 128 times. A depthwise
``conv1d`` (ConvBERT's) becomes GEMMs of one column each, padded to a vector of columns: still
3.4x faster than TVM's loops. (As a sum over its taps of strided slices times the tap's weights,
FuseOps fused the transpose and pad before it into every tap's read, and it ran 1.6x slower
than the GEMMs.)
"""

from __future__ import annotations

import tvm
from tvm import relax, tirx
from tvm.relax import PyExprMutator

from tvmamp.tensors import out_dtype

from .bindings import rewrite_functions

_CONV1D = tvm.ir.Op.get("relax.nn.conv1d")


@tvm.transform.module_pass(opt_level=0, name="tvmamp.Conv1dAsGemm")
class Conv1dAsGemm:
    """Rewrite each NCW conv1d whose length is symbolic (and whose channels and kernel are
    static) as an im2col gather and a GEMM."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        """Rewrite the symbolic-length 1-D convolutions of every Relax function of ``mod``."""
        return rewrite_functions(mod, _Rewriter(mod))


@relax.expr_functor.mutator
class _Rewriter(PyExprMutator):
    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if call.op != _CONV1D or not _rewritable(call):
            return call
        data, weight = call.args
        attrs = call.attrs
        n, _, width = data.ty.shape.values
        filters, per_group, taps = (int(d) for d in weight.ty.shape.values)
        groups, out_width = int(attrs.groups), call.ty.shape.values[2]
        stride, dilation = int(attrs.strides[0]), int(attrs.dilation[0])
        left, right = (int(p) for p in attrs.padding)
        emit = self.builder_.emit
        if left or right:
            data = emit(relax.op.nn.pad(data, [0, 0, 0, 0, left, right]))
            width = width + left + right
        dtype = out_dtype(call, str(data.ty.dtype))
        rows = emit(relax.op.reshape(data, [n, groups, per_group, width]))
        rows = emit(relax.op.permute_dims(rows, [1, 0, 3, 2]))  # [g, n, w, c/g]
        index = emit(relax.op.multiply(_arange(out_width), relax.const(stride, "int64")))
        offsets = relax.op.multiply(_arange(taps), relax.const(dilation, "int64"))
        index = emit(relax.op.add(relax.op.expand_dims(index, 1), offsets))  # [ow, k]
        cols = emit(relax.op.take(rows, index, axis=2))  # [g, n, ow, k, c/g]
        depth = taps * per_group
        cols = emit(relax.op.reshape(cols, [groups, n * out_width, depth]))
        # w[f, c/g, k] -> [g, k * c/g, f/g]: tap-major, as the columns
        kernel = relax.op.reshape(weight, [groups, filters // groups, per_group, taps])
        kernel = emit(relax.op.permute_dims(kernel, [0, 3, 2, 1]))
        kernel = emit(relax.op.reshape(kernel, [groups, depth, filters // groups]))
        if groups == 1:
            cols = emit(relax.op.reshape(cols, [n * out_width, depth]))
            kernel = emit(relax.op.reshape(kernel, [depth, filters]))
        out = emit(relax.op.matmul(cols, kernel, out_dtype=dtype))
        out = emit(relax.op.reshape(out, [groups, n, out_width, filters // groups]))
        out = emit(relax.op.permute_dims(out, [1, 0, 3, 2]))  # [n, g, f/g, ow]
        return relax.op.reshape(out, [n, filters, out_width])


def _arange(end) -> relax.Expr:
    return relax.op.arange(tirx.IntImm("int64", 0), end, dtype="int64")


def _rewritable(call: relax.Call) -> bool:
    """An NCW / OIW conv1d with static channels and kernel, and a symbolic length."""
    attrs = call.attrs
    if (attrs.data_layout, attrs.kernel_layout, attrs.out_layout) != ("NCW", "OIW", "NCW"):
        return False
    data, weight = call.args
    shapes = [getattr(e.ty, "shape", None) for e in (data, weight, call)]
    if any(not isinstance(s, relax.ShapeExpr) for s in shapes) or len(attrs.padding) != 2:
        return False
    (_, channels, width), kernel = shapes[0].values, shapes[1].values
    static = all(isinstance(d, tirx.IntImm) for d in (channels, *kernel))
    return static and not isinstance(width, tirx.IntImm)


__all__ = ["Conv1dAsGemm"]
