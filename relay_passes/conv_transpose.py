"""Rewrite a strided conv2d_transpose into stride_h * stride_w sub-pixel conv2ds, interleaved.

TVM computes ``conv2d_transpose`` as a conv over the input dilated with ``stride - 1`` zeros
between pixels, so at stride 2 three quarters of its multiply-adds multiply zeros. Per axis,
the transposed conv is ``O[o] = sum_{i, k: o + p = i*s + k} X[i] * W[k]``; the outputs of one
residue ``r = o mod s`` (``o = s*q + r``) only meet the taps ``k = s*m + kr`` with
``kr = (r + p) mod s``, at ``i = q + (r + p) // s - m``. That is an ordinary correlation
(``conv2d``) of ``X`` with the sub-sampled, flipped kernel ``W[s*(M-1-j) + kr]`` (``M`` taps),
padded by ``M - 1 - (r + p) // s`` on the left. Each of the ``s_h * s_w`` residues is one
dense conv2d on the undilated input (``CPUConv2d`` or, for bf16, :mod:`.conv2d_to_gemm`), all
``ceil(OH / s_h) x ceil(OW / s_w)`` large; they are stacked to
``[N, F, OH/s_h, s_h, OW/s_w, s_w]``, reshaped to ``[N, F, OH', OW']`` and cropped to the
output size. When every residue reads the same input window (kernel and padding multiples of
the stride, e.g. U-Net's 2x2 stride 2) the sub-kernels are concatenated into one conv with
``s_h * s_w * F`` filters, followed by a depth-to-space reshape and transpose. The
sub-kernels are slices of the weight, folded at compile time when it is a constant.

Only NCHW/IOHW ``groups=1``, ``dilation=1`` transposed convs with a stride above 1, whose
shapes are static but for perhaps a symbolic batch, are rewritten; others are left to TVM's
legalization, and so are those a later pass claims (``leave``: with avx512_bf16,
:mod:`.conv2d_to_gemm` runs bf16 ones whose taps overlap little as a GEMM and a col2im gather
on NHWC rows).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import tvm
from tvm import relax
from tvm.relax import PyExprMutator

from tvmamp.tensors import static_shape, static_shape_but_batch

from .bindings import rewrite_functions

_CONV_T = tvm.ir.Op.get("relax.nn.conv2d_transpose")


@tvm.transform.module_pass(opt_level=0, name="tvmamp.ConvTransposeToSubPixel")
class ConvTransposeToSubPixel:
    """Rewrite every strided conv2d_transpose this pass handles (see the module docstring).

    Parameters
    ----------
    leave : callable, optional
        ``leave(call) -> bool``: conv2d_transpose calls for which it is true are left as they
        are, for a later pass to rewrite.
    """

    def __init__(self, leave: Callable[[relax.Call], bool] | None = None):
        self.leave = leave

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        """Rewrite the conv2d_transpose calls of every Relax function of ``mod``."""
        return rewrite_functions(mod, _Rewriter(mod, self.leave))


def _rewritable(call: relax.Call) -> bool:
    """Return whether ``call`` is a conv2d_transpose this pass handles."""
    attrs = call.attrs
    layouts = (attrs.data_layout, attrs.kernel_layout, attrs.out_layout)
    if layouts != ("NCHW", "IOHW", "NCHW") or int(attrs.groups) != 1:
        return False
    if any(int(d) != 1 for d in attrs.dilation) or all(int(s) == 1 for s in attrs.strides):
        return False
    data, weight = call.args
    shapes = (
        static_shape_but_batch(data.ty),
        static_shape(weight.ty),
        static_shape_but_batch(call.ty),
    )
    return None not in shapes and min(shapes[2][1:]) > 0


class _Residue:
    """One output residue ``r`` of one axis: its kernel taps and the input window it reads."""

    def __init__(self, r: int, stride: int, pad: int, kernel: int, size: int, count: int):
        self.count, self.stride = count, stride
        self.first = (r + pad) % stride  # the first kernel tap ``kr``
        self.taps = max(0, math.ceil((kernel - self.first) / stride))  # ``M``
        left = self.taps - 1 - (r + pad) // stride
        right = count - 1 + self.taps - size - left  # ``count`` outputs of a ``size`` input
        # Negative padding crops the input instead.
        self.pad = (max(left, 0), max(right, 0))
        self.crop = (max(-left, 0), size - max(-right, 0))
        self.cropped = self.crop != (0, size)
        self.geometry = (self.taps, self.pad, self.crop)


@relax.expr_functor.mutator
class _Rewriter(PyExprMutator):
    """Replaces each handled conv2d_transpose by its sub-pixel convs and their interleave."""

    def __init__(self, mod: tvm.IRModule, leave: Callable[[relax.Call], bool] | None):
        super().__init__(mod)
        self.leave = leave

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if call.op != _CONV_T or not _rewritable(call):
            return call
        if self.leave is not None and self.leave(call):
            return call
        return self._sub_pixel(call)

    def _sub_pixel(self, call: relax.Call) -> relax.Expr:
        data, weight = call.args
        n, _, h, w = static_shape_but_batch(data.ty)
        kernel = static_shape(weight.ty)
        f, oh, ow = static_shape_but_batch(call.ty)[1:]
        (sh, sw), pad = (int(s) for s in call.attrs.strides), [int(p) for p in call.attrs.padding]
        qh, qw = -(-oh // sh), -(-ow // sw)
        rows_y = [_Residue(r, sh, pad[0], kernel[2], h, qh) for r in range(sh)]
        rows_x = [_Residue(r, sw, pad[1], kernel[3], w, qw) for r in range(sw)]
        if any(r.crop[1] <= r.crop[0] for r in (*rows_y, *rows_x)):
            return call  # a padding that crops the whole input away: left to legalization
        oihw = self.builder_.emit(relax.op.permute_dims(weight, (1, 0, 2, 3)))
        out_dtype = str(call.ty.dtype)  # ``out_dtype``, or the input's when unset
        if all(len({r.geometry for r in rows}) == 1 for rows in (rows_y, rows_x)):
            out = self._one_conv(data, oihw, rows_y, rows_x, out_dtype)
        else:
            out = self._stacked_convs(data, oihw, rows_y, rows_x, out_dtype)
        out = relax.op.reshape(out, (n, f, qh * sh, qw * sw))
        if (qh * sh, qw * sw) != (oh, ow):
            out = relax.op.strided_slice(self.builder_.emit(out), [2, 3], [0, 0], [oh, ow])
        return out

    def _one_conv(self, data, oihw, rows_y, rows_x, out_dtype) -> relax.Var:
        """Residues that all read the same window (``K`` and ``p`` multiples of ``s``): one
        conv with ``s_h * s_w * F`` filters, then depth-to-space."""
        bb = self.builder_
        if rows_y[0].taps == 0 or rows_x[0].taps == 0:
            return self._stacked_convs(data, oihw, rows_y, rows_x, out_dtype)
        kernels = [self._sub_kernel(oihw, ry, rx) for ry in rows_y for rx in rows_x]
        f = static_shape(oihw.ty)[0]
        stacked = bb.emit(relax.op.concat(kernels, axis=0))  # [(ry, rx, f), c, ky, kx]
        conv = self._conv(data, stacked, rows_y[0], rows_x[0], out_dtype)
        n, _, qh, qw = static_shape_but_batch(conv.ty)
        out = bb.emit(relax.op.reshape(conv, (n, len(rows_y), len(rows_x), f, qh, qw)))
        return bb.emit(relax.op.permute_dims(out, (0, 3, 4, 1, 5, 2)))

    def _stacked_convs(self, data, oihw, rows_y, rows_x, out_dtype) -> relax.Var:
        """One conv per residue, stacked to ``[N, F, OH/s_h, s_h, OW/s_w, s_w]``."""
        bb = self.builder_
        stacked = []
        for ry in rows_y:
            row = [self._residue_conv(data, oihw, ry, rx, out_dtype) for rx in rows_x]
            stacked.append(bb.emit(relax.op.stack(row, axis=4)))
        return bb.emit(relax.op.stack(stacked, axis=3))

    def _residue_conv(self, data, oihw, ry: _Residue, rx: _Residue, out_dtype) -> relax.Var:
        """The conv2d of one (y, x) residue: ``[N, F, ceil(OH/s_h), ceil(OW/s_w)]``."""
        if ry.taps == 0 or rx.taps == 0:  # no kernel tap reaches these outputs
            n, f = static_shape_but_batch(data.ty)[0], static_shape(oihw.ty)[0]
            return self.builder_.emit(relax.op.zeros((n, f, ry.count, rx.count), out_dtype))
        kernel = self._sub_kernel(oihw, ry, rx)
        return self._conv(data, kernel, ry, rx, out_dtype)

    def _sub_kernel(self, oihw, ry: _Residue, rx: _Residue) -> relax.Var:
        """The residue's taps of the OIHW weight, flipped."""
        sh, sw = ry.stride, rx.stride
        begin, end = (ry.first, rx.first), (ry.first + sh * ry.taps, rx.first + sw * rx.taps)
        sub = relax.op.strided_slice(oihw, [2, 3], begin, end, (sh, sw))
        return self.builder_.emit(relax.op.flip(relax.op.flip(sub, 2), 3))

    def _conv(self, data, kernel, ry: _Residue, rx: _Residue, out_dtype) -> relax.Var:
        """``kernel`` over the residue's window of ``data``."""
        bb = self.builder_
        if ry.cropped or rx.cropped:
            begin, end = (ry.crop[0], rx.crop[0]), (ry.crop[1], rx.crop[1])
            data = bb.emit(relax.op.strided_slice(data, [2, 3], begin, end))
        padding = (ry.pad[0], rx.pad[0], ry.pad[1], rx.pad[1])
        return bb.emit(relax.op.nn.conv2d(data, kernel, padding=padding, out_dtype=out_dtype))
