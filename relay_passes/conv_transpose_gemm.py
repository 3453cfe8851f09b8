"""Transposed convs on NHWC rows: one GEMM over the input rows, then a col2im gather.

A transposed conv scatters every input pixel, times its kernel, into a ``KH x KW`` window of
the output: ``O[n, f, iy*s + ky - p, ix*s + kx - p] += sum_c X[n, c, iy, ix] * W[c, f, ky, kx]``.
On rows ``[n*H*W, C]`` the products are one GEMM, ``Z = rows @ W2`` with ``W2[c, (ky, kx, f)]``
the IOHW weight laid out at compile time: every multiply-add of the transposed conv once and
none on the zeros of a dilated input. The col2im gather then sums, for each output pixel, the
rows of ``Z`` that land on it: along an axis, output ``o`` meets the taps
``k = (o + p) mod s + s*m`` of input ``i = (o + p) // s - m``, at most ``ceil(K / s)`` of them
(exactly one with ``K == s``: a depth-to-space). Each term is a contiguous channel vector of
``Z``, so the gather is vector copies and adds, and its result ``[n*OH*OW, F]`` is rows that
the next conv reads as they are (:mod:`.conv2d_to_gemm`).

The GEMM's result holds ``KH*KW/(s_h*s_w)`` times as many values as the output, so the rewrite
is for transposed convs whose taps overlap little (see ``Conv2dToGemm.max_transpose_taps``);
the sub-pixel rewrite (:mod:`.conv_transpose`) takes the others.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tvm import relax, te, tirx

from tvmamp.tensors import static_shape

from .conv2d_im2col import Geometry, permute_dims, reshape

# relax's OpPatternKind.kOutEWiseFusable: FuseOps fuses the elementwise ops that follow (bias,
# activation, cast) into the gather, but not a transpose back to NCHW, which its own
# register-tiled kernel does faster than a fused gather-and-transpose (3.5 GB/s).
GATHER_PATTERN = 4


@dataclass(frozen=True)
class TransposeGeometry:
    """Input size, kernel, strides, padding and output size of one NCHW conv2d_transpose."""

    n: int
    c: int
    h: int
    w: int
    f: int
    kh: int
    kw: int
    stride: tuple[int, int]
    pad: tuple[int, int]  # top, left: the output's offset in the full scatter
    out_h: int
    out_w: int

    @classmethod
    def of(cls, call: relax.Call) -> TransposeGeometry:
        """Read a static-shape NCHW/IOHW ``conv2d_transpose`` call."""
        n, c, h, w = static_shape(call.args[0].ty)
        _, f, kh, kw = static_shape(call.args[1].ty)
        out_h, out_w = static_shape(call.ty)[2:]
        stride = tuple(int(s) for s in call.attrs.strides)
        pad = tuple(int(p) for p in call.attrs.padding[:2])
        return cls(n, c, h, w, f, kh, kw, stride, pad, out_h, out_w)

    @property
    def taps(self) -> int:
        """The most kernel taps that land on one output pixel."""
        return math.ceil(self.kh / self.stride[0]) * math.ceil(self.kw / self.stride[1])

    @property
    def input(self) -> Geometry:
        """The input as a pointwise :class:`Geometry` (its rows are the GEMM's left operand)."""
        return Geometry.make((self.n, self.c, self.h, self.w), (1, 1), (1, 1), (1, 1), (0,) * 4)


def transpose_weight(weight: relax.Expr, g: TransposeGeometry) -> relax.Expr:
    """The IOHW weight as the ``[C, KH*KW*F]`` matrix ``W2[c, (ky, kx, f)]`` (a constant stays
    one, laid out now)."""
    ohwf = permute_dims(weight, (0, 2, 3, 1))
    return reshape(ohwf, (g.c, g.kh * g.kw * g.f))


def emit_col2im(bb: relax.BlockBuilder, products: relax.Expr, g: TransposeGeometry) -> relax.Var:
    """Emit the sum of ``products[n*H*W, (ky, kx, f)]`` that lands on each output pixel.

    The result is the rows ``[n*OH*OW, F]`` of the transposed conv, in the dtype of
    ``products``; output pixels that no tap reaches are zero.
    """
    call = bb.call_te(
        lambda z: te.compute((g.n * g.out_h * g.out_w, g.f), _col2im(z, g), name="col2im"),
        products,
        primfunc_name_hint="col2im",
        primfunc_attrs={"op_pattern": GATHER_PATTERN},
    )
    return bb.emit(call)


def _col2im(z: te.Tensor, g: TransposeGeometry):
    """``value(r, f)``: output row ``r``'s channel ``f``, summed over the taps that reach it."""
    zero = tirx.const(0, z.dtype)

    def value(r, f):
        pixels = g.out_h * g.out_w
        b, pix = r // pixels, r % pixels
        ys = _axis_taps(pix // g.out_w + g.pad[0], g.stride[0], g.kh, g.h)
        xs = _axis_taps(pix % g.out_w + g.pad[1], g.stride[1], g.kw, g.w)
        total = None
        for ky, iy, inside_y in ys:
            for kx, ix, inside_x in xs:
                row = (b * g.h + iy) * g.w + ix
                term = z[row, (ky * g.kw + kx) * g.f + f]
                term = tirx.if_then_else(tirx.all(inside_y, inside_x), term, zero)
                total = term if total is None else total + term
        return total

    return value


def _axis_taps(t, stride: int, kernel: int, size: int) -> list:
    """``(k, i, inside)`` of each tap ``m`` that may land on the scatter position ``t = o + p``
    along one axis: ``k`` and ``i`` clamped (always in bounds), ``inside`` whether the tap and
    input pixel exist."""
    taps = []
    for m in range(math.ceil(kernel / stride)):
        k, i = t % stride + stride * m, t // stride - m
        inside = tirx.all(k < kernel, i >= 0, i < size)
        taps.append((tirx.min(k, kernel - 1), tirx.max(tirx.min(i, size - 1), 0), inside))
    return taps
