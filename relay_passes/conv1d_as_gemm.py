"""Conv1dAsGemm: a 1-D convolution over a symbolic length as an explicit im2col and a GEMM.

:class:`.conv1d_as_conv2d.Conv1dAsConv2d` sends static-shape ``conv1d`` to the conv2d paths,
which all need static shapes. Over a symbolic length (an audio model exported with a dynamic
number of samples, ConvBERT with a dynamic sequence) a ``conv1d`` was TVM's generic loops, that
no CPU rule schedules: wav2vec 2.0's feature extractor and positional conv ran at 2 GFLOP/s,
50 times slower than the static build. Here an ``NCW``/``OIW`` ``conv1d`` of ``g`` groups over a
symbolic length becomes::

    x'   = reshape(permute(reshape(pad(x), [n, g, c/g, w']), [1, 0, 3, 2]), [g, n * w', c/g])
    cols = take(x', windows, axis=1)                       # [g, R, k, c/g], R = n * ow padded
    out  = matmul(reshape(cols, [g, R, k * c/g]), w')[:, :n * ow]    # w': [g, k * c/g, f/g]
    out  = reshape(permute(reshape(out, [g, n, ow, f/g]), [1, 0, 3, 2]), [n, f, ow])

(without the group axis when ``g`` is 1). Row ``r = b * ow + o`` of ``windows`` is ``b * w' + o
* stride + t * dilation`` for each tap ``t``; the rows are padded to whole tiles of the GEMM
(``tile``) by repeating the last window, whose results the slice drops. So the GEMM, over
provably whole tiles of symbolic rows, runs on the bf16 (or fp32) GEMM kernels reading the
columns in place (padded by :class:`.symbolic_rows.PadSymbolicRows`, they were copied once
more: 0.34 of wav2vec 2.0's 4.2 ms), and the gather is one vectorised copy of channel
vectors. The columns take ``k / stride`` times the
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
    static) as an im2col gather and a GEMM.

    Parameters
    ----------
    tile : int
        The GEMM's rows are padded to a multiple of this (``CPUMatmulBF16.Config.tile_i``).
    """

    def __init__(self, tile: int = 8):
        self.tile = tile

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        """Rewrite the symbolic-length 1-D convolutions of every Relax function of ``mod``."""
        return rewrite_functions(mod, _Rewriter(mod, self.tile))


@relax.expr_functor.mutator
class _Rewriter(PyExprMutator):
    def __init__(self, mod: tvm.IRModule, tile: int):
        super().__init__(mod)
        self.tile = tile

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
        x = emit(relax.op.reshape(data, [n, groups, per_group, width]))
        x = emit(relax.op.permute_dims(x, [1, 0, 3, 2]))  # [g, n, w, c/g]
        x = emit(relax.op.reshape(x, [groups, n * width, per_group]))
        rows = n * out_width
        padded = (rows + self.tile - 1) // self.tile * self.tile
        windows = self._windows(n, width, out_width, stride, dilation, taps, padded)
        cols = emit(relax.op.take(x, windows, axis=1))  # [g, padded, k, c/g]
        depth = taps * per_group
        cols = emit(relax.op.reshape(cols, [groups, padded, depth]))
        # w[f, c/g, k] -> [g, k * c/g, f/g]: tap-major, as the columns
        kernel = relax.op.reshape(weight, [groups, filters // groups, per_group, taps])
        kernel = emit(relax.op.permute_dims(kernel, [0, 3, 2, 1]))
        kernel = emit(relax.op.reshape(kernel, [groups, depth, filters // groups]))
        if groups == 1:
            cols = emit(relax.op.reshape(cols, [padded, depth]))
            kernel = emit(relax.op.reshape(kernel, [depth, filters]))
        out = emit(relax.op.matmul(cols, kernel, out_dtype=dtype))
        axis = len(out.ty.shape) - 2  # the padded rows off
        out = emit(relax.op.strided_slice(out, [axis], [0], [rows], assume_inbound=True))
        out = emit(relax.op.reshape(out, [groups, n, out_width, filters // groups]))
        out = emit(relax.op.permute_dims(out, [1, 0, 3, 2]))  # [n, g, f/g, ow]
        return relax.op.reshape(out, [n, filters, out_width])

    def _windows(self, n, width, out_width, stride, dilation, taps, padded) -> relax.Expr:
        """``[padded, taps]`` indices into the ``n * width`` rows of the input: row ``r``
        (output pixel ``o`` of image ``b``) reads ``b * width + o * stride + t * dilation``.
        The rows past ``n * out_width`` repeat the last window (their results are sliced off),
        so that the GEMM's rows are whole tiles without a padded copy of the columns."""
        emit = self.builder_.emit
        grid = emit(relax.op.reshape(_arange(n * width), [n, width]))  # b * width + j
        pixels = emit(relax.op.multiply(_arange(out_width), relax.const(stride, "int64")))
        starts = emit(relax.op.take(grid, pixels, axis=1))  # [n, ow]
        starts = emit(relax.op.reshape(starts, [n * out_width]))
        last = relax.prim_value(n * out_width - 1)
        pick = relax.op.clip(_arange(padded), relax.prim_value(_zero()), last)
        starts = emit(relax.op.take(starts, emit(pick), axis=0))
        offsets = relax.op.multiply(_arange(taps), relax.const(dilation, "int64"))
        return emit(relax.op.add(relax.op.expand_dims(starts, 1), offsets))  # [padded, taps]


def _zero() -> tirx.IntImm:
    return tirx.IntImm("int64", 0)


def _arange(end) -> relax.Expr:
    return relax.op.arange(_zero(), end, dtype="int64")


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
