"""The im2col gather of a conv2d from NHWC rows, fused into its GEMM or as a kernel of its own."""

from __future__ import annotations

from dataclasses import dataclass

from tvm import relax, te, tirx

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


@dataclass(frozen=True)
class Geometry:
    """Input size, kernel, strides, dilations, padding and output size of one NCHW conv2d."""

    n: int
    c: int
    h: int
    w: int
    kh: int
    kw: int
    stride: tuple[int, int]
    dilation: tuple[int, int]
    pad: tuple[int, int, int, int]  # top, left, bottom, right
    out_h: int
    out_w: int

    @classmethod
    def of(cls, attrs, data_shape: tuple[int, ...], weight_shape: tuple[int, ...]) -> Geometry:
        """Read the ``attrs`` of a conv2d with NCHW ``data_shape`` and OIHW ``weight_shape``."""
        n, c, h, w = data_shape
        kh, kw = weight_shape[2:]
        stride = tuple(int(s) for s in attrs.strides)
        dilation = tuple(int(d) for d in attrs.dilation)
        pad = tuple(int(p) for p in attrs.padding)
        out_h = (h + pad[0] + pad[2] - dilation[0] * (kh - 1) - 1) // stride[0] + 1
        out_w = (w + pad[1] + pad[3] - dilation[1] * (kw - 1) - 1) // stride[1] + 1
        return cls(n, c, h, w, kh, kw, stride, dilation, pad, out_h, out_w)

    @property
    def pointwise(self) -> bool:
        """Whether the im2col matrix is the input rows themselves (1x1, stride 1, no padding)."""
        return (self.kh, self.kw, self.stride, self.pad) == (1, 1, (1, 1), (0, 0, 0, 0))


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
    pixels = g.out_h * g.out_w

    def gather(r, q):
        b, pix = r // pixels, r % pixels
        tap, ch = q // g.c, q % g.c
        iy = pix // g.out_w * g.stride[0] + tap // g.kw * g.dilation[0] - g.pad[0]
        ix = pix % g.out_w * g.stride[1] + tap % g.kw * g.dilation[1] - g.pad[1]
        inside = tirx.all(iy >= 0, iy < g.h, ix >= 0, ix < g.w)
        y = tirx.max(tirx.min(iy, g.h - 1), 0)
        x = tirx.max(tirx.min(ix, g.w - 1), 0)
        value = rows[(b * g.h + y) * g.w + x, ch]
        return tirx.if_then_else(inside, value, tirx.const(0, rows.dtype))

    return te.compute((g.n * pixels, g.kh * g.kw * g.c), gather, name="im2col", attrs=attrs)
