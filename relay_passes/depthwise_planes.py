"""DepthwisePlanes: NCHW depthwise conv2d as one kernel that reads its input as it is.

At O2 a depthwise conv whose input comes from an fp32 value (a model input, an fp32 op) is
``conv2d(astype(x, low), w)``: a cast kernel writes the low copy, and the direct conv, which
accumulates in fp32, widens it again in its padding copy. This pass emits the conv as a kernel
that reads ``x`` itself (the cast absorbed into its padding copy, where TVM folds the
``f32 -> low -> f32`` round trip, so the input keeps its fp32 value) and picks one of two
NCHW kernels by a cost estimate (:func:`plane_cycles`, :func:`groups_cycles`):

* *planes* (:func:`planes_conv`): each channel plane is copied, padded, to a flat buffer of rows
  of ``Wq`` columns, and the output is computed over the flat index ``q = y*Wq + x``, so a tap
  is one contiguous vector load at ``q + (ky*Wq + kx)`` whatever the output width; the
  ``Wq - OW`` columns past each output row are computed and dropped.
  ``tvmamp.schedules.cpu.depthwise_planes`` schedules it. A stride-2 conv of an fp32 input
  of even width is split into its four polyphase planes (even/odd rows x even/odd columns),
  in each of which the conv is stride 1: the copy reads the input as pairs of columns (a
  ``uint64`` view) and takes each pair's low or high half, so that it stays one contiguous
  vector load where an element-strided load would be a gather;
* *direct* (:func:`direct_conv`): TOPI's grouped conv with the cast in its padding block, which
  ``CPUConv2d`` schedules as any depthwise conv (channels or columns vectorised).

The epilogue (bias, activation, casts) is fused into either kernel by ``FuseOps``.
"""

from __future__ import annotations

import tvm
from tvm import DataType, relax, te, tirx
from tvm.ir.expr import Constant
from tvm.relax import PyExprMutator

from tvmamp.tensors import out_dtype as conv_out_dtype
from tvmamp.tensors import static_shape

from .conv2d_im2col import GEMM_PATTERN, Geometry, astype, reshape

_CONV = tvm.ir.Op.get("relax.nn.conv2d")
_ASTYPE = tvm.ir.Op.get("relax.astype")
# Block annotation of the planes kernel's reduction: the row pitch ``Wq`` of its flat planes.
PLANES_ATTR = "tvmamp.depthwise_planes"
# Block annotation of its staging copy: ``(first row, rows, first column, columns)`` of each
# (phase) plane that hold input in every phase, so that the schedule copies them unchecked.
INTERIOR_ATTR = "tvmamp.depthwise_planes.interior"
# Vector lanes the planes kernel pads its flat output to (fp32 on AVX-512).
_LANES = 16
# Cycle estimates (Zen5, one thread, fp32 accumulation), see plane_cycles and groups_cycles.
_PLANE_OVERHEAD = 40
_ROW_CYCLES = 3
# The narrowest vector of output columns the direct conv's columns tiling uses.
_COLUMN_VECTOR = 8


@tvm.transform.module_pass(opt_level=0, name="tvmamp.DepthwisePlanes")
class DepthwisePlanes:
    """Rewrite each static NCHW depthwise conv2d (one output channel per group) whose input is
    one of ``dtypes`` into a kernel that reads the conv's fp32 input when it is a cast.

    Parameters
    ----------
    dtypes : tuple of str
        The conv input dtypes to rewrite (the low dtypes, by default); fp32 convs are left
        to ``CPUConv2d`` as they are.
    """

    def __init__(self, dtypes: tuple[str, ...] = ("bfloat16", "float16")):
        unknown = set(dtypes) - {"bfloat16", "float16", "float32"}
        if unknown:
            raise ValueError(
                f"tvmamp.DepthwisePlanes: dtypes {sorted(unknown)} are not among "
                "bfloat16, float16, float32"
            )
        self.dtypes = tuple(dtypes)

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        """Rewrite the depthwise convs of every Relax function of ``mod``."""
        rewriter = _Rewriter(mod, self.dtypes)
        for gvar, func in mod.functions_items():
            if isinstance(func, relax.Function):
                rewriter.bound = _casts(func)
                func = rewriter.visit_expr(func)
                rewriter.builder_.update_func(gvar, relax.analysis.remove_all_unused(func))
        return rewriter.builder_.get()


def _casts(func: relax.Function) -> dict:
    """Each variable of ``func``'s body bound to an ``astype`` of an fp32 tensor -> that tensor."""
    found = {}
    blocks = func.body.blocks if isinstance(func.body, relax.SeqExpr) else []
    for binding in (b for block in blocks for b in block.bindings):
        value = binding.value
        if isinstance(binding, relax.VarBinding) and isinstance(value, relax.Call):
            if value.op == _ASTYPE and str(value.args[0].ty.dtype) == "float32":
                found[binding.var] = value.args[0]
    return found


def depthwise_geometry(call: relax.Call, dtypes: tuple[str, ...]) -> Geometry | None:
    """The geometry of ``call`` when it is a static NCHW depthwise conv2d in ``dtypes``."""
    attrs = call.attrs
    if (attrs.data_layout, attrs.kernel_layout, attrs.out_layout) != ("NCHW", "OIHW", "NCHW"):
        return None
    data, weight = call.args
    shapes = (static_shape(data.ty), static_shape(weight.ty))
    if None in shapes or str(data.ty.dtype) not in dtypes:
        return None
    f, c = shapes[1][:2]
    g = Geometry.of(attrs, shapes[0], shapes[1])
    return g if c == 1 and f == g.groups == g.c else None


def plane_cycles(g: Geometry) -> float:
    """Estimated cycles of the planes kernel: per plane, one vector load and FMA per tap and
    vector of the flat output, a few cycles per copied or written row, and a fixed cost.

    Measured on Zen5 (one thread): 7 x 7 planes of 960 channels 0.028 ms (122 cycles a
    plane, 36 FMAs), 14 x 14 planes of 384 channels 0.016 ms.
    """
    pitch, length, rows = plane_layout(g)
    fmas = g.kh * g.kw * length // _LANES
    staged = rows * g.stride[0] * g.stride[1]  # rows of all phase planes
    return g.n * g.c * (fmas + _ROW_CYCLES * (staged + g.out_h) + _PLANE_OVERHEAD)


def groups_cycles(g: Geometry) -> float:
    """Estimated cycles of the direct conv vectorised over 16 channels: its copy of the padded
    input to channels-innermost is a gather, about one cycle an element, then one FMA per tap
    and 16 output channels at two a cycle.

    Measured on Zen5 (one thread): 960 x 7 x 7 0.022 ms, 384 x 14 x 14 0.029 ms.
    """
    padded = (g.h + g.pad[0] + g.pad[2]) * (g.w + g.pad[1] + g.pad[3])
    fmas = g.kh * g.kw * g.out_h * g.out_w * -(-g.c // _LANES) / 2
    return g.n * (g.c * padded + fmas)


def plane_layout(g: Geometry) -> tuple[int, int, int]:
    """``(Wq, L, rows)`` of the planes kernel: the row pitch, the flat output length (whole
    vectors) and the rows of a flat input plane (enough for every tap of that output); of each
    polyphase plane for stride 2."""
    s = g.stride[0]
    pitch = -(-(g.w + g.pad[1] + g.pad[3]) // s)
    length = -(-(g.out_h * pitch) // _LANES) * _LANES
    reach = (g.kh - 1) // s * g.dilation[0] * pitch + (g.kw - 1) // s * g.dilation[1]
    return pitch, length, -(-(length + reach) // pitch)


def plane_interior(g: Geometry) -> tuple[int, int, int, int]:
    """``(first row, rows, first column, columns)`` of the staged planes (each polyphase plane
    for stride 2) that hold input in every phase (:data:`INTERIOR_ATTR`)."""
    pitch, _, rows = plane_layout(g)
    s = g.stride[0]

    def interior(pad: int, size: int, extent: int) -> tuple[int, int]:
        first = max(-(-(pad - p) // s) for p in range(s))
        end = min((size - 1 + pad - p) // s + 1 for p in range(s))
        first, end = min(max(first, 0), extent), min(max(end, 0), extent)
        return first, max(end - first, 0)

    return (*interior(g.pad[0], g.h, rows), *interior(g.pad[1], g.w, pitch))


def uses_planes(g: Geometry, source_dtype: str = "float32") -> bool:
    """Whether the planes kernel runs ``g`` (input read as ``source_dtype``).

    Stride 1: when the output rows are ones that the direct conv cannot vectorise
    (``CPUConv2d`` runs rows with a power-of-two factor of at least :data:`_COLUMN_VECTOR`
    columns as whole vectors of columns, which is faster: 0.085 against 0.112 ms for
    144 x 56 x 56 on Zen5), and estimated faster than the direct conv vectorised over
    channels. Stride 2 (:func:`strided_planes`): always, where the input allows it; the
    direct conv's strided taps are gathers."""
    if strided_planes(g, source_dtype):
        return True
    columns = g.out_w & -g.out_w >= _COLUMN_VECTOR
    return g.stride == (1, 1) and not columns and plane_cycles(g) < groups_cycles(g)


def strided_planes(g: Geometry, source_dtype: str) -> bool:
    """Whether the planes kernel runs ``g`` on polyphase planes: stride 2 both ways, no
    dilation, an fp32 input (read as ``uint64`` pairs of columns) of even width."""
    return (
        g.stride == (2, 2) and g.dilation == (1, 1) and source_dtype == "float32" and g.w % 2 == 0
    )


def _inside(g: Geometry, y, x) -> tirx.PrimExpr:
    return tirx.all(y >= 0, y < g.h, x >= 0, x < g.w)


def planes_conv(x: te.Tensor, w: te.Tensor, g: Geometry, low: str, out_dtype: str) -> te.Tensor:
    """The planes kernel: ``x`` NCHW (rounded through ``low``; for stride 2 its ``uint64``
    view, :func:`_polyphase`), ``w`` ``[C, KH*KW]`` fp32.

    ``staged[n, c, r, j]`` is the padded plane (``Wq`` columns a row, zero past the input; for
    stride 2 ``staged[n, c, py, px, r, j]``, its polyphase planes), ``conv[n, c, q]`` the conv at
    ``q = y*Wq + x`` for whole vectors of ``q``, and the result ``conv[n, c, y*Wq + x]`` for
    ``x < OW``, cast to ``out_dtype``.
    """
    pitch, length, rows = plane_layout(g)
    top, left = g.pad[0], g.pad[1]
    zero = tirx.const(0, "float32")
    interior = {INTERIOR_ATTR: plane_interior(g)}
    if g.stride == (2, 2):
        staged = _polyphase(x, g, low, rows, pitch, interior)
    else:

        def stage(n, c, r, j):
            y, col = r - top, j - left
            value = x[n, c, y, col].astype(low).astype("float32")
            return tirx.if_then_else(_inside(g, y, col), value, zero)

        staged = te.compute((g.n, g.c, rows, pitch), stage, name="staged", attrs=interior)
    ky, kx = te.reduce_axis((0, g.kh), name="ky"), te.reduce_axis((0, g.kw), name="kx")

    def tap(n, c, q):
        if g.stride == (2, 2):  # tap (ky, kx) is phase (ky % 2, kx % 2), shifted by half
            i = q + tirx.floordiv(ky, 2) * pitch + tirx.floordiv(kx, 2)
            phase = (tirx.floormod(ky, 2), tirx.floormod(kx, 2))
        else:
            i = q + ky * g.dilation[0] * pitch + kx * g.dilation[1]
            phase = ()
        value = staged[(n, c, *phase, i // pitch, i % pitch)]
        return te.sum(value * w[c, ky * g.kw + kx], axis=[ky, kx])

    conv = te.compute((g.n, g.c, length), tap, name="conv", attrs={PLANES_ATTR: pitch})
    return te.compute(
        (g.n, g.c, g.out_h, g.out_w),
        lambda n, c, y, col: conv[n, c, y * pitch + col].astype(out_dtype),
        name="crop",
    )


def _polyphase(
    pairs: te.Tensor, g: Geometry, low: str, rows: int, pitch: int, attrs: dict
) -> te.Tensor:
    """The four polyphase planes ``staged[n, c, py, px, r, j] = padded[2r + py, 2j + px]`` of
    an fp32 input read as ``pairs`` (``[N, C, H, W / 2]`` of ``uint64``): the padded column
    ``2j + px`` is the low (even input column) or high half of pair ``j + (px - left) // 2``,
    the same half for every ``j``, so that a row of a phase plane is one contiguous vector
    load, a shift and a truncation."""
    top, left = g.pad[0], g.pad[1]
    bits = DataType(pairs.dtype).bits // 2
    half = f"uint{bits}"

    def stage(n, c, py, px, r, j):
        y, col = 2 * r + py - top, 2 * j + px - left
        pair = pairs[n, c, y, j + tirx.floordiv(px - left, 2)]
        shift = (tirx.floormod(px - left, 2) * bits).astype(pairs.dtype)
        value = tirx.reinterpret("float32", (pair >> shift).astype(half))
        value = value.astype(low).astype("float32")
        return tirx.if_then_else(_inside(g, y, col), value, tirx.const(0, "float32"))

    return te.compute((g.n, g.c, 2, 2, rows, pitch), stage, name="staged", attrs=attrs)


def direct_conv(x: te.Tensor, w: te.Tensor, g: Geometry, low: str, out_dtype: str) -> te.Tensor:
    """TOPI's depthwise conv (a padding block, then ``O[n, f, y, x]`` reduced over
    ``c, ky, kx``) of ``x`` rounded through ``low`` in its padding, ``w`` OIHW in ``low``."""
    top, left = g.pad[0], g.pad[1]
    shape = (g.n, g.c, g.h + top + g.pad[2], g.w + left + g.pad[3])

    def pad(n, c, y, col):
        value = x[n, c, y - top, col - left].astype(low)
        return tirx.if_then_else(_inside(g, y - top, col - left), value, tirx.const(0, low))

    padded = te.compute(shape, pad, name="pad_temp")
    c = te.reduce_axis((0, 1), name="rc")
    ky, kx = te.reduce_axis((0, g.kh), name="ry"), te.reduce_axis((0, g.kw), name="rx")
    (sy, sx), (dy, dx) = g.stride, g.dilation

    def conv(n, f, y, col):
        value = padded[n, f + c, y * sy + ky * dy, col * sx + kx * dx].astype(out_dtype)
        return te.sum(value * w[f, c, ky, kx].astype(out_dtype), axis=[c, ky, kx])

    return te.compute((g.n, g.c, g.out_h, g.out_w), conv, name="group_conv2d_nchw")


@relax.expr_functor.mutator
class _Rewriter(PyExprMutator):
    """Replaces each depthwise conv by a ``call_te`` of the kernel :func:`uses_planes` picks."""

    def __init__(self, mod: tvm.IRModule, dtypes: tuple[str, ...]):
        super().__init__(mod)
        self.dtypes = dtypes
        self.bound: dict = {}

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if call.op != _CONV:
            return call
        g = depthwise_geometry(call, self.dtypes)
        if g is None:
            return call
        data, weight = call.args
        low = str(data.ty.dtype)
        source = self.bound.get(data, data)
        out_dtype = conv_out_dtype(call, low)
        source_dtype = str(source.ty.dtype)
        if uses_planes(g, source_dtype):
            taps = astype(reshape(weight, (g.c, g.kh * g.kw)), "float32")
            if not isinstance(taps, Constant):  # a run-time weight: call_te takes no call
                taps = self.builder_.emit(taps)
            kernel, name = planes_conv, "depthwise_planes"
            if strided_planes(g, source_dtype):  # pairs of fp32 columns
                view = relax.op.memory.view(source, (g.n, g.c, g.h, g.w // 2), "uint64")
                source = self.builder_.emit(view)
        else:
            taps, kernel, name = weight, direct_conv, "depthwise_direct"
        # The kernels accumulate in their output dtype, which the AMP pass makes fp32. A low
        # model's conv (bf16 in, bf16 out, at O0) accumulates in fp32 too, then is rounded:
        # accumulated in bf16 its results were wrong (error above 1).
        result = self.builder_.call_te(
            lambda x, w: kernel(x, w, g, low, "float32"),
            source,
            taps,
            primfunc_name_hint=name,
            primfunc_attrs={"op_pattern": GEMM_PATTERN},
        )
        if out_dtype == "float32":
            return result
        return self.builder_.emit(relax.op.astype(result, out_dtype))
