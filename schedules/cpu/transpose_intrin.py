"""A 16 x 16 transposing copy in registers: 16 row loads, 64 two-register shuffles, 16 stores.

A transposing copy vectorised by TVM stores each row of its tile from 16 strided element
loads (a gather), 17-28 GB/s here for bf16. This helper loads the 16 source rows of a tile
whole, transposes them with the block-swap network (stage ``b`` = 8, 4, 2, 1 swaps the
``b x b`` blocks off the diagonal of every ``2b x 2b`` block: one ``shufflevector`` of two
rows per output row), and stores 16 whole rows. It is LLVM IR text, inlined into the kernel
(``pragma_import_llvm``) and called through a tensor intrinsic; LLVM picks the target's
shuffles (``vpermt2w``/``vpermt2d`` with AVX-512). Elements of 16 and 32 bits.
"""

from __future__ import annotations

from tvm import DataType
from tvm.s_tir import TensorIntrin
from tvm.script import tirx as T

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


__all__ = [
    "BITS",
    "SIDE",
    "intrin_name",
    "llvm_ir",
    "planes_intrin",
    "rows_intrin",
    "transpose_intrin",
]
