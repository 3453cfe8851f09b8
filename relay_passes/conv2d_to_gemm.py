"""Rewrite bf16 NCHW conv2d into im2col + matmul on NHWC rows, so that GEMM kernels run convs.

The CPU bf16 kernels (``vdpbf16ps`` and AMX, :mod:`tvmamp.schedules.cpu.bf16_matmul`) are GEMM
kernels. A convolution ``O[n, f, y, x] = sum W[f, c, ky, kx] * D[n, c, y*s + ky*d, x*s + kx*d]``
becomes ``col[n*OH*OW, (ky*KW + kx)*C + c] @ W2[(ky*KW + kx)*C + c, f]``: ``W2`` is the weight
transposed to ``[ky, kx, c, f]`` and flattened (``FoldConstant`` evaluates it at compile time,
and the GEMM rule then packs it), and ``col`` is gathered from the input in *NHWC rows*
``[n*H*W, C]`` (:mod:`.conv2d_im2col`), one contiguous channel vector per pixel and tap. The
gather and the GEMM are one kernel: the GEMM rule inlines the gather into its packing of ``col``,
so the im2col matrix is written once, in the layout the GEMM kernel reads (convs with few
channels keep a gather kernel of their own, see ``gather_channels``).

The GEMM result ``[n*OH*OW, F]`` is those rows for the next layer, so it stays in that layout:
the elementwise ops that follow (casts, per-channel bias, inference batch-norm, activations,
residual adds of two such values) are rewritten on the rows, where ``FuseOps`` fuses them into
the GEMM's epilogue, and a following conv gathers straight from them. A value goes back to
NCHW (reshape + transpose) only where something else uses it, so the program's NCHW semantics
are unchanged. Inputs are transposed to rows once, before their first conv.
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax import PyExprMutator

from tvmamp.tensors import static_shape

from .conv2d_im2col import Geometry, emit_conv_gemm, emit_im2col
from .conv2d_rows import Rows, rows_call

_CONV = tvm.ir.Op.get("relax.nn.conv2d")


@tvm.transform.module_pass(opt_level=0, name="tvmamp.Conv2dToGemm")
class Conv2dToGemm:
    """Rewrite every static-shape NCHW/OIHW ``groups=1`` conv2d whose inputs are ``dtype``.

    Parameters
    ----------
    dtype : str
        The input dtype of the convolutions to rewrite ("bfloat16" by default); others, and
        the ops around them, are left alone.
    gather_channels : int
        The im2col gather is fused into the GEMM (:func:`.conv2d_im2col.emit_conv_gemm`) when
        the input channels are a multiple of this (32: one 64-byte bf16 vector per tap, so the
        GEMM's packing copies whole vectors). Other convs (an RGB stem, C = 3) gather with a
        kernel of their own, which copies each tap's few channels faster than the packing's
        element-wise gather does.
    min_channels : int
        Convs with more than 3x3 taps and fewer input channels than this (8) are left alone,
        to the direct conv (``CPUConv2d``): there the im2col gathers many taps of a few
        channels each, and the GEMM loses. Measured on Zen5, one thread, direct vs GEMM:
        C = 3 7x7 stride 2 (an RGB stem) 1.26x faster direct, C = 3 5x5 1.47x; but C = 3
        3x3 0.8x (0.6x at stride 2) and C = 8 7x7 stride 2 0.68x, which stay GEMMs.
    """

    def __init__(self, dtype: str = "bfloat16", gather_channels: int = 32, min_channels: int = 8):
        for name, value in (("gather_channels", gather_channels), ("min_channels", min_channels)):
            if value < 1:
                raise ValueError(f"tvmamp.Conv2dToGemm: {name}={value} is not a positive int")
        self.dtype = dtype
        self.gather_channels = gather_channels
        self.min_channels = min_channels

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        """Rewrite the conv2d calls of every Relax function of ``mod``."""
        rewriter = _Rewriter(mod, self.dtype, self.gather_channels, self.min_channels)
        for gvar, func in mod.functions_items():
            if isinstance(func, relax.Function):
                rewriter.builder_.update_func(gvar, rewriter.visit_expr(func))
        return rewriter.builder_.get()


def _rewritable(call: relax.Call, dtype: str, min_channels: int) -> bool:
    """Return whether ``call`` is a conv2d this pass handles."""
    attrs = call.attrs
    layouts = (attrs.data_layout, attrs.kernel_layout, attrs.out_layout)
    if layouts != ("NCHW", "OIHW", "NCHW") or int(attrs.groups) != 1:
        return False
    data, weight = call.args
    dtypes = {str(data.ty.dtype), str(weight.ty.dtype)}
    shapes = (static_shape(data.ty), static_shape(weight.ty))
    if dtypes != {dtype} or None in shapes:
        return False
    _, c, kh, kw = shapes[1]
    return c >= min_channels or kh * kw <= 9


@relax.expr_functor.mutator
class _Rewriter(PyExprMutator):
    """Replaces convs by im2col + matmul and keeps their results (and what follows) as rows.

    ``self.rows`` maps an original dataflow variable to the :class:`Rows` that hold its value;
    the variable itself is not emitted unless a use needs it (:meth:`_nchw`).
    """

    def __init__(self, mod: tvm.IRModule, dtype: str, gather_channels: int, min_channels: int):
        super().__init__(mod)
        self.dtype = dtype
        self.gather_channels = gather_channels
        self.min_channels = min_channels
        self.rows: dict[relax.Var, Rows] = {}
        self.nchw: dict[relax.Var, relax.Var] = {}

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        """Bind a value that is (or becomes) rows without emitting its NCHW form."""
        var, value = binding.var, binding.value
        rows = self._as_rows(value)
        if rows is not None and isinstance(var, relax.DataflowVar):
            self.rows[var] = rows
            return
        if rows is not None:  # a dataflow output: its NCHW value, bound to the same variable
            rows.to_nchw(self.builder_, var)
            return
        if isinstance(value, relax.TupleGetItem) and value.index > 0:
            source = self.rows.get(value.tuple_value)
            if source is not None and source.extras:  # a batch-norm's moving mean or variance
                item = source.extras[value.index - 1]
                self.builder_.emit_normalized(relax.VarBinding(var, item))
                return
        super().visit_var_binding_(binding)

    def visit_dataflow_var_(self, var: relax.DataflowVar) -> relax.Expr:
        """A use outside the rows rewrite: the NCHW value, materialised once."""
        if var in self.rows:
            return self._nchw(var)
        return super().visit_dataflow_var_(var)

    def _as_rows(self, value: relax.Expr) -> Rows | None:
        """Return ``value`` computed on rows, or ``None`` when it is not rewritten."""
        if isinstance(value, relax.Call) and value.op == _CONV:
            rewritable = _rewritable(value, self.dtype, self.min_channels)
            return self._conv(value) if rewritable else None
        return rows_call(self.builder_, value, self.rows, self._visit_arg)

    def _visit_arg(self, arg: relax.Expr) -> relax.Expr:
        return self.visit_expr(arg)

    def _conv(self, call: relax.Call) -> Rows:
        data, weight = call.args
        g = Geometry.of(call.attrs, static_shape(data.ty), static_shape(weight.ty))
        bb = self.builder_
        rows = self._input_rows(data, g)
        fused = not g.pointwise and g.c % self.gather_channels == 0
        col = rows if fused else emit_im2col(bb, rows, g)  # pointwise: the rows are col
        f = static_shape(weight.ty)[0]
        hwio = relax.op.permute_dims(self.visit_expr(weight), (2, 3, 1, 0))
        w2 = bb.emit(relax.op.reshape(hwio, (g.kh * g.kw * g.c, f)))
        out_dtype = str(call.attrs.out_dtype) or self.dtype
        if fused:
            gemm = emit_conv_gemm(bb, rows, w2, g, out_dtype)
        else:
            gemm = bb.emit(relax.op.matmul(col, w2, out_dtype=out_dtype))
        return Rows(gemm, g.n, g.out_h, g.out_w, f)

    def _input_rows(self, data: relax.Expr, g: Geometry) -> relax.Expr:
        """``data`` as rows ``[n*H*W, C]``: as it is when tracked, else transposed once."""
        if isinstance(data, relax.DataflowVar) and data in self.rows:
            return self.rows[data].var
        nhwc = relax.op.permute_dims(self.visit_expr(data), (0, 2, 3, 1))
        return self.builder_.emit(relax.op.reshape(nhwc, (g.n * g.h * g.w, g.c)))

    def _nchw(self, var: relax.DataflowVar) -> relax.Var:
        if var not in self.nchw:
            self.nchw[var] = self.rows[var].to_nchw(self.builder_)
        return self.nchw[var]
