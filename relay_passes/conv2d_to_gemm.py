"""Rewrite bf16 NCHW conv2d into im2col + matmul, so that the bf16 GEMM kernels run convolutions.

The CPU bf16 kernels (``vdpbf16ps`` and AMX, :mod:`tvmamp.schedules.cpu_bf16_matmul`) are GEMM
kernels. A convolution ``O[n, f, y, x] = sum W[f, c, ky, kx] * D[n, c, y*s + ky*d, x*s + kx*d]``
becomes ``col[n*y*x, (ky*kx)*c] @ W2[(ky*kx)*c, f]``: ``col`` is gathered by one injective
kernel (padding included; channels innermost, so that a previous conv's NHWC result is read
contiguously once its transpose is inlined), ``W2`` is the weight transposed to
``[ky, kx, c, f]`` and flattened, which ``FoldConstant``
evaluates at compile time when the weight is a constant (and the GEMM rule then packs it, also
at compile time), and the result is reshaped and transposed back to NCHW, where the batch-norm
and activation epilogues that follow the conv fuse into that transpose.
"""

from __future__ import annotations

import tvm
from tvm import relax, te, tirx
from tvm.relax import PyExprMutator

_CONV = tvm.ir.Op.get("relax.nn.conv2d")


@tvm.transform.module_pass(opt_level=0, name="tvmamp.Conv2dToGemm")
class Conv2dToGemm:
    """Rewrite every static-shape NCHW/OIHW ``groups=1`` conv2d whose inputs are ``dtype``.

    Parameters
    ----------
    dtype : str
        The input dtype of the convolutions to rewrite ("bfloat16" by default); others are
        left alone.
    """

    def __init__(self, dtype: str = "bfloat16"):
        self.dtype = dtype

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        """Rewrite the conv2d calls of every Relax function of ``mod``."""
        rewriter = _Rewriter(mod, self.dtype)
        for gvar, func in mod.functions_items():
            if isinstance(func, relax.Function):
                rewriter.builder_.update_func(gvar, rewriter.visit_expr(func))
        return rewriter.builder_.get()


def _static_shape(expr: relax.Expr) -> list[int] | None:
    shape = expr.ty.shape if isinstance(expr.ty, relax.TensorType) else None
    if shape is None or not all(isinstance(s, tirx.IntImm) for s in shape):
        return None
    return [int(s) for s in shape]


def _rewritable(call: relax.Call, dtype: str) -> bool:
    """Return whether ``call`` is a conv2d this pass handles."""
    attrs = call.attrs
    layouts = (attrs.data_layout, attrs.kernel_layout, attrs.out_layout)
    if layouts != ("NCHW", "OIHW", "NCHW") or int(attrs.groups) != 1:
        return False
    data, weight = call.args
    dtypes = {str(data.ty.dtype), str(weight.ty.dtype)}
    return dtypes == {dtype} and None not in (_static_shape(data), _static_shape(weight))


@relax.expr_functor.mutator
class _Rewriter(PyExprMutator):
    """Replaces each matching conv2d by im2col, matmul, reshape and transpose."""

    def __init__(self, mod: tvm.IRModule, dtype: str):
        super().__init__(mod)
        self.dtype = dtype

    def visit_call_(self, call: relax.Call) -> relax.Expr:  # pylint: disable=arguments-renamed
        call = super().visit_call_(call)
        if call.op != _CONV or not _rewritable(call, self.dtype):
            return call
        data, weight = call.args
        n, c, h, w = _static_shape(data)
        f, _, kh, kw = _static_shape(weight)
        geometry = _Geometry.of(call.attrs, h, w, kh, kw)
        bb = self.builder_
        col = bb.emit(bb.call_te(lambda x: _im2col(x, geometry), data, primfunc_name_hint="im2col"))
        hwio = relax.op.permute_dims(weight, (2, 3, 1, 0))
        w2 = bb.emit(relax.op.reshape(hwio, (kh * kw * c, f)))
        out_dtype = str(call.attrs.out_dtype) or self.dtype
        gemm = bb.emit(relax.op.matmul(col, w2, out_dtype=out_dtype))
        nhwc = bb.emit(relax.op.reshape(gemm, (n, geometry.out_h, geometry.out_w, f)))
        return relax.op.permute_dims(nhwc, (0, 3, 1, 2))


class _Geometry:
    """Strides, dilations, padding and output size of one conv2d."""

    def __init__(self, stride, dilation, pad, out_h, out_w, kh, kw):
        self.stride, self.dilation, self.pad = stride, dilation, pad
        self.out_h, self.out_w, self.kh, self.kw = out_h, out_w, kh, kw

    @classmethod
    def of(cls, attrs, h: int, w: int, kh: int, kw: int) -> _Geometry:
        """Read ``attrs`` of a conv2d with input ``h x w`` and kernel ``kh x kw``."""
        stride = [int(s) for s in attrs.strides]
        dilation = [int(d) for d in attrs.dilation]
        pad = [int(p) for p in attrs.padding]  # top, left, bottom, right
        out_h = (h + pad[0] + pad[2] - dilation[0] * (kh - 1) - 1) // stride[0] + 1
        out_w = (w + pad[1] + pad[3] - dilation[1] * (kw - 1) - 1) // stride[1] + 1
        return cls(stride, dilation, pad, out_h, out_w, kh, kw)


def _im2col(data: te.Tensor, g: _Geometry) -> te.Tensor:
    """``col[n*OH*OW + y*OW + x, (ky*KW + kx)*C + c]``, zero outside the input."""
    n, c, h, w = (int(s) for s in data.shape)
    rows, cols = n * g.out_h * g.out_w, c * g.kh * g.kw

    def gather(r, q):
        b, pix = r // (g.out_h * g.out_w), r % (g.out_h * g.out_w)
        tap, ch = q // c, q % c
        iy = pix // g.out_w * g.stride[0] + tap // g.kw * g.dilation[0] - g.pad[0]
        ix = pix % g.out_w * g.stride[1] + tap % g.kw * g.dilation[1] - g.pad[1]
        inside = tirx.all(iy >= 0, iy < h, ix >= 0, ix < w)
        value = data[b, ch, tirx.max(tirx.min(iy, h - 1), 0), tirx.max(tirx.min(ix, w - 1), 0)]
        return tirx.if_then_else(inside, value, tirx.const(0, data.dtype))

    return te.compute((rows, cols), gather, name="im2col")
