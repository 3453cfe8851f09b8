"""Rewrite bf16 NCHW conv2d onto NHWC rows, so that GEMM and window kernels run convs.

The CPU bf16 kernels (``vdpbf16ps`` and AMX, :mod:`tvmamp.schedules.cpu.bf16_matmul`) are GEMM
kernels. A convolution ``O[n, f, y, x] = sum W[f, c, ky, kx] * D[n, c, y*s + ky*d, x*s + kx*d]``
becomes ``col[n*OH*OW, (ky*KW + kx)*C + c] @ W2[(ky*KW + kx)*C + c, f]``: ``W2`` is the weight
transposed to ``[ky, kx, c, f]`` and flattened (``FoldConstant`` evaluates it at compile time,
and the GEMM rule then packs it), and ``col`` is gathered from the input in *NHWC rows*
``[n*H*W, C]`` (:mod:`.conv2d_im2col`), one contiguous channel vector per pixel and tap. The
gather and the GEMM are one kernel: the GEMM rule inlines the gather into its packing of ``col``,
so the im2col matrix is written once, in the layout the GEMM kernel reads (convs with few
channels keep a gather kernel of their own, see ``gather_channels``).

Grouped convs with wide groups are one batched GEMM over the groups
(:mod:`.grouped_conv_gemm`), whose ``[n*OH*OW, G, Fg]`` result is rows too; depthwise convs on
rows are window kernels that reduce each pixel's taps vectorised over the channels
(:func:`.conv2d_im2col.emit_depthwise`).

The GEMM result ``[n*OH*OW, F]`` is those rows for the next layer, so it stays in that layout:
the elementwise ops that follow (casts, per-channel bias, inference batch-norm, activations,
residual adds of two such values), pooling, channel concatenation and the channel shuffle's
reshape and transpose are rewritten on the rows (:mod:`.conv2d_rows`), where ``FuseOps`` fuses
the elementwise ones into the GEMM's epilogue, and a following conv gathers straight from them.
A global average pool reads the rows as they are. A value goes back to NCHW (reshape +
transpose) only where something else uses it, so the program's NCHW semantics are unchanged.
Inputs are transposed to rows once, before their first conv.
"""

from __future__ import annotations

import dataclasses

import tvm
from tvm import relax, te, tirx
from tvm.ir.expr import Constant
from tvm.relax import PyExprMutator

from tvmamp.tensors import out_dtype as conv_out_dtype
from tvmamp.tensors import shape_dims, static_shape, static_shape_but_batch

from .conv2d_im2col import (
    Geometry,
    astype,
    divisor,
    emit_conv_gemm,
    emit_depthwise,
    emit_im2col,
    emit_run_im2col,
    permute_dims,
    reshape,
    run_weight,
)
from .conv2d_rows import Rows, rows_call, rows_reduction
from .conv_transpose_gemm import TransposeGeometry, emit_col2im, transpose_weight
from .grouped_conv_gemm import emit_grouped_gemm, grouped_weight
from .symbolic_rows import is_whole, whole_tiles

_CONV = tvm.ir.Op.get("relax.nn.conv2d")
_CONV_T = tvm.ir.Op.get("relax.nn.conv2d_transpose")


@tvm.transform.module_pass(opt_level=0, name="tvmamp.Conv2dToGemm")
class Conv2dToGemm:
    """Rewrite every NCHW/OIHW conv2d whose inputs are ``dtype`` onto NHWC rows: those of
    static shapes, and with ``row_tile`` those over a symbolic batch.

    Dense convs become im2col + GEMM; grouped convs whose groups have at least
    ``min_group_channels`` input and output channels become one batched GEMM over the groups
    (:func:`.grouped_conv_gemm.emit_grouped_gemm`).

    Parameters
    ----------
    dtype : str
        The input dtype of the convolutions to rewrite ("bfloat16" by default); others, and
        the ops around them, are left alone.
    gather_channels : int
        The im2col gather is fused into the GEMM (:func:`.conv2d_im2col.emit_conv_gemm`) when
        the input channels are a multiple of this (32: one 64-byte bf16 vector per tap, so the
        GEMM's packing copies whole vectors). Other convs gather with a kernel of their own:
        with fewer channels than this (an RGB stem, C = 3), where a tap is less than a vector,
        it copies each kernel row's ``KW*C`` contiguous values at once
        (:func:`.conv2d_im2col.emit_run_im2col`; dilation 1), else one tap at a time.
    min_channels : int
        Convs with more than 3x3 taps and fewer input channels than this are left alone, to
        the direct conv (``CPUConv2d``). 1 (the default) leaves none: with whole kernel rows
        gathered at once, the GEMM beats the direct bf16 conv on every few-channel shape
        measured on Zen5 (one thread): C = 3 7x7 stride 2 (an RGB stem) 1.76x, C = 3 5x5
        1.25-1.47x, C = 1 5x5 1.68x, C = 4 7x7 stride 2 2.03x, C = 6 11x11 stride 4 1.96x.
    min_group_channels : int
        Grouped convs whose groups have fewer input or output channels than this (16) are
        left to the direct conv: a group's GEMM pads its output channels to whole 16-lane
        vectors and its reduction to pairs, so narrow groups waste most of each vector.
    max_transpose_taps : int
        Dense NCHW/IOHW transposed convs (dilation 1) on which at most this many kernel taps
        land per output pixel (4: ``ceil(KH/s_h) * ceil(KW/s_w)``, any kernel up to twice the
        stride) become one GEMM over the input rows and a col2im gather
        (:mod:`.conv_transpose_gemm`). The GEMM's result is that many times the output, so
        transposed convs whose taps overlap more are left to the sub-pixel rewrite
        (:mod:`.conv_transpose`).
    row_tile : int or None
        Convs over a symbolic batch or image size (a model exported with a dynamic batch,
        height or width) are rewritten too when this is set, all but transposed ones (and a
        depthwise one over symbolic image sizes even where its input is not rows yet): their
        rows are padded to whole tiles of
        ``row_tile`` rows (the bf16 GEMM's row tile), and each GEMM reads its columns from an
        im2col (or grouping) kernel of its own (a GEMM kernel cannot copy a symbolic number of
        bf16 rows, docs/CPU_BF16.md). ``None`` (the default) leaves them to the direct conv.
    """

    def __init__(
        self,
        dtype: str = "bfloat16",
        gather_channels: int = 32,
        min_channels: int = 1,
        min_group_channels: int = 16,
        max_transpose_taps: int = 4,
        row_tile: int | None = None,
    ):
        options = {
            "gather_channels": gather_channels,
            "min_channels": min_channels,
            "min_group_channels": min_group_channels,
            "max_transpose_taps": max_transpose_taps,
            "row_tile": 1 if row_tile is None else row_tile,
        }
        for name, value in options.items():
            if value < 1:
                raise ValueError(f"tvmamp.Conv2dToGemm: {name}={value} is not a positive int")
        self.dtype = dtype
        self.gather_channels = gather_channels
        self.min_channels = min_channels
        self.min_group_channels = min_group_channels
        self.max_transpose_taps = max_transpose_taps
        self.row_tile = row_tile

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        """Rewrite the conv2d calls of every Relax function of ``mod``."""
        mod = relax.transform.CanonicalizeBindings()(mod)  # e.g. ``(a, b)[0]`` -> ``a``
        rewriter = _Rewriter(mod, self)
        for gvar, func in mod.functions_items():
            if isinstance(func, relax.Function):
                func = relax.analysis.remove_all_unused(func)
                rewriter.builder_.update_func(gvar, rewriter.visit_expr(func))
        return rewriter.builder_.get()

    def rewrites(self, call: relax.Call, on_rows: bool = False) -> bool:
        """Return whether ``call`` (a conv2d or conv2d_transpose) is one this pass rewrites;
        ``on_rows``: whether its input is already rows (depthwise convs are rewritten only
        then: on NCHW input the direct conv, vectorised over columns, beats transposing to rows
        and back)."""
        attrs = call.attrs
        layouts = (attrs.data_layout, attrs.kernel_layout, attrs.out_layout)
        kernel_layout = "IOHW" if call.op == _CONV_T else "OIHW"
        if layouts != ("NCHW", kernel_layout, "NCHW"):
            return False
        data, weight = call.args
        dtypes = {str(data.ty.dtype), str(weight.ty.dtype)}
        shapes = (static_shape(data.ty), static_shape(weight.ty), static_shape(call.ty))
        if dtypes != {self.dtype} or shapes[1] is None:
            return False
        symbolic = None in shapes
        if symbolic and (self.row_tile is None or call.op == _CONV_T):
            return False
        sizes = [shape_dims(data.ty), shape_dims(call.ty)]
        if symbolic and any(s is None or not isinstance(s[1], int) for s in sizes):
            return False  # unknown shapes or channels
        if call.op == _CONV_T:
            dense = int(attrs.groups) == 1 and all(int(d) == 1 for d in attrs.dilation)
            return dense and TransposeGeometry.of(call).taps <= self.max_transpose_taps
        f, c, kh, kw = shapes[1]
        groups = int(attrs.groups)
        if groups > 1 and c == 1 and f == groups:  # depthwise, one output channel per group
            # on symbolic image sizes always: the alternative is ConvAsGemm's GEMMs of one
            # column, and back to NCHW around them
            return on_rows or (symbolic and static_shape_but_batch(data.ty) is None)
        if groups > 1:
            return min(c, f // groups) >= self.min_group_channels
        return c >= self.min_channels or kh * kw <= 9


@relax.expr_functor.mutator
class _Rewriter(PyExprMutator):
    """Replaces convs by im2col + matmul and keeps their results (and what follows) as rows.

    ``self.rows`` maps an original dataflow variable to the :class:`Rows` that hold its value;
    the variable itself is not emitted unless a use needs it (:meth:`_nchw`).
    """

    def __init__(self, mod: tvm.IRModule, options: Conv2dToGemm):
        super().__init__(mod)
        self.options = options
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
        reduced = rows_reduction(self.builder_, value, self.rows)
        if reduced is not None:
            self.builder_.emit_normalized(relax.VarBinding(var, self.builder_.normalize(reduced)))
            return
        if isinstance(value, relax.TupleGetItem) and value.index > 0:
            source = self.rows.get(value.tuple_value)
            if source is not None and source.extras:  # a batch-norm's moving mean or variance
                item = source.extras[value.index - 1]
                self.builder_.emit_normalized(relax.VarBinding(var, item))
                return
        super().visit_var_binding_(binding)

    def visit_match_cast_(self, binding: relax.MatchCast) -> None:
        """A ``match_cast`` of rows to an NCHW shape (the importer's unification of a concat's
        sizes, ``h // 4 * 2`` to ``h // 2``): the check is made on the shape alone and on the
        rows' padded count, and the rows stay rows with the cast's sizes."""
        source = binding.value
        rows = self.rows.get(source) if isinstance(source, relax.DataflowVar) else None
        shape = shape_dims(binding.var.ty)
        if (
            rows is None
            or rows.extras
            or rows.chan
            or not isinstance(binding.var, relax.DataflowVar)
            or shape is None
            or len(shape) != 4
            or shape[1] != rows.c
        ):
            super().visit_match_cast_(binding)
            return
        bb = self.builder_
        n, _, h, w = shape
        # the sizes bound first: TVM's VMShapeLower computes no size that appears in a
        # match_cast's value alone (``h // 4`` of ``shape([b, h // 4, w // 4])``) and failed
        # the build with "Check failed: (it != slot_map_.end())"; a binding's type has its slot
        sizes = bb.emit(relax.ShapeExpr([rows.n, rows.h, rows.w]), name_hint="sizes")
        bb.match_cast(sizes, relax.ShapeType([n, h, w]))
        cast = dataclasses.replace(rows, n=n, h=h, w=w)
        ty = relax.TensorType([cast.rows, *rows.var.ty.shape.values[1:]], rows.var.ty.dtype)
        self.rows[binding.var] = cast.with_var(bb.match_cast(rows.var, ty))

    def visit_dataflow_var_(self, var: relax.DataflowVar) -> relax.Expr:
        """A use outside the rows rewrite: the NCHW value, materialised once."""
        if var in self.rows:
            return self._nchw(var)
        return super().visit_dataflow_var_(var)

    def _as_rows(self, value: relax.Expr) -> Rows | None:
        """Return ``value`` computed on rows, or ``None`` when it is not rewritten."""
        if isinstance(value, relax.Call) and value.op in (_CONV, _CONV_T):
            data = value.args[0]
            on_rows = isinstance(data, relax.DataflowVar) and data in self.rows
            if not self.options.rewrites(value, on_rows):
                return None
            return self._transposed(value) if value.op == _CONV_T else self._conv(value)
        return rows_call(self.builder_, value, self.rows, self._visit_arg)

    def _visit_arg(self, arg: relax.Expr) -> relax.Expr:
        return self.visit_expr(arg)

    def _conv(self, call: relax.Call) -> Rows:
        data, weight = call.args
        g = Geometry.of(
            call.attrs, shape_dims(data.ty), static_shape(weight.ty), shape_dims(call.ty)
        )
        g = dataclasses.replace(g, row_tile=self.options.row_tile or 1)
        f = static_shape(weight.ty)[0]
        out_dtype = conv_out_dtype(call, self.options.dtype)
        weight = self.visit_expr(weight)
        if g.groups == g.c == f:
            out = self._depthwise(data, weight, g, out_dtype)
        elif g.groups > 1:
            out = self._grouped(data, weight, g, f, out_dtype)
        else:
            out = self._dense(data, weight, g, f, out_dtype)
        return Rows(out, g.n, g.out_h, g.out_w, f, tile=g.row_tile)

    def _transposed(self, call: relax.Call) -> Rows:
        """One GEMM over the input rows, then the col2im gather (:mod:`.conv_transpose_gemm`)."""
        data, weight = call.args
        g = TransposeGeometry.of(call)
        out_dtype = conv_out_dtype(call, self.options.dtype)
        rows = self._input_rows(data, g.input, (g.c,))
        w2 = self._leaf(transpose_weight(self.visit_expr(weight), g))
        products = self.builder_.emit(relax.op.matmul(rows, w2, out_dtype=out_dtype))
        return Rows(emit_col2im(self.builder_, products, g), g.n, g.out_h, g.out_w, g.f)

    def _depthwise(self, data, weight, g: Geometry, out_dtype: str) -> relax.Var:
        """A window kernel on the rows; the weight as ``[KH*KW, C]`` in ``out_dtype``."""
        taps = reshape(weight, (g.c, g.kh * g.kw))
        wide = astype(permute_dims(taps, (1, 0)), out_dtype)
        rows = self._input_rows(data, g, (g.c,))
        return emit_depthwise(self.builder_, rows, self._leaf(wide), g, out_dtype)

    def _grouped(self, data, weight, g: Geometry, f: int, out_dtype: str) -> relax.Var:
        """A batched GEMM over the groups; a pointwise one reads the rows as ``[P, G, Cg]``."""
        dims = (g.groups, g.group_channels) if g.pointwise else (g.c,)
        rows = self._input_rows(data, g, dims)
        matrices = self._leaf(grouped_weight(weight, g, f))
        return emit_grouped_gemm(self.builder_, rows, matrices, g, out_dtype)

    def _dense(self, data, weight, g: Geometry, f: int, out_dtype: str) -> relax.Var:
        """im2col + GEMM: the gather fused into the GEMM for wide inputs, whole kernel rows
        gathered at once for narrow ones (fewer than ``gather_channels``)."""
        bb = self.builder_
        if g.c < self.options.gather_channels and not g.pointwise and g.dilation == (1, 1):
            if g.symbolic and not (isinstance(data, relax.DataflowVar) and data in self.rows):
                # the gather pads NHWC: from the NCHW input through a transpose, not through
                # padded rows, whose padding it would slice off (an RGB stem under a dynamic
                # size: 0.24 -> 0.07 ms for 2 x 3 x 128 x 128)
                nhwc = bb.emit(relax.op.permute_dims(self.visit_expr(data), (0, 2, 3, 1)))
                col = emit_run_im2col(bb, None, g, nhwc)
            else:
                col = emit_run_im2col(bb, self._input_rows(data, g, (g.c,)), g)
            w2 = self._leaf(run_weight(weight, g, f))
            return bb.emit(relax.op.matmul(col, w2, out_dtype=out_dtype))
        rows = self._input_rows(data, g, (g.c,))
        fused = not g.pointwise and g.c % self.options.gather_channels == 0 and not g.symbolic
        col = rows if fused else emit_im2col(bb, rows, g)  # pointwise: the rows are col
        hwio = permute_dims(weight, (2, 3, 1, 0))
        w2 = self._leaf(reshape(hwio, (g.kh * g.kw * g.c, f)))
        if fused:
            return emit_conv_gemm(bb, rows, w2, g, out_dtype)
        return bb.emit(relax.op.matmul(col, w2, out_dtype=out_dtype))

    def _leaf(self, expr: relax.Expr) -> relax.Expr:
        """``expr`` as an argument: a constant as it is, anything else bound to a variable."""
        return expr if isinstance(expr, Constant) else self.builder_.emit(expr)

    def _input_rows(self, data: relax.Expr, g: Geometry, dims: tuple[int, ...]) -> relax.Expr:
        """``data`` as rows ``[n*H*W, *dims]``: as it is when tracked, else transposed once."""
        if isinstance(data, relax.DataflowVar) and data in self.rows:
            shaped = self.rows[data].shaped(dims)
            return shaped if isinstance(shaped, relax.Var) else self.builder_.emit(shaped)
        source = self.visit_expr(data)
        bb = self.builder_
        pixels = g.h * g.w
        tiled = isinstance(pixels, int) and g.c % 16 == 0 and pixels % 16 == 0
        if g.symbolic and tiled and is_whole(g.n * pixels, g.row_tile):
            # no padded rows: each image's [C, H*W] view transposed, a 2-D copy in register
            # tiles (the TE copy below gathers: 19.3 ms at 5.5 % of the copy peak for a
            # (2+1)D block's 432 x 32 x 32 frames under a dynamic batch). A static batch keeps
            # the 4-D transpose, which fuses with its producer: this copy of its own took
            # 1.05-1.17x the time of MobileNetV3, EfficientNet and R(2+1)D static builds
            planes = bb.emit(relax.op.memory.view(source, (g.n, g.c, pixels)))
            transposed = bb.emit(relax.op.permute_dims(planes, (0, 2, 1)))
            return bb.emit(relax.op.reshape(transposed, (g.n * pixels, *dims)))
        if g.symbolic:
            rows = self.builder_.emit(_padded_rows(self.builder_, source, g))
            if tuple(dims) == (g.c,):
                return rows
            return self.builder_.emit(relax.op.reshape(rows, (rows.ty.shape[0], *dims)))
        if g.n == 1 and tuple(dims) == (g.c,) and tiled:
            # [C, H*W] is a free view of one NCHW image, and its transpose is the rows: a plain
            # 2-D copy in 16 x 16 register tiles. Transposing the 4-D tensor reads
            # x[c, r // W, r % W], whose tiles cross image rows and fall back to gathers
            # (a 256-channel 56 x 56 input: 0.45 -> 0.08 ms with its cast).
            flat = self.builder_.emit(relax.op.memory.view(source, (g.c, pixels)))
            return self.builder_.emit(relax.op.permute_dims(flat, (1, 0)))
        nhwc = relax.op.permute_dims(source, (0, 2, 3, 1))
        return self.builder_.emit(relax.op.reshape(nhwc, (g.n * g.h * g.w, *dims)))

    def _nchw(self, var: relax.DataflowVar) -> relax.Var:
        if var not in self.nchw:
            self.nchw[var] = self.rows[var].to_nchw(self.builder_)
        return self.nchw[var]


def _padded_rows(bb: relax.BlockBuilder, data: relax.Expr, g: Geometry) -> relax.Expr:
    """NCHW ``data`` over a symbolic batch as rows ``[whole_tiles(n*H*W), C]``, the padded
    rows copies of the last real one: one copy kernel that transposes and pads."""
    pixels = g.n * g.h * g.w
    whole = is_whole(pixels, g.row_tile)

    def rows(x: te.Tensor) -> te.Tensor:
        def value(r, c):
            real = r if whole else tirx.min(r, pixels - 1)
            plane, width = divisor(g.h * g.w), divisor(g.w)
            b, pix = real // plane, real % plane
            return x[b, c, pix // width, pix % width]

        return te.compute((whole_tiles(pixels, g.row_tile), g.c), value, name="rows")

    return bb.call_te(rows, data, primfunc_name_hint="nchw_rows")
