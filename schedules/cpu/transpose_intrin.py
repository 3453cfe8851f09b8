"""A 16 x 16 transposing copy in registers: 16 row loads, 64 two-register shuffles, 16 stores.

A transposing copy vectorised by TVM stores each row of its tile from 16 strided element
loads (a gather), 17-28 GB/s here for bf16. This helper loads the 16 source rows of a tile
whole, transposes them with the block-swap network (stage ``b`` = 8, 4, 2, 1 swaps the
``b x b`` blocks off the diagonal of every ``2b x 2b`` block: one ``shufflevector`` of two
rows per output row), and stores 16 whole rows. It is LLVM IR text, inlined into the kernel
(``pragma_import_llvm``) and called through a tensor intrinsic; LLVM picks the target's
shuffles (``vpermt2w``/``vpermt2d`` with AVX-512). Elements of 16 and 32 bits.

:func:`strided_copy` and :func:`strided_copy_intrin` take any pure transposing copy whose
element offsets are affine in its iterators (NCHW planes to channel rows with the channels
split in groups, ``[h * w, c // 16, c % 16]`` rows back to planes) and extents not multiples of
16: the whole loop nest becomes one intrinsic of 16 x 16 transposes, the last tile of each
ragged extent overlapping the one before it.
"""

from __future__ import annotations

import dataclasses

import tvm_ffi
from tvm import DataType, s_tir, tirx
from tvm.ir import Range, TensorLoad
from tvm.ir.expr import Expr
from tvm.s_tir import TensorIntrin
from tvm.script import tirx as T
from tvm.sym import detect_linear_equation
from tvm.sym.analyzer import Analyzer
from tvm.target import Target
from tvm.tirx.analysis import undefined_vars

from .parallel import num_cores, row_chunks

SIDE = 16
BITS = (16, 32)
# An extent or a stride: an int, or a PrimExpr of symbolic sizes.
Size = int | Expr


def intrin_name(bits: int) -> str:
    """The name of the LLVM function for ``bits``-wide elements (any dtype of that width)."""
    return f"tvmamp_transpose_{SIDE}x{SIDE}_i{bits}"


_CONCAT = "<32 x i32> <" + ", ".join(f"i32 {i}" for i in range(32)) + ">"


def function_name(bits: int, to_bf16: bool = False, native: bool = False) -> str:
    """The LLVM function of :func:`llvm_ir` with these arguments."""
    return intrin_name(bits) + ("_from_f32" if to_bf16 else "") + ("_native" if native else "")


def _masks(block: int) -> tuple[str, str]:
    """The shuffle masks of rows ``i`` and ``i + block`` of one block-swap stage."""
    low = [c if c & block == 0 else SIDE + c - block for c in range(SIDE)]
    high = [c + block if c & block == 0 else SIDE + c for c in range(SIDE)]
    return tuple(", ".join(f"i32 {m}" for m in mask) for mask in (low, high))


def llvm_ir(bits: int, to_bf16: bool = False, native: bool = False) -> str:
    """The LLVM IR of ``void f(ptr dst, i64 dst_row_bytes, ptr src, i64 src_row_bytes)``.

    ``to_bf16``: the source rows are fp32 and are rounded to bf16 (to nearest even, NaN kept
    quiet, as TVM's own cast) before the transpose: 16 floats a row for 16-bit elements, 32
    (16 bf16 pairs) for 32-bit ones; ``native`` rounds with ``vcvtneps2bf16`` (avx512_bf16
    targets only, see :func:`round_to_bf16`).
    """
    vec = f"<{SIDE} x i{bits}>"
    name = function_name(bits, to_bf16, native)
    lines = [f"define linkonce_odr void @{name}(ptr %d, i64 %ldd, ptr %s, i64 %lds) #0 {{"]
    for i in range(SIDE):
        lines.append(f"  %so{i} = mul i64 %lds, {i}")
        lines.append(f"  %sp{i} = getelementptr i8, ptr %s, i64 %so{i}")
        if to_bf16 and bits == 16:
            lines += round_to_bf16(f"r0_{i}", f"%sp{i}", native)
        elif to_bf16:  # 32 floats -> 16 pairs of bf16
            lines += round_to_bf16(f"lo{i}", f"%sp{i}", native)
            lines.append(f"  %sq{i} = getelementptr i8, ptr %sp{i}, i64 64")
            lines += round_to_bf16(f"hi{i}", f"%sq{i}", native)
            lines += [
                f"  %w{i} = shufflevector <16 x i16> %lo{i}, <16 x i16> %hi{i}, {_CONCAT}",
                f"  %r0_{i} = bitcast <32 x i16> %w{i} to {vec}",
            ]
        else:
            lines.append(f"  %r0_{i} = load volatile {vec}, ptr %sp{i}, align 1")
    stage, block = 0, SIDE // 2
    while block >= 1:
        low, high = _masks(block)
        for i in range(SIDE):
            if i & block:
                continue
            j, src = i + block, stage
            args = f"{vec} %r{src}_{i}, {vec} %r{src}_{j}"
            lines.append(f"  %r{src + 1}_{i} = shufflevector {args}, <{SIDE} x i32> <{low}>")
            lines.append(f"  %r{src + 1}_{j} = shufflevector {args}, <{SIDE} x i32> <{high}>")
        stage, block = stage + 1, block // 2
    for i in range(SIDE):
        lines.append(f"  %do{i} = mul i64 %ldd, {i}")
        lines.append(f"  %dp{i} = getelementptr i8, ptr %d, i64 %do{i}")
        lines.append(f"  store {vec} %r{stage}_{i}, ptr %dp{i}, align 1")
    lines += ["  ret void", "}", "", "attributes #0 = { alwaysinline nounwind }", ""]
    return "\n".join(lines)


def round_to_bf16(name: str, ptr: str, native: bool = False) -> list[str]:
    """LLVM IR: load 16 floats at ``ptr`` and round them to the bf16 bits ``%name``.

    ``(x + 0x7fff + lsb) >> 16`` rounds to nearest even; NaN becomes the quiet NaN of its sign
    (the rounding could carry it to infinity). ``native``: LLVM's ``fptrunc`` to ``bfloat``,
    one ``vcvtneps2bf16`` on avx512_bf16 targets, for those only: the same rounding and NaN,
    but subnormal inputs become zero (as in TVM's own casts on those targets).
    """
    if native:
        return [
            f"  %{name}.x = load volatile <16 x float>, ptr {ptr}, align 1",
            f"  %{name}.b = fptrunc <16 x float> %{name}.x to <16 x bfloat>",
            f"  %{name} = bitcast <16 x bfloat> %{name}.b to <16 x i16>",
        ]
    v32, v16 = "<16 x i32>", "<16 x i16>"
    splat = lambda value: f"splat (i32 {value})"  # noqa: E731
    return [
        f"  %{name}.x = load volatile {v32}, ptr {ptr}, align 1",
        f"  %{name}.lsb = lshr {v32} %{name}.x, {splat(16)}",
        f"  %{name}.one = and {v32} %{name}.lsb, {splat(1)}",
        f"  %{name}.bias = add {v32} %{name}.one, {splat(0x7FFF)}",
        f"  %{name}.sum = add {v32} %{name}.x, %{name}.bias",
        f"  %{name}.hi = lshr {v32} %{name}.sum, {splat(16)}",
        f"  %{name}.abs = and {v32} %{name}.x, {splat(0x7FFFFFFF)}",
        f"  %{name}.nan = icmp ugt {v32} %{name}.abs, {splat(0x7F800000)}",
        f"  %{name}.quiet = or {v32} %{name}.lsb, {splat(0x40)}",
        f"  %{name}.pick = select <16 x i1> %{name}.nan, {v32} %{name}.quiet, {v32} %{name}.hi",
        f"  %{name} = trunc {v32} %{name}.pick to {v16}",
    ]


def _make(src: str, dst: str, function: str):
    """The (description, implementation) pair: ``D[i, j] = S[j, i]``, cast when ``src != dst``."""
    src_bytes, dst_bytes = DataType(src).bits // 8, DataType(dst).bits // 8

    @T.prim_func(s_tir=True)
    def desc(s: T.handle, d: T.handle) -> None:
        S = T.match_buffer(s, (SIDE, SIDE), src, offset_factor=1, strides=[T.int64(), 1])
        D = T.match_buffer(d, (SIDE, SIDE), dst, offset_factor=1, strides=[T.int64(), 1])
        with T.sblock("root"):
            T.reads(S[0:SIDE, 0:SIDE])
            T.writes(D[0:SIDE, 0:SIDE])
            for i, j in T.grid(SIDE, SIDE):
                with T.sblock("transpose"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    D[vi, vj] = T.Cast(dst, S[vj, vi]) if src != dst else S[vj, vi]

    @T.prim_func(s_tir=True)
    def impl(s: T.handle, d: T.handle) -> None:
        lds = T.int64()
        ldd = T.int64()
        S = T.match_buffer(s, (SIDE, SIDE), src, offset_factor=1, strides=[lds, 1])
        D = T.match_buffer(d, (SIDE, SIDE), dst, offset_factor=1, strides=[ldd, 1])
        with T.sblock("root"):
            T.reads(S[0:SIDE, 0:SIDE])
            T.writes(D[0:SIDE, 0:SIDE])
            T.evaluate(
                T.call_extern(
                    "void",
                    function,
                    T.address_of(D[0, 0]),
                    ldd * dst_bytes,
                    T.address_of(S[0, 0]),
                    lds * src_bytes,
                )
            )

    return desc, impl


def transpose_intrin(src: str, dst: str) -> tuple[str, str] | None:
    """Register (once) the tensor intrinsic of a ``src -> dst`` transposing copy.

    Returns its name and the LLVM IR to import, or None: the elements must be 16 or 32 bits
    wide and of one dtype, or the copy must round fp32 to bf16.
    """
    bits = DataType(dst).bits * DataType(dst).lanes
    to_bf16 = (src, dst) == ("float32", "bfloat16")
    if bits not in BITS or (src != dst and not to_bf16):
        return None
    function = function_name(bits, to_bf16)
    name = f"{function}_{src}_{dst}"
    if TensorIntrin.get(name, allow_missing=True) is None:
        TensorIntrin.register(name, *_make(src, dst, function))
    return name, llvm_ir(bits, to_bf16)


def _tile_starts(pixels: int) -> tuple[int, int]:
    """``(tiles, last)``: whole 16-pixel tiles, then one more starting at ``last`` (overlapping
    the one before it: the same values written twice) when ``pixels`` is not a multiple of 16;
    ``last`` is -1 when there is none (``pixels`` a multiple of 16, or below 16)."""
    tiles = pixels // SIDE
    last = pixels - SIDE if pixels % SIDE and pixels > SIDE else -1
    return tiles, last


def _make_rows(dtype: str, pixels: int, function: str):
    """The (description, implementation) pair of ``D[p, c] = S[c, p]``: 16 planes of
    ``pixels`` to ``pixels`` channel-innermost rows of 16."""
    tiles, last = _tile_starts(pixels)
    size = DataType(dtype).bits // 8
    count = T.int64(pixels)

    @T.prim_func(s_tir=True)
    def desc(s: T.handle, d: T.handle) -> None:
        S = T.match_buffer(s, (SIDE, count), dtype, offset_factor=1, strides=[T.int64(), 1])
        D = T.match_buffer(d, (count, SIDE), dtype, offset_factor=1, strides=[T.int64(), 1])
        with T.sblock("root"):
            T.reads(S[0:SIDE, 0:count])
            T.writes(D[0:count, 0:SIDE])
            for p, c in T.grid(count, SIDE):
                with T.sblock("rows"):
                    vp, vc = T.axis.remap("SS", [p, c])
                    D[vp, vc] = S[vc, vp]

    @T.prim_func(s_tir=True)
    def impl(s: T.handle, d: T.handle) -> None:
        lds = T.int64()
        ldd = T.int64()
        S = T.match_buffer(s, (SIDE, count), dtype, offset_factor=1, strides=[lds, 1])
        D = T.match_buffer(d, (count, SIDE), dtype, offset_factor=1, strides=[ldd, 1])
        with T.sblock("root"):
            T.reads(S[0:SIDE, 0:count])
            T.writes(D[0:count, 0:SIDE])
            for t in range(tiles):
                T.evaluate(
                    T.call_extern(
                        "void",
                        function,
                        T.address_of(D[t * SIDE, 0]),
                        ldd * size,
                        T.address_of(S[0, t * SIDE]),
                        lds * size,
                    )
                )
            if last >= 0:
                T.evaluate(
                    T.call_extern(
                        "void",
                        function,
                        T.address_of(D[last, 0]),
                        ldd * size,
                        T.address_of(S[0, last]),
                        lds * size,
                    )
                )
            for p, c in T.grid(count - tiles * SIDE if pixels < SIDE else 0, SIDE):
                D[p, c] = S[c, p]

    return desc, impl


def _make_planes(src: str, dst: str, height: int, width: int, function: str):
    """The (description, implementation) pair of ``D[c, y, x] = S[y * width + x, c]`` (cast
    when ``src != dst``): 16 channel-innermost rows of ``height * width`` pixels to 16 NCHW
    planes."""
    pixels = height * width
    tiles, last = _tile_starts(pixels)
    src_bytes, dst_bytes = DataType(src).bits // 8, DataType(dst).bits // 8
    rows, cols = T.int64(height), T.int64(width)

    @T.prim_func(s_tir=True)
    def desc(s: T.handle, d: T.handle) -> None:
        S = T.match_buffer(s, (pixels, SIDE), src, offset_factor=1, strides=[T.int64(), 1])
        D = T.match_buffer(
            d, (SIDE, rows, cols), dst, offset_factor=1, strides=[T.int64(), cols, 1]
        )
        with T.sblock("root"):
            T.reads(S[0:pixels, 0:SIDE])
            T.writes(D[0:SIDE, 0:rows, 0:cols])
            for c, y, x in T.grid(SIDE, rows, cols):
                with T.sblock("planes"):
                    vc, vy, vx = T.axis.remap("SSS", [c, y, x])
                    D[vc, vy, vx] = (
                        T.Cast(dst, S[vy * cols + vx, vc]) if src != dst else S[vy * cols + vx, vc]
                    )

    @T.prim_func(s_tir=True)
    def impl(s: T.handle, d: T.handle) -> None:
        lds = T.int64()
        ldd = T.int64()
        S = T.match_buffer(s, (pixels, SIDE), src, offset_factor=1, strides=[lds, 1])
        D = T.match_buffer(d, (SIDE, rows, cols), dst, offset_factor=1, strides=[ldd, cols, 1])
        with T.sblock("root"):
            T.reads(S[0:pixels, 0:SIDE])
            T.writes(D[0:SIDE, 0:rows, 0:cols])
            # Each plane is contiguous: a tile's 16 pixels run on across rows.
            for t in range(tiles):
                T.evaluate(
                    T.call_extern(
                        "void",
                        function,
                        T.address_of(D[0, t * SIDE // cols, t * SIDE % cols]),
                        ldd * dst_bytes,
                        T.address_of(S[t * SIDE, 0]),
                        lds * src_bytes,
                    )
                )
            if last >= 0:
                T.evaluate(
                    T.call_extern(
                        "void",
                        function,
                        T.address_of(D[0, last // cols, last % cols]),
                        ldd * dst_bytes,
                        T.address_of(S[last, 0]),
                        lds * src_bytes,
                    )
                )
            for p, c in T.grid(pixels if pixels < SIDE else 0, SIDE):
                D[c, p // cols, p % cols] = T.Cast(dst, S[p, c]) if src != dst else S[p, c]

    return desc, impl


def _register(name: str, src: str, dst: str, make) -> tuple[str, str] | None:
    """Register (once) the intrinsic ``make(function)`` of a ``src -> dst`` copy under
    ``name``; return its name and the LLVM IR to import, or None when the elements are not 16
    or 32 bits wide and of one dtype, or the copy does not round fp32 to bf16."""
    bits = DataType(dst).bits * DataType(dst).lanes
    to_bf16 = (src, dst) == ("float32", "bfloat16")
    if bits not in BITS or (src != dst and not to_bf16):
        return None
    if TensorIntrin.get(name, allow_missing=True) is None:
        TensorIntrin.register(name, *make(function_name(bits, to_bf16)))
    return name, llvm_ir(bits, to_bf16)


def rows_intrin(dtype: str, pixels: int) -> tuple[str, str] | None:
    """The tensor intrinsic that copies 16 planes of ``pixels`` elements (rows of a 2-D
    region) to ``pixels`` rows of 16 channels: whole 16 x 16 transposes, the last one
    overlapping the one before when ``pixels`` is not a multiple of 16. Returns its name and
    the LLVM IR to import, or None when ``dtype`` is not 16 or 32 bits wide."""
    name = f"tvmamp_rows_{pixels}_{dtype}"
    return _register(name, dtype, dtype, lambda f: _make_rows(dtype, pixels, f))


def planes_intrin(src: str, dst: str, height: int, width: int) -> tuple[str, str] | None:
    """The tensor intrinsic that writes ``height * width`` rows of 16 ``src`` channels as 16
    ``dst`` NCHW planes ``[16, height, width]`` (transposed as :func:`rows_intrin`; fp32 rows
    rounded to bf16 planes). Returns its name and the LLVM IR to import, or None when the
    elements are not 16 or 32 bits wide and of one dtype, or the copy does not round fp32 to
    bf16."""
    name = f"tvmamp_planes_{height}x{width}_{src}_{dst}"
    return _register(name, src, dst, lambda f: _make_planes(src, dst, height, width, f))


@dataclasses.dataclass(frozen=True)
class StridedCopy:
    """A pure copy ``dst[...] = src[...]`` (or an fp32 -> bf16 cast) as a transposition of
    flat element offsets: ``rows`` is the axis contiguous in ``src``, ``cols`` the axis
    contiguous in ``dst``, ``outer`` the other axes (see :func:`strided_copy`).

    Element ``(o, r, c)`` goes from ``src[src_base + o . outer_src + r + c * cols[1]]`` to
    ``dst[dst_base + o . outer_dst + r * rows[1] + c]``. Extents and strides are ints, or
    PrimExprs of the buffers' symbolic sizes (a key-value cache's length).
    """

    src: tirx.Buffer
    dst: tirx.Buffer
    rows: tuple[Size, Size]  # (extent, dst stride)
    cols: tuple[Size, Size]  # (extent, src stride)
    outer: tuple[tuple[Size, Size, Size], ...]  # (extent, src stride, dst stride)
    base: tuple[Size, Size]  # (src, dst)

    @property
    def static(self) -> bool:
        """Whether every extent and stride is an int."""
        sizes = [*self.rows, *self.cols, *self.base, *(v for axis in self.outer for v in axis)]
        return all(isinstance(v, int) for v in sizes)


def strided_copy(block: s_tir.SBlock, symbolic: bool = False) -> StridedCopy | None:
    """``block`` as a :class:`StridedCopy` whose two transposed extents are at least 16, or None.

    None unless the block only stores one load of another buffer, as it is or rounded from
    fp32 to bf16, with 16- or 32-bit elements; stores to its iterators themselves (every
    element written once); and reads at an offset affine in its iterators (``//`` and ``%``
    of a reshape simplified away). Only such a copy may be run in overlapping tiles: a tile
    written twice gets the same values twice.

    Static shapes only, unless ``symbolic``: then extents and strides may be expressions of
    the buffers' symbolic sizes, and a symbolic transposed extent is not known to be 16 or
    more (:func:`symbolic_copy_function` checks it at run time).
    """
    store = block.body
    if block.init is not None or block.alloc_buffers or block.match_buffers:
        return None
    if not isinstance(store, tirx.BufferStore) or len(block.reads) != 1:
        return None
    load = store.value.value if isinstance(store.value, tirx.Cast) else store.value
    if not isinstance(load, TensorLoad) or load.source.same_as(store.buffer):
        return None
    src, dst = load.source, store.buffer
    to_bf16 = (str(src.dtype), str(dst.dtype)) == ("float32", "bfloat16")
    if isinstance(store.value, tirx.Cast) != to_bf16:
        return None
    if str(src.dtype) != str(dst.dtype) and not to_bf16:
        return None
    if DataType(str(dst.dtype)).bits * DataType(str(dst.dtype)).lanes not in BITS:
        return None
    static = [iv.dom.extent for iv in block.iter_vars] + list(src.shape) + list(dst.shape)
    if src.strides or dst.strides:
        return None
    if not symbolic and not all(isinstance(e, tirx.IntImm) for e in static):
        return None
    iters = [iv.var for iv in block.iter_vars]
    written = list(store.indices)
    if not iters or not all(isinstance(index, tirx.Var) for index in written):
        return None
    if any(a.same_as(b) for k, a in enumerate(written) for b in written[:k]):
        return None  # an element written more than once
    if any(
        _size(iv.dom.extent) != 1 and not any(iv.var.same_as(index) for index in written)
        for iv in block.iter_vars
    ):
        return None  # iterations writing one element, in turn
    analyzer = Analyzer()
    for iv in block.iter_vars:
        analyzer.bind(iv.var, iv.dom)
    strides = []
    dtype = str(iters[0].ty)
    for buffer, indices in ((src, load.indices), (dst, store.indices)):
        found = _affine(analyzer, _flat_offset(buffer, indices, dtype), iters)
        if found is None:
            return None
        strides.append(found)
    (src_strides, src_base), (dst_strides, dst_base) = strides
    if not symbolic and not all(isinstance(v, int) for v in [*src_strides, *dst_strides]):
        return None
    axes = [
        (_size(iv.dom.extent), s, d)
        for iv, s, d in zip(block.iter_vars, src_strides, dst_strides)
        if _size(iv.dom.extent) != 1
    ]
    axes = _coalesce(axes, analyzer)
    rows = [axis for axis in axes if _is_one(axis[1])]
    cols = [axis for axis in axes if _is_one(axis[2])]
    if len(rows) != 1 or len(cols) != 1 or rows[0] is cols[0]:
        return None
    (row,), (col,) = rows, cols
    if any(isinstance(e, int) and e < SIDE for e in (row[0], col[0])):
        return None
    outer = tuple(axis for axis in axes if axis is not row and axis is not col)
    return StridedCopy(src, dst, (row[0], row[2]), (col[0], col[1]), outer, (src_base, dst_base))


def _size(value) -> Size:
    """``value`` as an int where it is a constant, else the PrimExpr itself."""
    return int(value) if isinstance(value, (int, tirx.IntImm)) else value


def _is_one(value: Size) -> bool:
    return isinstance(value, int) and value == 1


def _flat_offset(buffer: tirx.Buffer, indices, dtype: str) -> tirx.PrimExpr:
    """The element offset of ``buffer[indices]`` from the first element of ``buffer`` (compact),
    of ``dtype`` (the iterators' integer type)."""
    stride = tirx.IntImm(dtype, 1)
    strides = []
    for extent in reversed(list(buffer.shape)):
        strides.insert(0, stride)
        stride = stride * _cast(dtype, extent)
    offset = tirx.IntImm(dtype, 0)
    for index, stride in zip(indices, strides):
        offset = offset + _cast(dtype, index) * stride
    return offset


def _cast(dtype: str, value) -> tirx.PrimExpr:
    if isinstance(value, int):
        return tirx.IntImm(dtype, value)
    return value if str(value.ty) == dtype else tirx.Cast(dtype, value)


def _affine(analyzer: Analyzer, offset, iters) -> tuple[list[Size], Size] | None:
    """``offset`` as ``(coefficients of iters, constant)``, or None when it is not affine.
    Coefficients are ints, or PrimExprs of symbolic sizes (none of ``iters``)."""
    offset = analyzer.simplify(offset)
    found = detect_linear_equation(offset, iters)
    if len(found) != len(iters) + 1:
        return None
    for coefficient in found:
        if any(v.same_as(i) for v in undefined_vars(coefficient) for i in iters):
            return None
    linear = found[-1]
    for coefficient, var in zip(found[:-1], iters):
        linear = linear + coefficient * var
    if not _proven_equal(analyzer, offset, linear, iters):
        return None
    found = [_size(analyzer.simplify(c)) for c in found]
    return found[:-1], found[-1]


# Values each symbolic size takes in turn where TVM's simplifier cannot compare two
# expressions of it: it does not cancel ``n * v`` against ``v * n``.
_SAMPLE_SIZES = (1, 2, 17, 1000)


def _proven_equal(analyzer: Analyzer, a, b, iters) -> bool:
    """Whether ``a == b`` for all values of ``iters``: proven by ``analyzer``, or, for
    expressions of symbolic sizes, proven with each size set to each of
    :data:`_SAMPLE_SIZES` (products of sizes are polynomials of low degree in each)."""
    if analyzer.can_prove_equal(a, b):
        return True
    sizes = {v for e in (a, b) for v in undefined_vars(e) if not any(v.same_as(i) for i in iters)}
    if not sizes:
        return False
    for value in _SAMPLE_SIZES:
        values = {v: tirx.IntImm(str(v.ty), value) for v in sizes}
        if not analyzer.can_prove_equal(_substituted(a, values), _substituted(b, values)):
            return False
    return True


def _substituted(expr: tirx.PrimExpr, values: dict) -> tirx.PrimExpr:
    return tvm_ffi.structural_map(expr, [(tirx.Var, lambda v: values.get(v, v))])


def _coalesce(axes: list[tuple], analyzer: Analyzer) -> list[tuple]:
    """Merge axes ``u`` and ``v`` that run on as one (``stride_u = extent_v * stride_v`` in both
    ``src`` and ``dst``): an ``h, w`` pair of pixels becomes one axis of ``h * w``."""

    def equal(a, b) -> bool:
        if isinstance(a, int) and isinstance(b, int):
            return a == b
        return analyzer.can_prove_equal(_cast("int64", a), _cast("int64", b))

    axes = list(axes)
    merged = True
    while merged:
        merged = False
        for u, (extent_u, src_u, dst_u) in enumerate(axes):
            for v, (extent_v, src_v, dst_v) in enumerate(axes):
                if u != v and equal(src_u, extent_v * src_v) and equal(dst_u, extent_v * dst_v):
                    axes[v] = (_size(analyzer.simplify(_product(extent_u, extent_v))), src_v, dst_v)
                    del axes[u]
                    merged = True
                    break
            if merged:
                break
    return axes


def _product(a: Size, b: Size) -> Size:
    if isinstance(a, int) and isinstance(b, int):
        return a * b
    return _cast("int64", a) * _cast("int64", b)


def strided_copy_intrin(
    copy: StridedCopy, nest: s_tir.SBlockRealize, parallel: bool, cores: int | None = None
) -> str | None:
    """Register (once) the tensor intrinsic that runs ``nest``, the whole loop nest of ``copy``
    blockized, as 16 x 16 register transposes; return its name, or None when ``nest`` does
    not read and write both buffers whole.

    The description is ``nest`` itself (its copy with fresh variables and buffers), so any
    loop structure and index expressions match. The implementation loops over the outer axes
    and the tiles of ``rows`` (in parallel when ``parallel``), then the tiles of ``cols``; the
    last tile of an extent that is not a multiple of 16 starts 16 before its end. It imports
    the LLVM IR of the transpose itself (``pragma_import_llvm`` on its outer loop).

    ``cores``: the target's cores (default: ``num-cores`` of the current target, 1 without
    one). When the parallel tasks (outer axes times row tiles) are fewer, the tiles of
    ``cols`` are cut into chunks that run as tasks too (:func:`_col_chunks`).
    """
    block = nest.block
    for regions, buffer in ((block.reads, copy.src), (block.writes, copy.dst)):
        if len(regions) != 1 or not _whole(regions[0], buffer):
            return None
    if not _unpredicated(block.body):  # a ``T.where`` would skip elements the tiles write
        return None
    desc = s_tir.renew_defs(tirx.PrimFunc([copy.src, copy.dst], nest))
    impl = _strided_impl(copy, parallel, _current_cores() if cores is None else cores)
    name = f"tvmamp_strided_copy_{tvm_ffi.structural_hash([desc, impl]) & (2**64 - 1):016x}"
    found = TensorIntrin.get(name, allow_missing=True)
    if found is None:
        TensorIntrin.register(name, desc, impl)
    elif not tvm_ffi.structural_equal([found.desc, found.impl], [desc, impl]):
        return None  # a hash collision: leave the copy to the other schedules
    return name


def _unpredicated(stmt) -> bool:
    """Whether ``stmt``, a loop nest, holds one block, realized without a predicate."""
    while isinstance(stmt, tirx.For):
        stmt = stmt.body
    if not isinstance(stmt, s_tir.SBlockRealize):
        return False
    predicate = stmt.predicate
    return isinstance(predicate, tirx.IntImm) and int(predicate) == 1


def _whole(region, buffer: tirx.Buffer) -> bool:
    """Whether ``region`` is all of ``buffer``."""
    return all(
        isinstance(rng.min, tirx.IntImm)
        and isinstance(rng.extent, tirx.IntImm)
        and int(rng.min) == 0
        and int(rng.extent) == int(extent)
        for rng, extent in zip(region.region, buffer.shape)
    )


def _current_cores() -> int:
    """``num-cores`` of the current target (``with target:``, as the schedule passes run), or 1."""
    target = Target.current(allow_none=True)
    return num_cores(target) if target is not None else 1


def _col_chunks(tasks: int, col_tiles: int, cores: int) -> int:
    """How many chunks of the ``col_tiles`` to run as tasks beside ``tasks`` (1: none).

    Only when ``tasks`` (outer axes times row tiles) are fewer than ``cores``: a
    ``[16384, 32] -> [32, 16384]`` copy has 2 row tiles and 1,024 column tiles. The chunks are
    chosen as :func:`.parallel.row_chunks` chooses row chunks of a GEMM.
    """
    return row_chunks(cores, tasks, col_tiles) if tasks < cores else 1


def _strided_impl(copy: StridedCopy, parallel: bool, cores: int = 1) -> tirx.PrimFunc:
    """The implementation of :func:`strided_copy_intrin`: loops calling the 16 x 16 transpose
    (:func:`_tile_loops`) over fresh buffers of the copy's shapes."""
    src = tirx.decl_buffer(copy.src.shape, str(copy.src.dtype), "S")
    dst = tirx.decl_buffer(copy.dst.shape, str(copy.dst.dtype), "D")
    body = _tile_loops(copy, src, dst, parallel, cores)
    root = s_tir.SBlock([], [_whole_region(src)], [_whole_region(dst)], "root", body)
    return tirx.PrimFunc([src, dst], s_tir.SBlockRealize([], True, root))


def symbolic_copy_function(
    copy: StridedCopy, func: tirx.PrimFunc, parallel: bool
) -> tirx.PrimFunc | None:
    """``func``, a kernel whose only block is ``copy`` (a :func:`strided_copy` over symbolic
    sizes), as 16 x 16 register transposes (:func:`_tile_loops`) where both transposed extents
    are at least 16 at run time, else its own loops (a cache of fewer than 16 positions).

    TVM's tensorize cannot match a description over symbolic sizes, so the kernel's body is
    replaced here rather than tensorized as :func:`strided_copy_intrin` does for static shapes.
    None when ``func``'s root block does not read and write the copy's buffers whole.
    """
    realize = func.body
    if not isinstance(realize, s_tir.SBlockRealize):
        return None
    root = realize.block
    params = [p for p in func.params if tirx.is_buffer_var(p)]
    if not all(any(p.same_as(b) for p in params) for b in (copy.src, copy.dst)):
        return None
    checks = [e >= SIDE for e in (copy.rows[0], copy.cols[0]) if not isinstance(e, int)]
    tiled = _tile_loops(copy, copy.src, copy.dst, parallel, 1)
    body = tirx.IfThenElse(tirx.all(*checks), tiled, root.body) if checks else tiled
    block = s_tir.SBlock(
        root.iter_vars,
        root.reads,
        root.writes,
        root.name_hint,
        body,
        root.init,
        root.alloc_buffers,
        root.match_buffers,
        root.annotations,
    )
    return func.with_body(s_tir.SBlockRealize(realize.iter_values, realize.predicate, block))


def _whole_region(buffer: tirx.Buffer) -> tirx.BufferRegion:
    return tirx.BufferRegion(buffer, [Range.from_min_extent(0, n) for n in buffer.shape])


def _i64(value: Size) -> tirx.PrimExpr:
    return _cast("int64", value)


def _tile_loops(
    copy: StridedCopy, src: tirx.Buffer, dst: tirx.Buffer, parallel: bool, cores: int
) -> tirx.Stmt:
    """The loops calling the 16 x 16 transpose over ``copy`` from ``src`` to ``dst``.

    The parallel loop is ``task``: the outer axes, the row tiles and, when those are fewer than
    ``cores``, chunks of the column tiles (innermost); ``col_tile`` runs the column tiles of a
    chunk. The last tile of an extent that is not a multiple of 16 starts 16 before its end
    (over a symbolic extent: at least 16, see :func:`symbolic_copy_function`).
    """
    src_type, dst_type = str(copy.src.dtype), str(copy.dst.dtype)
    bits = DataType(dst_type).bits * DataType(dst_type).lanes
    to_bf16 = src_type != dst_type
    (rows, dst_row_stride), (cols, src_col_stride) = copy.rows, copy.cols
    row_tiles, col_tiles = _tiles(rows), _tiles(cols)
    outer_count = 1
    for extent, _, _ in copy.outer:
        outer_count = _product(outer_count, extent)
    task, col_tile = tirx.Var("task", "int64"), tirx.Var("col_tile", "int64")

    def start(tile, extent):  # the last tile of a ragged extent overlaps the one before
        if isinstance(extent, int) and extent % SIDE == 0:
            return tile * SIDE
        return tirx.Min(tile * SIDE, _i64(extent) - SIDE)

    static = copy.static
    chunks = _col_chunks(outer_count * row_tiles, col_tiles, cores) if parallel and static else 1
    if chunks > 1:  # the chunk of column tiles is the innermost part of the task
        per_chunk = col_tiles // chunks
        row_task = task // chunks
        col = start(task % chunks * per_chunk + col_tile, cols)
    else:
        per_chunk, row_task = col_tiles, task
        col = start(col_tile, cols)
    row = start(tirx.floormod(row_task, _i64(row_tiles)), rows)
    src_offset, dst_offset = _i64(copy.base[0]), _i64(copy.base[1])
    rest = tirx.floordiv(row_task, _i64(row_tiles))
    for extent, src_stride, dst_stride in reversed(copy.outer):  # innermost first
        index = tirx.floormod(rest, _i64(extent))
        rest = tirx.floordiv(rest, _i64(extent))
        src_offset = src_offset + index * _i64(src_stride)
        dst_offset = dst_offset + index * _i64(dst_stride)
    src_offset = src_offset + row + col * _i64(src_col_stride)
    dst_offset = dst_offset + row * _i64(dst_row_stride) + col
    src_bytes, dst_bytes = DataType(src_type).bits // 8, DataType(dst_type).bits // 8

    def pointer(buffer, offset, size):
        first = tirx.address_of(tirx.BufferLoad(buffer, [_i64(0)] * len(buffer.shape)))
        return tirx.call_intrin("handle", "tirx.handle_add_byte_offset", first, offset * size)

    call = tirx.call_extern(
        "void",
        function_name(bits, to_bf16),
        pointer(dst, dst_offset, dst_bytes),
        _i64(dst_row_stride) * dst_bytes,
        pointer(src, src_offset, src_bytes),
        _i64(src_col_stride) * src_bytes,
    )
    body = tirx.For(col_tile, _i64(0), _i64(per_chunk), tirx.ForKind.SERIAL, tirx.Evaluate(call))
    kind = tirx.ForKind.PARALLEL if parallel else tirx.ForKind.SERIAL
    annotations = {"pragma_import_llvm": llvm_ir(bits, to_bf16)}
    tasks = _product(_product(outer_count, row_tiles), chunks)
    return tirx.For(task, _i64(0), _i64(tasks), kind, body, annotations=annotations)


def _tiles(extent: Size) -> Size:
    """The 16-wide tiles of ``extent``, the last one partial."""
    if isinstance(extent, int):
        return -(-extent // SIDE)
    return tirx.floordiv(_i64(extent) + (SIDE - 1), SIDE)


__all__ = [
    "BITS",
    "SIDE",
    "StridedCopy",
    "intrin_name",
    "llvm_ir",
    "planes_intrin",
    "rows_intrin",
    "strided_copy",
    "strided_copy_intrin",
    "symbolic_copy_function",
    "transpose_intrin",
]
