"""Ops rewritten on NHWC rows: elementwise ops, per-channel broadcasts, inference batch-norm,
channel reshapes and transposes (a channel shuffle), channel concatenation and pooling."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

import tvm
import tvm_ffi
from tvm import relax, te, tirx

from tvmamp.tensors import int_or_expr, shape_dims, static_shape_but_batch

from .conv2d_im2col import Geometry, divisor, emit_pool, reshape
from .grouped_conv_gemm import emit_channel_permute
from .symbolic_rows import whole_tiles

# Ops whose first argument is the only tensor and whose result has its shape.
UNARY_OPS = tuple(
    tvm.ir.Op.get(f"relax.{name}")
    for name in (
        "astype",
        "nn.relu",
        "nn.gelu",
        "nn.gelu_tanh",
        "nn.silu",
        "nn.leakyrelu",
        "sigmoid",
        "tanh",
        "clip",
        "erf",  # an exported GELU, x * (erf(x / sqrt(2)) + 1) / 2
        "exp",
        "log",
        "sqrt",
        "rsqrt",
        "abs",
        "negative",
        "square",
        "nn.softplus",
    )
)
# Broadcasting binary ops: rewritten when one side is rows and the other per-channel or rows.
BINARY_OPS = tuple(
    tvm.ir.Op.get(f"relax.{name}")
    for name in ("add", "subtract", "multiply", "divide", "maximum", "minimum")
)
_BATCH_NORM = tvm.ir.Op.get("relax.nn.batch_norm")
_RESHAPE = tvm.ir.Op.get("relax.reshape")
_PERMUTE = tvm.ir.Op.get("relax.permute_dims")
_CONCAT = tvm.ir.Op.get("relax.concat")
_MEAN = tvm.ir.Op.get("relax.mean")
_RESIZE = tvm.ir.Op.get("relax.image.resize2d")
_SLICE = tvm.ir.Op.get("relax.strided_slice")
_POOLS = {tvm.ir.Op.get("relax.nn.max_pool2d"): "max", tvm.ir.Op.get("relax.nn.avg_pool2d"): "avg"}


@dataclass(frozen=True)
class Rows:
    """An NCHW value ``[n, c, h, w]`` held as the rows ``var[n*h*w, ...]`` (NHWC, flattened).

    ``var`` is ``[n*h*w, c]``, or ``[n*h*w, *dims]`` whose channel dims flatten (row-major) to
    the ``c`` channels: a grouped conv's GEMM leaves ``[n*h*w, G, Fg]``. A value with several
    channel axes, ``[n, *chan, h, w]`` (a channel shuffle's reshape), has ``chan`` set and
    ``var`` is ``[n*h*w, *chan]``. ``extras`` holds the other fields of a batch-norm tuple
    (moving mean and variance), whose first field is the rows.

    A symbolic number of pixels (a model exported with a dynamic batch or image size) has its
    rows padded to whole ``tile`` rows (:attr:`rows`), so that a GEMM reads them in place; the
    padded rows hold copies of real ones, and only the first :attr:`pixels` are read back as
    NCHW.
    """

    var: relax.Expr
    n: int | tirx.PrimExpr
    h: int | tirx.PrimExpr
    w: int | tirx.PrimExpr
    c: int
    extras: tuple = ()
    chan: tuple = ()
    tile: int = 1

    @property
    def pixels(self) -> int | tirx.PrimExpr:
        """The number of pixels, ``n*h*w``."""
        return self.n * self.h * self.w

    @property
    def padded(self) -> bool:
        """Whether the number of pixels is symbolic, and :attr:`rows` padded to whole tiles."""
        return not isinstance(self.pixels, int)

    @property
    def rows(self) -> int | tirx.PrimExpr:
        """The number of rows of ``var``: :attr:`pixels`, padded to whole ``tile`` rows when
        it is symbolic."""
        return whole_tiles(self.pixels, self.tile) if self.padded else self.pixels

    def same_batch(self, dim: tirx.PrimExpr) -> bool:
        """Whether ``dim`` (a shape's leading dimension) is ``n``."""
        return same_dim(dim, self.n)

    def same_size(self, h, w) -> bool:
        """Whether ``(h, w)`` is the image size ``(self.h, self.w)``."""
        return same_dim(h, self.h) and same_dim(w, self.w)

    @property
    def channel_dims(self) -> tuple[int, ...]:
        """The dims of ``var`` after the first (``(c,)`` for plain rows)."""
        return tuple(int(d) for d in self.var.ty.shape.values[1:])

    def same_layout(self, other: Rows) -> bool:
        """Whether ``other`` holds a value of the same shape (and is not a tuple)."""
        mine = (self.c, self.chan, self.extras)
        if mine != (other.c, other.chan, ()) or not self.same_batch(other.n):
            return False
        return self.same_size(other.h, other.w)

    def with_var(self, var: relax.Expr, extras: tuple = ()) -> Rows:
        """The same shape held in ``var``."""
        return dataclasses.replace(self, var=var, extras=extras)

    def shaped(self, dims: tuple[int, ...]) -> relax.Expr:
        """``var`` as ``[rows, *dims]`` (a reshape, a view, unless it already is)."""
        if self.channel_dims == tuple(dims):
            return self.var
        return relax.op.reshape(self.var, (self.rows, *dims))

    def images(self, bb: relax.BlockBuilder) -> relax.Var:
        """The value as NHWC ``[n, h, w, *chan]``: a view of ``var``; for padded rows, a gather
        of the real rows (a strided slice would be fused into the kernel that computes the
        rows, whose window or GEMM schedule covers the padded rows)."""
        chan = self.chan or (self.c,)
        shape = (self.n, self.h, self.w, *chan)
        if not self.padded:
            return bb.emit(relax.op.reshape(self.var, shape))
        shaped = self.shaped(chan)
        source = shaped if shaped is self.var else bb.emit(shaped)

        def gather(x: te.Tensor) -> te.Tensor:
            def value(b, y, col, *channel):
                return x[((b * self.h + y) * self.w + col, *channel)]

            return te.compute(shape, value, name="images")

        return bb.emit(bb.call_te(gather, source, primfunc_name_hint="rows_images"))

    def flat(self, bb: relax.BlockBuilder) -> relax.Expr:
        """``var`` as ``[n*h*w, c]``, emitted once where a reshape is needed."""
        shaped = self.shaped((self.c,))
        return shaped if shaped is self.var else bb.emit(shaped)

    def to_nchw(self, bb: relax.BlockBuilder, var: relax.Var | None = None) -> relax.Var:
        """Emit the NCHW value (a tuple for a batch-norm result), bound to ``var`` if given."""
        chan = self.chan or (self.c,)
        value = relax.op.permute_dims(self.images(bb), (0, *range(3, 3 + len(chan)), 1, 2))
        if self.extras:
            value = relax.Tuple([bb.emit(value), *self.extras])
        if var is None:
            return bb.emit(value)
        bb.emit_normalized(relax.VarBinding(var, bb.normalize(value)))
        return var


def same_dim(a, b) -> bool:
    """Whether two dimensions (ints, IntImms or PrimExprs) are the same."""
    a, b = int_or_expr(a), int_or_expr(b)
    if isinstance(a, int) or isinstance(b, int):
        return a == b if isinstance(a, int) and isinstance(b, int) else False
    return bool(tvm_ffi.structural_equal(a, b))


def rows_call(
    bb: relax.BlockBuilder, value: relax.Expr, rows: dict, visit: Callable
) -> Rows | None:
    """Emit ``value`` on rows when its tensor input is rows; return ``None`` when it is not.

    Parameters
    ----------
    bb : relax.BlockBuilder
        Where the rewritten bindings go.
    value : relax.Expr
        The original bound value.
    rows : dict
        Original dataflow variable -> :class:`Rows`.
    visit : callable
        Maps an original argument that is not rows to its rewritten expression.
    """
    held = lambda e: rows.get(e) if isinstance(e, relax.DataflowVar) else None  # noqa: E731
    if isinstance(value, relax.TupleGetItem):
        source = held(value.tuple_value)
        if source is not None and source.extras and value.index == 0:
            return source.with_var(source.var)
        return None
    if not isinstance(value, relax.Call):
        return None
    if value.op in BINARY_OPS and len(value.args) == 2:
        return _binary(bb, value, held, visit)
    if value.op == _CONCAT:
        return _concat(bb, value, held)
    first = held(value.args[0]) if value.args else None
    if first is None or first.extras:
        return None
    if value.op in UNARY_OPS:
        rest = [visit(arg) for arg in value.args[1:]]
        return first.with_var(bb.emit(relax.Call(value.op, [first.var, *rest], value.attrs)))
    if value.op == _RESHAPE:
        return _reshape(bb, value, first)
    if value.op == _PERMUTE:
        return _permute(bb, value, first)
    if first.chan:
        return None
    if value.op == _BATCH_NORM:
        return _batch_norm(bb, value, first, visit)
    if value.op in _POOLS:
        return _pool(bb, value, first)
    if value.op == _RESIZE:
        return _resize(bb, value, first)
    if value.op == _SLICE:
        return _channel_slice(bb, value, first)
    return None


def rows_reduction(bb: relax.BlockBuilder, value: relax.Expr, rows: dict) -> relax.Expr | None:
    """``value`` computed from rows when it is a mean over the pixels of rows (a global
    average pool), as ``[n, c]`` (keepdims: ``[n, c, 1, 1]``); else ``None``."""
    if not isinstance(value, relax.Call) or value.op != _MEAN:
        return None
    data = value.args[0]
    source = rows.get(data) if isinstance(data, relax.DataflowVar) else None
    axes = [int(a) % 4 for a in value.attrs.axis] if value.attrs.axis is not None else None
    if source is None or source.extras or source.chan or sorted(axes or []) != [2, 3]:
        return None
    images = source.images(bb) if source.padded else source.var
    pixels = bb.emit(relax.op.reshape(images, (source.n, source.h * source.w, source.c)))
    mean = relax.op.mean(pixels, axis=[1])
    if bool(value.attrs.keepdims):
        return relax.op.reshape(bb.emit(mean), (source.n, source.c, 1, 1))
    return mean


def _binary(bb, call: relax.Call, held: Callable, visit: Callable) -> Rows | None:
    """``a op b`` with one side rows and the other rows of the same shape or per-channel."""
    lhs, rhs = (held(arg) for arg in call.args)
    if lhs is not None and rhs is not None and lhs.padded and not lhs.same_layout(rhs):
        return _image_binary(bb, call, lhs, rhs)
    if lhs is not None and rhs is not None:
        if lhs.extras or not lhs.same_layout(rhs):
            return None
        # The result takes the shape with more channel dims (a GEMM's [P, G, Fg]), so that the
        # op stays in that GEMM's epilogue and the other side is reshaped (a view).
        model = max(lhs, rhs, key=lambda r: len(r.channel_dims))
        args = [side.shaped(model.channel_dims) for side in (lhs, rhs)]
        return model.with_var(bb.emit(relax.Call(call.op, args, call.attrs)))
    side, other = (lhs, call.args[1]) if lhs is not None else (rhs, call.args[0])
    if side is None or side.extras or side.chan:
        return None
    vector = per_channel(visit(other), side.c, side.channel_dims)
    if vector is None and side.padded:
        vector = _per_image(bb, _image_table(bb, visit(other), side), side)
    if vector is None:
        return None
    args = [side.var, vector] if lhs is not None else [vector, side.var]
    return side.with_var(bb.emit(relax.Call(call.op, args, call.attrs)))


def per_channel(
    expr: relax.Expr, channels: int, dims: tuple[int, ...] | None = None
) -> relax.Expr | None:
    """``expr`` reshaped to broadcast over rows ``[*, *dims]``, if it broadcasts per channel.

    Shapes that right-align with ``[n, c, h, w]`` as ``[1, c or 1, 1, 1]`` qualify; the result
    has shape ``dims`` (``(channels,)`` by default) or ``[1]`` (a scalar stays a scalar).
    Anything else returns ``None``.
    """
    shape = expr.ty.shape if isinstance(expr.ty, relax.TensorType) else None
    if shape is None or len(shape) > 4 or not all(isinstance(s, tirx.IntImm) for s in shape):
        return None
    dims_in = [1] * (4 - len(shape)) + [int(s) for s in shape]
    if dims_in[0] != 1 or dims_in[2:] != [1, 1] or dims_in[1] not in (1, channels):
        return None
    if not shape:
        return expr
    target = tuple(dims) if dims is not None and dims_in[1] == channels else (dims_in[1],)
    return reshape(expr, target)


def _image_binary(bb, call: relax.Call, lhs: Rows, rhs: Rows) -> Rows | None:
    """``a op b`` on rows over a symbolic batch where one side has one pixel an image
    (``[n, c, 1, 1]``: a squeeze-and-excitation scale after its 1x1 convs) and the other
    side ``c`` channels of the same batch."""
    small, large = (lhs, rhs) if lhs.same_size(1, 1) else (rhs, lhs)
    if not small.same_size(1, 1) or small.extras or small.chan or large.extras or large.chan:
        return None
    if small.c != large.c or not large.same_batch(small.n):
        return None
    vector = _per_image(bb, small.flat(bb), large)
    args = [large.var, vector] if large is lhs else [vector, large.var]
    return large.with_var(bb.emit(relax.Call(call.op, args, call.attrs)))


def _image_table(bb: relax.BlockBuilder, expr: relax.Expr, rows: Rows) -> relax.Expr | None:
    """``expr`` of shape ``[n, c, 1, 1]`` (one value per image and channel of ``rows``) as the
    matrix ``[n, c]``; else ``None``."""
    shape = expr.ty.shape.values if isinstance(expr.ty, relax.TensorType) else None
    if shape is None or len(shape) != 4 or not rows.same_batch(shape[0]):
        return None
    if not all(isinstance(d, tirx.IntImm) for d in shape[1:]) or rows.channel_dims != (rows.c,):
        return None
    if [int(d) for d in shape[1:]] != [rows.c, 1, 1]:
        return None
    return bb.emit(relax.op.reshape(expr, (rows.n, rows.c)))


def _per_image(bb: relax.BlockBuilder, table: relax.Expr | None, rows: Rows) -> relax.Expr:
    """``[rows, c]``: row ``b`` of ``table`` (``[n, c]`` or more rows) for each pixel of
    image ``b`` of ``rows`` (its padded rows read the last image), a take that FuseOps fuses
    into the elementwise op that reads it. ``None`` for a ``None`` table."""
    if table is None:
        return None
    per_image = rows.h * rows.w
    if isinstance(per_image, int):
        pixel = bb.emit(relax.op.arange(tirx.IntImm("int64", 0), rows.rows, dtype="int64"))
        image = bb.emit(relax.op.floor_divide(pixel, relax.const(per_image, "int64")))
        zero, last = (relax.prim_value(tirx.IntImm("int64", 0)), relax.prim_value(rows.n - 1))
        image = bb.emit(relax.op.clip(image, zero, last))
    else:  # a symbolic image size: the indices computed by a kernel of their own

        def images() -> te.Tensor:
            last = rows.n - 1
            per = divisor(per_image)
            return te.compute((rows.rows,), lambda r: tirx.min(r // per, last), name="image")

        image = bb.emit(bb.call_te(images, primfunc_name_hint="row_images"))
    return bb.emit(relax.op.take(table, image, axis=0, mode="clip"))


def _batch_norm(bb, call: relax.Call, data: Rows, visit: Callable) -> Rows | None:
    """fp32 inference batch-norm as ``x * scale + shift`` with per-channel ``scale``/``shift``.

    ``scale = gamma / sqrt(var + eps)`` and ``shift = beta - mean * scale`` are computed from the
    parameters (folded at compile time when they are constants), so the epilogue is two ops.
    """
    attrs = call.attrs
    axis = int(attrs.axis)
    if bool(attrs.training) or axis not in (1, -3):
        return None
    if str(call.args[0].ty.dtype) != "float32":
        return None
    gamma, beta, mean, var = (visit(arg) for arg in call.args[1:])
    eps = relax.const(float(attrs.epsilon), "float32")
    scale = relax.op.divide(relax.const(1.0, "float32"), relax.op.sqrt(relax.op.add(var, eps)))
    scale = bb.emit(relax.op.multiply(scale, gamma) if bool(attrs.scale) else scale)
    shift = relax.op.negative(relax.op.multiply(mean, scale))
    shift = bb.emit(relax.op.add(shift, beta) if bool(attrs.center) else shift)
    dims = data.channel_dims
    if dims != (data.c,):  # the per-channel vectors as the rows' channel dims
        scale, shift = (bb.emit(relax.op.reshape(v, dims)) for v in (scale, shift))
    out = bb.emit(relax.op.add(bb.emit(relax.op.multiply(data.var, scale)), shift))
    return data.with_var(out, extras=(mean, var))


def _reshape(bb, call: relax.Call, data: Rows) -> Rows | None:
    """A reshape of the channel axes only: ``[n, *chan, h, w]`` to ``[n, *chan2, h, w]``."""
    shape = call.ty.shape.values if isinstance(call.ty, relax.TensorType) else None
    if shape is None or len(shape) < 4 or not all(isinstance(d, tirx.IntImm) for d in shape[1:-2]):
        return None
    if not data.same_batch(shape[0]) or not data.same_size(*shape[-2:]):
        return None
    chan = tuple(int(d) for d in shape[1:-2])
    if math.prod(chan) != data.c:
        return None
    if len(chan) == 1:
        return dataclasses.replace(data, chan=())
    shaped = data.shaped(chan)
    var = shaped if shaped is data.var else bb.emit(shaped)
    return dataclasses.replace(data, var=var, chan=chan)


def _permute(bb, call: relax.Call, data: Rows) -> Rows | None:
    """A transpose of the channel axes (``n`` first and ``h, w`` last stay where they are)."""
    if not data.chan or call.attrs.axes is None:
        return None
    axes = [int(a) for a in call.attrs.axes]
    inner = axes[1:-2]
    if (
        axes[0] != 0
        or axes[-2:] != [len(axes) - 2, len(axes) - 1]
        or sorted(inner) != list(range(1, len(axes) - 2))
    ):
        return None
    perm = [a - 1 for a in inner]
    moved = emit_channel_permute(bb, data.var, perm)
    chan = tuple(data.chan[a] for a in perm)
    return dataclasses.replace(data, var=moved, chan=chan)


def _concat(bb, call: relax.Call, held: Callable) -> Rows | None:
    """A concatenation of rows along the channel axis, as a concatenation of their columns."""
    fields = call.args[0].fields if isinstance(call.args[0], relax.Tuple) else None
    if fields is None or call.attrs.axis is None or int(call.attrs.axis) % 4 != 1:
        return None
    parts = [held(f) for f in fields]
    if any(r is None or r.extras or r.chan for r in parts):
        return None
    first = parts[0]
    if not all(r.same_batch(first.n) and r.same_size(first.h, first.w) for r in parts):
        return None
    columns = bb.emit(relax.op.concat([r.flat(bb) for r in parts], axis=1))
    return dataclasses.replace(first, var=columns, c=sum(r.c for r in parts))


def _ceil_padding(data: Rows, attrs, padding: list[int], out_hw) -> list[int]:
    """``padding`` (top, left, bottom, right) with the bottom and right grown so that floor
    mode gives ``out_hw``, the ceil-mode output size."""
    grown = list(padding)
    for axis, (size, out) in enumerate(zip((data.h, data.w), out_hw)):
        span = (int(attrs.pool_size[axis]) - 1) * int(attrs.dilation[axis]) + 1
        needed = (int(out) - 1) * int(attrs.strides[axis]) + span - size - padding[axis]
        grown[axis + 2] = max(padding[axis + 2], needed)
    return grown


def _pool(bb, call: relax.Call, data: Rows) -> Rows | None:
    """Max or average pooling of NCHW rows, as a window kernel on the rows.

    ``ceil_mode`` max pooling (SqueezeNet's) is floor-mode pooling with the bottom and right
    padding grown to cover the last windows: their taps outside the input read the max's
    identity, as ``ceil_mode`` does. An average with ``ceil_mode`` stays NCHW (its divisor
    does not count those taps).
    """
    attrs = call.attrs
    if (attrs.layout, attrs.out_layout) != ("NCHW", "NCHW"):
        return None
    padding = [int(p) for p in attrs.padding]
    if not isinstance(call.ty, relax.TensorType) or not isinstance(call.ty.shape, relax.ShapeExpr):
        return None
    if bool(attrs.ceil_mode):
        out = static_shape_but_batch(call.ty)
        static = isinstance(data.h, int) and isinstance(data.w, int)
        if _POOLS[call.op] != "max" or out is None or not static:
            return None
        padding = _ceil_padding(data, attrs, padding, out[2:])
    out = call.ty.shape.values
    g = Geometry.make(
        (data.n, data.c, data.h, data.w),
        attrs.pool_size,
        attrs.strides,
        attrs.dilation,
        padding,
        out_hw=() if bool(attrs.ceil_mode) else out[2:],
    )
    g = dataclasses.replace(g, row_tile=data.tile)
    if bool(attrs.ceil_mode) and (g.out_h, g.out_w) != tuple(int(d) for d in out[2:]):
        return None
    include_pad = bool(getattr(attrs, "count_include_pad", True))
    pooled = emit_pool(bb, data.flat(bb), g, _POOLS[call.op], include_pad)
    return Rows(pooled, g.n, g.out_h, g.out_w, g.c, tile=g.row_tile)


def _resize(bb, call: relax.Call, data: Rows) -> Rows | None:
    """An NCHW ``resize2d`` (a U-Net's or an FPN's upsampling) as a gather on the rows: each
    output pixel computed from its input pixels by TOPI's own NHWC resize, vectorised over the
    channels. Its result stays rows, so that the decoder's concat and convs read them without
    a transpose back to NCHW and rows again (a U-Net under dynamic image sizes: 3.3 of 14 ms)."""
    from tvm.topi.image.resize import _resize_2d

    attrs = call.attrs
    out = shape_dims(call.ty)
    if attrs.layout != "NCHW" or out is None or len(out) != 4 or out[1] != data.c:
        return None
    if not data.same_batch(out[0]) or str(attrs.method) not in ("nearest_neighbor", "linear"):
        return None
    roi = [float(v) for v in attrs.roi]
    out_h, out_w = out[2:]
    image = Geometry.make((data.n, data.c, out_h, out_w), (1, 1), (1, 1), (1, 1), (0,) * 4)
    image = dataclasses.replace(image, row_tile=data.tile)
    dtype = str(call.ty.dtype)

    def resize(x: te.Tensor) -> te.Tensor:
        source = _Image(x, data.h, data.w)

        def value(r, c):
            b, pix = image.image_pixel(r)
            y, col = image.out_yx(pix)
            return _resize_2d(
                (b, y, col, c),
                source,
                roi,
                *(_expr(d) for d in (data.h, data.w, out_h, out_w)),
                method=str(attrs.method),
                layout="NHWC",
                coordinate_transformation_mode=str(attrs.coordinate_transformation_mode),
                rounding_method=str(attrs.rounding_method),
                alpha=float(attrs.cubic_alpha),
                exclude_outside=int(attrs.cubic_exclude),
                extrapolation_value=float(attrs.extrapolation_value),
                out_dtype=dtype,
            )

        return te.compute((image.out_rows, data.c), value, name="resize")

    rows = bb.emit(bb.call_te(resize, data.flat(bb), primfunc_name_hint="resize_rows"))
    return Rows(rows, data.n, out_h, out_w, data.c, tile=data.tile)


class _Image:
    """Rows ``[n*h*w, c]`` read as an NHWC image ``(b, y, x, c)``, as TOPI's resize reads its
    input."""

    def __init__(self, rows: te.Tensor, h, w):
        self.rows, self.h, self.w, self.dtype = rows, h, w, rows.dtype

    def __call__(self, b, y, x, c):
        return self.rows[(b * self.h + y) * self.w + x, c]


def _expr(size) -> tirx.PrimExpr:
    """A size as a PrimExpr (TOPI's resize calls ``.astype`` on them)."""
    return tirx.IntImm("int64", size) if isinstance(size, int) else size


def _channel_slice(bb, call: relax.Call, data: Rows) -> Rows | None:
    """A slice of the channels (unit stride), as a slice of the rows' columns: GhostNet's
    ``cat([x1, x2], 1)[:, :out]`` sent its rows back to NCHW and to rows again at each ghost
    module (1.6x onnxruntime's time under dynamic image sizes)."""
    ints = []
    for field in call.args[1:]:
        values = [v if isinstance(v, tirx.IntImm) else getattr(v, "value", None) for v in field]
        if not all(isinstance(v, tirx.IntImm) for v in values):
            return None
        ints.append([int(v) for v in values])
    axes, begins, ends = ints[:3]
    strides = ints[3] if len(ints) > 3 else [1] * len(axes)
    if [a % 4 for a in axes] != [1] or strides != [1]:
        return None
    begin, end = (max(0, min(v + data.c if v < 0 else v, data.c)) for v in (begins[0], ends[0]))
    if end <= begin:
        return None
    out = bb.emit(relax.op.strided_slice(data.flat(bb), [1], [begin], [end]))
    return Rows(out, data.n, data.h, data.w, end - begin, tile=data.tile)
