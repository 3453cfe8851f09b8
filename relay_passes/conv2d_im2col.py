"""Gathers of a conv2d's taps from NHWC rows: im2col (fused into a GEMM or a kernel of its own)
and the window kernels (depthwise convs, pooling) that reduce the taps where they gather them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from tvm import relax, te, tirx
from tvm.ir.expr import Constant

from tvmamp.tensors import int_or_expr, np_dtype

from .symbolic_rows import is_whole, whole_tiles

# relax's OpPatternKind.kOpaque: FuseOps leaves the gather alone, so that it stays one
# contiguous copy per (pixel, tap) instead of being inlined into (and recomputing) its producers.
OPAQUE_PATTERN = 8
# relax's OpPatternKind.kOutEWiseFusable: FuseOps fuses the elementwise ops that follow a
# conv GEMM into it (its epilogue), as it does for a matmul.
GEMM_PATTERN = 4
# PrimFunc attribute naming the gather's channel count; tvmamp.schedules.cpu.bf16_conv reads it.
IM2COL_ATTR = "tvmamp.im2col_channels"
# Block annotation (the channel count) of the gather inside a conv GEMM kernel: the bf16 GEMM
# rule inlines that block into the packing of the GEMM's left operand, not into the GEMM.
GATHER_ATTR = "tvmamp.im2col_gather"
# Block annotation of a window kernel's reduction (depthwise conv or pooling on rows):
# tvmamp.schedules.cpu.grouped_conv schedules it, vectorised over the channels.
WINDOW_ATTR = "tvmamp.rows_window"


@dataclass(frozen=True)
class Geometry:
    """Input size, kernel, strides, dilations, padding and output size of one NCHW conv2d.

    The batch ``n``, the height and the width may be symbolic (a model exported with a dynamic
    batch or image size). Rows of a symbolic number of pixels are padded to whole ``row_tile``
    rows (:attr:`out_rows`), so that the bf16 GEMM reads them in place; kernels that gather
    from rows read only their first :attr:`pixels`, and compute their padded rows as copies of
    their last real one.
    """

    n: int | tirx.PrimExpr
    c: int
    h: int | tirx.PrimExpr
    w: int | tirx.PrimExpr
    kh: int
    kw: int
    stride: tuple[int, int]
    dilation: tuple[int, int]
    pad: tuple[int, int, int, int]  # top, left, bottom, right
    out_h: int | tirx.PrimExpr
    out_w: int | tirx.PrimExpr
    groups: int = 1
    row_tile: int = 1

    @classmethod
    def of(
        cls, attrs, data_shape: tuple, weight_shape: tuple[int, ...], out_shape: tuple = ()
    ) -> Geometry:
        """Read the ``attrs`` of a conv2d with NCHW ``data_shape`` and OIHW ``weight_shape``;
        ``out_shape``, its NCHW result's shape where known (its symbolic sizes as Relax wrote
        them, so that the rows' shapes are the same expressions as the graph's)."""
        return cls.make(
            data_shape,
            weight_shape[2:],
            attrs.strides,
            attrs.dilation,
            attrs.padding,
            int(getattr(attrs, "groups", 1)),
            out_shape[2:],
        )

    @classmethod
    def make(
        cls, data_shape, kernel, strides, dilation, padding, groups: int = 1, out_hw=()
    ) -> Geometry:
        """The geometry of a window ``kernel`` (KH, KW) sliding over NCHW ``data_shape``
        (whose batch, height and width may be symbolic), with output sizes ``out_hw`` where
        given."""
        n, c, h, w = (int_or_expr(d) for d in data_shape)
        kh, kw = (int(k) for k in kernel)
        stride = tuple(int(s) for s in strides)
        dilation = tuple(int(d) for d in dilation)
        pad = tuple(int(p) for p in padding)
        out_h = (h + pad[0] + pad[2] - dilation[0] * (kh - 1) - 1) // stride[0] + 1
        out_w = (w + pad[1] + pad[3] - dilation[1] * (kw - 1) - 1) // stride[1] + 1
        if out_hw:
            out_h, out_w = (int_or_expr(d) for d in out_hw)
        return cls(n, int(c), h, w, kh, kw, stride, dilation, pad, out_h, out_w, groups)

    @property
    def symbolic(self) -> bool:
        """Whether the number of pixels is symbolic (a symbolic batch, height or width)."""
        return any(_symbolic(d) for d in (self.n, self.h, self.w))

    @property
    def pixels(self) -> int | tirx.PrimExpr:
        """The output pixels, ``n*OH*OW``."""
        return self.n * self.out_h * self.out_w

    @property
    def out_rows(self) -> int | tirx.PrimExpr:
        """The rows of the output: :attr:`pixels`, rounded up to whole ``row_tile`` rows when
        the batch is symbolic."""
        return whole_tiles(self.pixels, self.row_tile) if self.symbolic else self.pixels

    def image_pixel(self, r) -> tuple[tirx.PrimExpr, tirx.PrimExpr]:
        """``(image, pixel in the image)`` of output row ``r``; a padded row (past
        :attr:`pixels`) is the last real one."""
        padded = self.symbolic and not is_whole(self.pixels, self.row_tile)
        real = tirx.min(r, self.pixels - 1) if padded else r
        per_image = divisor(self.out_h * self.out_w)
        return real // per_image, real % per_image

    def out_yx(self, pix) -> tuple[tirx.PrimExpr, tirx.PrimExpr]:
        """``(y, x)`` of pixel ``pix`` of an output image."""
        width = divisor(self.out_w)
        return pix // width, pix % width

    def input_rows(self, rows: relax.Expr) -> relax.Expr:
        """``rows`` of the input without the padded rows: ``[n*H*W, ...]``, a view (a slice
        fused into the kernel that computes the rows broke its window or GEMM schedule, and
        TVM's simplifier divided by zero on a max pool's over ``h // 2``)."""
        if not self.symbolic:
            return rows
        shape = [self.n * self.h * self.w, *rows.ty.shape.values[1:]]
        return relax.op.memory.view(rows, relax.ShapeExpr(shape))

    @property
    def group_channels(self) -> int:
        """Input channels of one group (``c`` for a dense conv)."""
        return self.c // self.groups

    @property
    def pointwise(self) -> bool:
        """Whether the im2col matrix is the input rows themselves (1x1, stride 1, no padding)."""
        return (self.kh, self.kw, self.stride, self.pad) == (1, 1, (1, 1), (0, 0, 0, 0))


def _symbolic(dim) -> bool:
    """Whether a dimension is a PrimExpr other than a constant."""
    return not isinstance(dim, int | tirx.IntImm)


def divisor(size):
    """``size`` to divide an index by: a symbolic one at least 1. TVM's simplifier, proving a
    kernel's bounds, folded ``pix // (w // 2)`` at ``w < 2`` and failed ("Divide by zero");
    where the size is 0 there are no pixels to index, so the guard changes nothing."""
    return size if isinstance(size, int) else tirx.max(size, 1)


def emit_im2col(bb: relax.BlockBuilder, rows: relax.Expr, g: Geometry) -> relax.Var:
    """Emit ``col[n*OH*OW, (ky*KW + kx)*C + c]`` gathered from ``rows[n*H*W, C]``."""
    if g.pointwise:
        return rows
    call = bb.call_te(
        lambda x: _im2col(x, g),
        rows,
        primfunc_name_hint="im2col",
        primfunc_attrs={"op_pattern": OPAQUE_PATTERN, IM2COL_ATTR: g.c},
    )
    return bb.emit(call)


def emit_run_im2col(
    bb: relax.BlockBuilder, rows: relax.Expr, g: Geometry, nhwc: relax.Expr | None = None
) -> relax.Var:
    """Emit ``col[n*OH*OW, ky*R + j]`` for a conv with dilation 1: each kernel row's taps
    ``(kx, c)`` of one output pixel, a run of ``KW*C`` values contiguous in the zero-padded
    NHWC input, copied whole (one vector copy per kernel row, where :func:`emit_im2col`
    copies ``C`` values per tap: 3 for an RGB stem). ``R`` is :func:`run_length`, the run
    rounded up to a pair (the bf16 GEMM's reduction unit); the extra value of each run is zero.
    The weight matrix must have zero rows there (:func:`run_weight`). The input is ``rows``,
    or ``nhwc`` (``[n, H, W, C]``) where that is given instead.
    """
    run = run_length(g)
    extra = 1 if run > g.kw * g.c else 0  # a last row, so that every run's pair is in bounds
    if nhwc is None:
        nhwc = relax.op.reshape(g.input_rows(rows), (g.n, g.h, g.w, g.c))
    pads = [0, 0, g.pad[0], g.pad[2] + extra, g.pad[1], g.pad[3], 0, 0]
    padded = bb.emit(relax.op.nn.pad(nhwc, pads))
    hp, wp = g.h + g.pad[0] + g.pad[2] + extra, g.w + g.pad[1] + g.pad[3]
    flat = bb.emit(relax.op.reshape(padded, (g.n * hp * wp * g.c,)))

    def gather(x: te.Tensor) -> te.Tensor:
        def value(r, ky, j):
            b, pix = g.image_pixel(r)
            y, x0 = g.out_yx(pix)
            y, x0 = y * g.stride[0] + ky, x0 * g.stride[1]
            load = x[((b * hp + y) * wp + x0) * g.c + j]
            if run == g.kw * g.c:
                return load
            return tirx.Select(j < g.kw * g.c, load, tirx.const(0, x.dtype))

        shape = (g.out_rows, g.kh, run)
        return te.compute(shape, value, name="im2col")

    call = bb.call_te(
        gather,
        flat,
        primfunc_name_hint="im2col_runs",
        primfunc_attrs={"op_pattern": OPAQUE_PATTERN, IM2COL_ATTR: run},
    )
    col = bb.emit(call)
    return bb.emit(relax.op.reshape(col, (g.out_rows, g.kh * run)))


def run_length(g: Geometry) -> int:
    """The values :func:`emit_run_im2col` copies per kernel row: ``KW*C``, rounded up to even."""
    return g.kw * g.c + (g.kw * g.c) % 2


def run_weight(weight: relax.Expr, g: Geometry, f: int) -> relax.Expr:
    """The OIHW ``weight`` as the ``[KH*R, F]`` matrix of :func:`emit_run_im2col`'s columns
    (zero rows where a run was rounded up to a pair)."""
    rows = reshape(permute_dims(weight, (2, 3, 1, 0)), (g.kh, g.kw * g.c, f))
    extra = run_length(g) - g.kw * g.c
    if extra:
        rows = _now(
            rows,
            lambda a: np.pad(a, ((0, 0), (0, extra), (0, 0))),
            lambda: relax.op.nn.pad(rows, [0, 0, 0, extra, 0, 0]),
        )
    return reshape(rows, (g.kh * run_length(g), f))


def emit_conv_gemm(
    bb: relax.BlockBuilder, rows: relax.Expr, weight: relax.Expr, g: Geometry, out_dtype: str
) -> relax.Var:
    """Emit ``rows -> im2col -> @ weight`` as one kernel whose gather feeds the GEMM's packing.

    ``weight`` is the ``[KH*KW*C, F]`` matrix. The im2col matrix is never stored as such: the
    GEMM rule inlines the gather block (annotated :data:`GATHER_ATTR`) into its copy of the
    left operand, so each conv copies its input once, straight into the kernel's layout.
    """
    call = bb.call_te(
        lambda x, w: _gemm(_im2col(x, g, {GATHER_ATTR: g.c}), w, out_dtype),
        rows,
        weight,
        primfunc_name_hint="conv2d_gemm",
        primfunc_attrs={"op_pattern": GEMM_PATTERN},
    )
    return bb.emit(call)


def _gemm(col: te.Tensor, weight: te.Tensor, out_dtype: str) -> te.Tensor:
    """``col @ weight`` accumulated in ``out_dtype``, as ``relax.matmul`` legalises it."""
    k = te.reduce_axis((0, col.shape[1]), name="k")
    return te.compute(
        (col.shape[0], weight.shape[1]),
        lambda i, j: te.sum(col[i, k].astype(out_dtype) * weight[k, j].astype(out_dtype), axis=k),
        name="matmul",
    )


def _im2col(rows: te.Tensor, g: Geometry, attrs: dict | None = None) -> te.Tensor:
    """The gather itself, zero outside the input (the conv's padding)."""
    shape = (g.out_rows, g.kh * g.kw * g.c)
    return te.compute(shape, lambda r, q: gather_tap(rows, g, r, q, 0), name="im2col", attrs=attrs)


def gather_tap(rows: te.Tensor, g: Geometry, r, q, first_channel) -> tirx.PrimExpr:
    """Column ``q = tap * channels + c`` of im2col row ``r``: the input channel
    ``first_channel + c`` under tap ``tap`` of output pixel ``r``, zero in the padding;
    ``channels`` is :attr:`Geometry.group_channels`."""
    tap, ch = q // g.group_channels, q % g.group_channels
    zero = tirx.const(0, rows.dtype)
    return window_tap(rows, g, r, tap // g.kw, tap % g.kw, first_channel + ch, zero)


def window_tap(rows: te.Tensor, g: Geometry, r, ky, kx, channel, outside) -> tirx.PrimExpr:
    """``rows[pixel, channel]`` under tap ``(ky, kx)`` of output pixel ``r`` (in the dtype of
    ``outside``), ``outside`` in the padding; the load is clamped to the input, so that it is
    always in bounds."""
    b, pix = g.image_pixel(r)
    y, x = g.out_yx(pix)
    iy = y * g.stride[0] + ky * g.dilation[0] - g.pad[0]
    ix = x * g.stride[1] + kx * g.dilation[1] - g.pad[1]
    inside = tirx.all(iy >= 0, iy < g.h, ix >= 0, ix < g.w)
    y = tirx.max(tirx.min(iy, g.h - 1), 0)
    x = tirx.max(tirx.min(ix, g.w - 1), 0)
    value = rows[(b * g.h + y) * g.w + x, channel]
    dtype = str(outside.ty)
    if str(rows.dtype) != dtype:
        value = value.astype(dtype)
    return tirx.if_then_else(inside, value, outside)


def emit_depthwise(
    bb: relax.BlockBuilder, rows: relax.Expr, weight: relax.Expr, g: Geometry, out_dtype: str
) -> relax.Var:
    """Emit a depthwise conv (one channel per group) of ``rows[n*H*W, C]`` as a window kernel.

    ``weight`` is ``[KH*KW, C]``: each tap's per-channel weights, a contiguous vector. The
    result ``[n*OH*OW, C]`` is accumulated in ``out_dtype``.
    """

    def depthwise(x: te.Tensor, w: te.Tensor) -> te.Tensor:
        ky, kx = te.reduce_axis((0, g.kh), name="ky"), te.reduce_axis((0, g.kw), name="kx")
        zero = tirx.const(0, out_dtype)

        def tap(r, c):
            value = window_tap(x, g, r, ky, kx, c, zero)
            return te.sum(value * w[ky * g.kw + kx, c].astype(out_dtype), axis=[ky, kx])

        shape = (g.out_rows, g.c)
        return te.compute(shape, tap, name="depthwise", attrs={WINDOW_ATTR: g.c})

    call = bb.call_te(
        depthwise,
        rows,
        weight,
        primfunc_name_hint="depthwise_rows",
        primfunc_attrs={"op_pattern": GEMM_PATTERN},
    )
    return bb.emit(call)


def emit_pool(
    bb: relax.BlockBuilder, rows: relax.Expr, g: Geometry, kind: str, include_pad: bool = True
) -> relax.Var:
    """Emit a ``kind`` ("max" or "avg") pooling of ``rows[n*H*W, C]`` as a window kernel.

    The taps are reduced in fp32 (TVM widens bf16 arithmetic anyway) and the result is cast
    back to the rows' dtype. An average divides by the window's size, or with
    ``include_pad=False`` by the number of its taps inside the input.
    """
    if kind not in ("max", "avg"):
        raise ValueError(f"tvmamp.emit_pool: kind {kind!r} is not one of max, avg")

    def pool(x: te.Tensor) -> te.Tensor:
        ky, kx = te.reduce_axis((0, g.kh), name="ky"), te.reduce_axis((0, g.kw), name="kx")
        outside = tirx.min_value("float32") if kind == "max" else tirx.const(0, "float32")
        reduce = te.max if kind == "max" else te.sum

        def tap(r, c):
            return reduce(window_tap(x, g, r, ky, kx, c, outside), axis=[ky, kx])

        shape = (g.out_rows, g.c)
        acc = te.compute(shape, tap, name="pool", attrs={WINDOW_ATTR: g.c})
        if kind == "max":
            return te.compute(shape, lambda r, c: acc[r, c].astype(x.dtype), name="pool_cast")
        return te.compute(
            shape,
            lambda r, c: (acc[r, c] / _window_size(g, r, include_pad)).astype(x.dtype),
            name="pool_average",
        )

    call = bb.call_te(
        pool,
        rows,
        primfunc_name_hint=f"{kind}_pool_rows",
        primfunc_attrs={"op_pattern": GEMM_PATTERN},
    )
    return bb.emit(call)


def _window_size(g: Geometry, r, include_pad: bool) -> tirx.PrimExpr:
    """The taps an average divides by: all of them, or those of output pixel ``r`` inside the
    input (the padding excluded)."""
    if include_pad:
        return tirx.const(float(g.kh * g.kw), "float32")
    _, pix = g.image_pixel(r)
    counts = []
    y, x = g.out_yx(pix)
    for out, axis, size, kernel in ((y, 0, g.h, g.kh), (x, 1, g.w, g.kw)):
        first = out * g.stride[axis] - g.pad[axis]
        inside = [
            tirx.all(first + k * g.dilation[axis] >= 0, first + k * g.dilation[axis] < size)
            for k in range(kernel)
        ]
        counts.append(sum(tirx.Select(c, 1, 0) for c in inside))
    return (counts[0] * counts[1]).astype("float32")


# Weight and bias layouts are computed here when the operand is a constant: FoldConstant would
# compile (with LLVM) one kernel for each such op, 195 of them for ShuffleNet's convs.


def reshape(expr: relax.Expr, shape: tuple[int, ...]) -> relax.Expr:
    """``relax.op.reshape(expr, shape)``, computed now when ``expr`` is a constant."""
    return _now(expr, lambda a: a.reshape(shape), lambda: relax.op.reshape(expr, shape))


def permute_dims(expr: relax.Expr, axes: tuple[int, ...]) -> relax.Expr:
    """``relax.op.permute_dims(expr, axes)``, computed now when ``expr`` is a constant."""
    return _now(expr, lambda a: a.transpose(axes), lambda: relax.op.permute_dims(expr, axes))


def astype(expr: relax.Expr, dtype: str) -> relax.Expr:
    """``relax.op.astype(expr, dtype)``, computed now when ``expr`` is a constant."""
    cast = lambda a: a.astype(np_dtype(dtype))  # noqa: E731
    return _now(expr, cast, lambda: relax.op.astype(expr, dtype))


def _now(expr: relax.Expr, compute: Callable, op: Callable) -> relax.Expr:
    """``compute`` on a constant's numpy value, as a constant; else the Relax ``op()``."""
    if not isinstance(expr, Constant):
        return op()
    data = np.array(compute(expr.value.numpy()), order="C")
    return relax.const(data, str(data.dtype))
