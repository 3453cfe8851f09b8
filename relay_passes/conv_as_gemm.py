"""ConvAsGemm: a convolution over symbolic spatial sizes as an explicit im2col and a GEMM.

:class:`.conv1d_as_conv2d.Conv1dAsConv2d` sends static-shape ``conv1d`` to the conv2d paths,
and the direct conv needs static spatial sizes (the conv-to-GEMM rewrite takes symbolic ones
only on Zen4/5, see ``leave`` below). A
``conv1d`` over a symbolic length (an audio model exported with a dynamic number of samples,
ConvBERT with a dynamic sequence) or a ``conv2d`` over a symbolic height or width (a CNN
exported with dynamic image sizes) was TVM's generic loops, which no CPU rule schedules:
wav2vec 2.0's feature extractor and positional conv ran at 2 GFLOP/s, 50 times slower than the
static build, and a small CNN with dynamic height and width 300 times. Here an ``NCHW``/``OIHW``
``conv2d`` (a ``conv1d`` is one of height 1) of ``g`` groups becomes::

    x'   = reshape(permute(reshape(pad(x), [n, g, c/g, h' * w']), [1, 0, 3, 2]),
                   [g, n * h' * w', c/g])
    cols = take(x', windows, axis=1)               # [g, R, kh * kw, c/g], R = n * oh * ow padded
    out  = matmul(reshape(cols, [g, R, kh * kw * c/g]), w')[:, :n * oh * ow]
    out  = reshape(permute(reshape(out, [g, n, oh, ow, f/g]), [1, 0, 4, 2, 3]), [n, f, oh, ow])

(without the group axis when ``g`` is 1), with ``w'`` the weight as ``[g, kh * kw * c/g,
f/g]``. Row ``r`` of ``windows`` (output pixel ``(b, y, x)``) holds ``b * h' * w' + (y * sy +
ky * dy) * w' + x * sx + kx * dx`` for each tap; the rows are padded to whole tiles of the
GEMM (``tile``) by repeating the last window, whose results the slice drops. So the GEMM, over
provably whole tiles of symbolic rows, runs on the bf16 (or fp32) GEMM kernels reading the
columns in place (padded by :class:`.symbolic_rows.PadSymbolicRows`, they were copied once
more: 0.34 of wav2vec 2.0's 4.2 ms), and the gather is one vectorised copy of channel
vectors. The index arithmetic is takes from ``arange`` grids: a ``match_cast`` typing it made
TVM segfault (``TypeMutator``). Where :class:`.conv2d_to_gemm.Conv2dToGemm` runs bf16 convs
over symbolic sizes on NHWC rows (Zen4/5, ``leave``), this pass leaves them to it.

The columns take ``kh * kw / (sy * sx)`` times the input's memory: for wav2vec 2.0's
positional conv (128 taps, stride 1), 128 times. A depthwise conv (ConvBERT's) becomes GEMMs
of one column each, padded to a vector of columns: still 3.4x faster than TVM's loops. (As a
sum over its taps of strided slices times the tap's weights, FuseOps fused the transpose and
pad before it into every tap's read, and it ran 1.6x slower than the GEMMs.) A conv whose
only symbolic size is its batch is left to the direct conv (``CPUConv2d``).
"""

from __future__ import annotations

import tvm
from tvm import relax, tirx
from tvm.relax import PyExprMutator

from tvmamp.tensors import out_dtype

from .bindings import rewrite_functions
from .symbolic_rows import first_rows, whole_tiles

_CONV1D = tvm.ir.Op.get("relax.nn.conv1d")
_CONV2D = tvm.ir.Op.get("relax.nn.conv2d")
_LAYOUTS = {_CONV1D: ("NCW", "OIW", "NCW"), _CONV2D: ("NCHW", "OIHW", "NCHW")}


@tvm.transform.module_pass(opt_level=0, name="tvmamp.ConvAsGemm")
class ConvAsGemm:
    """Rewrite each NCW conv1d and NCHW conv2d whose spatial sizes are symbolic (and whose
    channels and kernel are static) as an im2col gather and a GEMM.

    Parameters
    ----------
    tile : int
        The GEMM's rows are padded to a multiple of this (``CPUMatmulBF16.Config.tile_i``).
    leave : callable, optional
        ``leave(call)`` is true for the convs to leave alone: those that
        :class:`.conv2d_to_gemm.Conv2dToGemm` runs on NHWC rows, whose layout it keeps between
        the convs (and pools, norms, activations) where this pass goes back to NCHW at each.
    """

    def __init__(self, tile: int = 8, leave=None):
        self.tile = tile
        self.leave = leave

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        """Rewrite the symbolic-size convolutions of every Relax function of ``mod``."""
        return rewrite_functions(mod, _Rewriter(mod, self.tile, self.leave))


@relax.expr_functor.mutator
class _Rewriter(PyExprMutator):
    def __init__(self, mod: tvm.IRModule, tile: int, leave):
        super().__init__(mod)
        self.tile = tile
        self.leave = leave

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if call.op not in _LAYOUTS or not _rewritable(call):
            return call
        if self.leave is not None and self.leave(call):
            return call
        data, weight = call.args
        attrs = call.attrs
        one = call.op == _CONV1D  # a conv1d: a conv2d of height 1
        n, _, *spatial = data.ty.shape.values
        filters, per_group, *kernel = (int(d) for d in weight.ty.shape.values)
        out_spatial = list(call.ty.shape.values[2:])
        strides, dilation = [int(s) for s in attrs.strides], [int(d) for d in attrs.dilation]
        pads = [int(p) for p in attrs.padding]  # (left, right) or (top, left, bottom, right)
        before, after = pads[: len(pads) // 2], pads[len(pads) // 2 :]
        emit = self.builder_.emit
        if any(pads):  # [0, 0, 0, 0, top, bottom, left, right] (conv1d: left, right)
            widths = [p for pair in zip(before, after) for p in pair]
            data = emit(relax.op.nn.pad(data, [0, 0, 0, 0, *widths]))
        if one:
            spatial, kernel, out_spatial = [1, *spatial], [1, *kernel], [1, *out_spatial]
            strides, dilation, before, after = (
                [1, *strides],
                [1, *dilation],
                [0, *before],
                [0, *after],
            )
        height, width = (s + b + a for s, b, a in zip(spatial, before, after))
        groups = int(attrs.groups)
        dtype = out_dtype(call, str(data.ty.dtype))
        x = emit(relax.op.reshape(data, [n, groups, per_group, height * width]))
        x = emit(relax.op.permute_dims(x, [1, 0, 3, 2]))  # [g, n, h * w, c/g]
        x = emit(relax.op.reshape(x, [groups, n * height * width, per_group]))
        rows = n * out_spatial[0] * out_spatial[1]
        padded = whole_tiles(rows, self.tile)
        windows = self._windows(n, (height, width), out_spatial, strides, dilation, kernel, padded)
        cols = emit(relax.op.take(x, windows, axis=1))  # [g, padded, taps, c/g]
        depth = kernel[0] * kernel[1] * per_group
        cols = emit(relax.op.reshape(cols, [groups, padded, depth]))
        # w[f, c/g, kh, kw] -> [g, kh * kw * c/g, f/g]: tap-major, as the columns
        fg = filters // groups
        w = relax.op.reshape(weight, [groups, fg, per_group, kernel[0] * kernel[1]])
        w = emit(relax.op.permute_dims(w, [0, 3, 2, 1]))
        w = emit(relax.op.reshape(w, [groups, depth, fg]))
        if groups == 1:
            cols = emit(relax.op.reshape(cols, [padded, depth]))
            w = emit(relax.op.reshape(w, [depth, filters]))
        out = emit(relax.op.matmul(cols, w, out_dtype=dtype))
        out = emit(first_rows(out, rows, padded))  # the padded rows off
        out = emit(relax.op.reshape(out, [groups, n, *out_spatial, fg]))
        out = emit(relax.op.permute_dims(out, [1, 0, 4, 2, 3]))  # [n, g, f/g, oh, ow]
        return relax.op.reshape(out, call.ty.shape)

    def _windows(self, n, size, out_size, strides, dilation, kernel, padded) -> relax.Expr:
        """``[padded, kh * kw]`` indices into the ``n * h * w`` pixels of the input: for
        output pixel ``(b, y, x)`` (row ``r``), ``b * h * w + (y * sy + ky * dy) * w + x * sx +
        kx * dx``. The rows past ``n * oh * ow`` repeat the last window (their results are
        sliced off), so that the GEMM's rows are whole tiles without a padded copy of the
        columns. Each product with a symbolic size is a take from an ``arange`` grid."""
        emit = self.builder_.emit
        (height, width), (out_h, out_w) = size, out_size
        grid = emit(relax.op.reshape(_arange(n * height * width), [n, height, width]))
        starts = emit(relax.op.take(grid, _steps(emit, out_h, strides[0]), axis=1))
        starts = emit(relax.op.take(starts, _steps(emit, out_w, strides[1]), axis=2))
        rows = n * out_h * out_w
        starts = emit(relax.op.reshape(starts, [rows]))  # [n * oh * ow]
        pick = relax.op.clip(_arange(padded), relax.prim_value(_zero()), relax.prim_value(rows - 1))
        starts = emit(relax.op.take(starts, emit(pick), axis=0))
        plane = emit(relax.op.reshape(_arange(height * width), [height, width]))
        taps = emit(relax.op.take(plane, _steps(emit, kernel[0], dilation[0]), axis=0))
        taps = emit(relax.op.take(taps, _steps(emit, kernel[1], dilation[1]), axis=1))
        taps = emit(relax.op.reshape(taps, [kernel[0] * kernel[1]]))
        return emit(relax.op.add(relax.op.expand_dims(starts, 1), taps))  # [padded, kh * kw]


def _steps(emit, count, step: int) -> relax.Expr:
    """``[0, step, 2 * step, ...]``, ``count`` values (int64)."""
    return emit(relax.op.multiply(_arange(count), relax.const(step, "int64")))


def _zero() -> tirx.IntImm:
    return tirx.IntImm("int64", 0)


def _arange(end) -> relax.Expr:
    return relax.op.arange(_zero(), end, dtype="int64")


def _rewritable(call: relax.Call) -> bool:
    """An NCW / NCHW conv with static channels and kernel and a symbolic spatial size."""
    attrs = call.attrs
    if (attrs.data_layout, attrs.kernel_layout, attrs.out_layout) != _LAYOUTS[call.op]:
        return False
    data, weight = call.args
    shapes = [getattr(e.ty, "shape", None) for e in (data, weight, call)]
    if any(not isinstance(s, relax.ShapeExpr) for s in shapes):
        return False
    (_, channels, *spatial), kernel = shapes[0].values, shapes[1].values
    if len(attrs.padding) != 2 * len(spatial):
        return False
    static = all(isinstance(d, tirx.IntImm) for d in (channels, *kernel))
    return static and not all(isinstance(d, tirx.IntImm) for d in spatial)


__all__ = ["ConvAsGemm"]
