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
from tvm.s_tir import TensorIntrin
from tvm.script import tirx as T
from tvm.sym import detect_linear_equation
from tvm.sym.analyzer import Analyzer
from tvm.target import Target

from .parallel import num_cores, row_chunks

SIDE = 16
BITS = (16, 32)


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
    ``dst[dst_base + o . outer_dst + r * rows[1] + c]``.
    """

    src: tirx.Buffer
    dst: tirx.Buffer
    rows: tuple[int, int]  # (extent, dst stride)
    cols: tuple[int, int]  # (extent, src stride)
    outer: tuple[tuple[int, int, int], ...]  # (extent, src stride, dst stride)
    base: tuple[int, int]  # (src, dst)


def strided_copy(block: s_tir.SBlock) -> StridedCopy | None:
    """``block`` as a :class:`StridedCopy` whose two transposed extents are at least 16, or None.

    None unless the block only stores one load of another buffer, as it is or rounded from
    fp32 to bf16, with 16- or 32-bit elements; stores to its iterators themselves (every
    element written once); and reads at an offset affine in its iterators (``//`` and ``%``
    of a reshape simplified away). Only such a copy may be run in overlapping tiles: a tile
    written twice gets the same values twice.
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
    if src.strides or dst.strides or not all(isinstance(e, tirx.IntImm) for e in static):
        return None
    iters = [iv.var for iv in block.iter_vars]
    written = list(store.indices)
    if not iters or not all(isinstance(index, tirx.Var) for index in written):
        return None
    if any(a.same_as(b) for k, a in enumerate(written) for b in written[:k]):
        return None  # an element written more than once
    if any(
        int(iv.dom.extent) > 1 and not any(iv.var.same_as(index) for index in written)
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
    axes = [
        (int(iv.dom.extent), s, d)
        for iv, s, d in zip(block.iter_vars, src_strides, dst_strides)
        if int(iv.dom.extent) > 1
    ]
    axes = _coalesce(axes)
    rows = [axis for axis in axes if axis[1] == 1]
    cols = [axis for axis in axes if axis[2] == 1]
    if len(rows) != 1 or len(cols) != 1 or rows[0] is cols[0]:
        return None
    (row,), (col,) = rows, cols
    if min(row[0], col[0]) < SIDE:
        return None
    outer = tuple(axis for axis in axes if axis is not row and axis is not col)
    return StridedCopy(src, dst, (row[0], row[2]), (col[0], col[1]), outer, (src_base, dst_base))


def _flat_offset(buffer: tirx.Buffer, indices, dtype: str) -> tirx.PrimExpr:
    """The element offset of ``buffer[indices]`` from the first element of ``buffer`` (compact,
    of a static shape), of ``dtype`` (the iterators' integer type)."""
    shape = [int(extent) for extent in buffer.shape]
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * shape[i + 1]
    offset = tirx.IntImm(dtype, 0)
    for index, stride in zip(indices, strides):
        index = index if str(index.ty) == dtype else tirx.Cast(dtype, index)
        offset = offset + index * tirx.IntImm(dtype, stride)
    return offset


def _affine(analyzer: Analyzer, offset, iters) -> tuple[list[int], int] | None:
    """``offset`` as ``(coefficients of iters, constant)``, or None when it is not affine."""
    offset = analyzer.simplify(offset)
    found = detect_linear_equation(offset, iters)
    if len(found) != len(iters) + 1 or not all(isinstance(c, tirx.IntImm) for c in found):
        return None
    linear = found[-1]
    for coefficient, var in zip(found[:-1], iters):
        linear = linear + coefficient * var
    if not analyzer.can_prove_equal(offset, linear):
        return None
    return [int(c) for c in found[:-1]], int(found[-1])


def _coalesce(axes: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """Merge axes ``u`` and ``v`` that run on as one (``stride_u = extent_v * stride_v`` in both
    ``src`` and ``dst``): an ``h, w`` pair of pixels becomes one axis of ``h * w``."""
    axes = list(axes)
    merged = True
    while merged:
        merged = False
        for u, (extent_u, src_u, dst_u) in enumerate(axes):
            for v, (extent_v, src_v, dst_v) in enumerate(axes):
                if u != v and src_u == extent_v * src_v and dst_u == extent_v * dst_v:
                    axes[v] = (extent_u * extent_v, src_v, dst_v)
                    del axes[u]
                    merged = True
                    break
            if merged:
                break
    return axes


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
    """The implementation of :func:`strided_copy_intrin`: loops calling the 16 x 16 transpose.

    The parallel loop is ``task``: the outer axes, the row tiles and, when those are fewer than
    ``cores``, chunks of the column tiles (innermost); ``col_tile`` runs the column tiles of a
    chunk.
    """
    src_type, dst_type = str(copy.src.dtype), str(copy.dst.dtype)
    bits = DataType(dst_type).bits * DataType(dst_type).lanes
    to_bf16 = src_type != dst_type
    src = tirx.decl_buffer(copy.src.shape, src_type, "S")
    dst = tirx.decl_buffer(copy.dst.shape, dst_type, "D")
    (rows, dst_row_stride), (cols, src_col_stride) = copy.rows, copy.cols
    row_tiles, col_tiles = -(-rows // SIDE), -(-cols // SIDE)
    i64 = lambda value: tirx.IntImm("int64", value)  # noqa: E731
    outer_count = 1
    for extent, _, _ in copy.outer:
        outer_count *= extent
    task, col_tile = tirx.Var("task", "int64"), tirx.Var("col_tile", "int64")

    def start(tile, extent):  # the last tile of a ragged extent overlaps the one before
        return tirx.Min(tile * SIDE, i64(extent - SIDE)) if extent % SIDE else tile * SIDE

    chunks = _col_chunks(outer_count * row_tiles, col_tiles, cores) if parallel else 1
    if chunks > 1:  # the chunk of column tiles is the innermost part of the task
        per_chunk = col_tiles // chunks
        row_task = task // chunks
        col = start(task % chunks * per_chunk + col_tile, cols)
    else:
        per_chunk, row_task = col_tiles, task
        col = start(col_tile, cols)
    row = start(row_task % row_tiles, rows)
    src_offset, dst_offset = i64(copy.base[0]), i64(copy.base[1])
    rest = row_task // row_tiles
    for extent, src_stride, dst_stride in reversed(copy.outer):  # innermost first
        index = rest % extent
        rest = rest // extent
        src_offset, dst_offset = src_offset + index * src_stride, dst_offset + index * dst_stride
    src_offset = src_offset + row + col * src_col_stride
    dst_offset = dst_offset + row * dst_row_stride + col
    src_bytes, dst_bytes = DataType(src_type).bits // 8, DataType(dst_type).bits // 8

    def pointer(buffer, offset, size):
        first = tirx.address_of(tirx.BufferLoad(buffer, [i64(0)] * len(buffer.shape)))
        return tirx.call_intrin("handle", "tirx.handle_add_byte_offset", first, offset * size)

    call = tirx.call_extern(
        "void",
        function_name(bits, to_bf16),
        pointer(dst, dst_offset, dst_bytes),
        i64(dst_row_stride * dst_bytes),
        pointer(src, src_offset, src_bytes),
        i64(src_col_stride * src_bytes),
    )
    body = tirx.For(col_tile, i64(0), i64(per_chunk), tirx.ForKind.SERIAL, tirx.Evaluate(call))
    kind = tirx.ForKind.PARALLEL if parallel else tirx.ForKind.SERIAL
    annotations = {"pragma_import_llvm": llvm_ir(bits, to_bf16)}
    tasks = outer_count * row_tiles * chunks
    body = tirx.For(task, i64(0), i64(tasks), kind, body, annotations=annotations)

    def whole(buffer):
        return tirx.BufferRegion(buffer, [Range.from_min_extent(0, n) for n in buffer.shape])

    root = s_tir.SBlock([], [whole(src)], [whole(dst)], "root", body)
    return tirx.PrimFunc([src, dst], s_tir.SBlockRealize([], True, root))


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
    "transpose_intrin",
]
