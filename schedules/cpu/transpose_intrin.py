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


def _masks(block: int) -> tuple[str, str]:
    """The shuffle masks of rows ``i`` and ``i + block`` of one block-swap stage."""
    low = [c if c & block == 0 else SIDE + c - block for c in range(SIDE)]
    high = [c + block if c & block == 0 else SIDE + c for c in range(SIDE)]
    return tuple(", ".join(f"i32 {m}" for m in mask) for mask in (low, high))


def llvm_ir(bits: int, to_bf16: bool = False) -> str:
    """The LLVM IR of ``void f(ptr dst, i64 dst_row_bytes, ptr src, i64 src_row_bytes)``.

    ``to_bf16``: the source rows are fp32 and are rounded to bf16 (to nearest even, NaN kept
    quiet, as TVM's own cast) before the 16-bit transpose.
    """
    vec = f"<{SIDE} x i{bits}>"
    name = intrin_name(bits) + ("_from_f32" if to_bf16 else "")
    lines = [f"define linkonce_odr void @{name}(ptr %d, i64 %ldd, ptr %s, i64 %lds) #0 {{"]
    for i in range(SIDE):
        lines.append(f"  %so{i} = mul i64 %lds, {i}")
        lines.append(f"  %sp{i} = getelementptr i8, ptr %s, i64 %so{i}")
        if to_bf16:
            lines += _round_to_bf16(i)
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


def _round_to_bf16(i: int) -> list[str]:
    """Load fp32 row ``i`` and round it to bf16 bits ``%r0_{i}``: ``(x + 0x7fff + lsb) >> 16``.

    NaN becomes the quiet NaN of its sign (the rounding could carry it to infinity).
    """
    v32, v16 = f"<{SIDE} x i32>", f"<{SIDE} x i16>"
    splat = lambda value: f"splat (i32 {value})"  # noqa: E731
    return [
        f"  %x{i} = load volatile {v32}, ptr %sp{i}, align 1",
        f"  %lsb{i} = lshr {v32} %x{i}, {splat(16)}",
        f"  %one{i} = and {v32} %lsb{i}, {splat(1)}",
        f"  %bias{i} = add {v32} %one{i}, {splat(0x7FFF)}",
        f"  %sum{i} = add {v32} %x{i}, %bias{i}",
        f"  %hi{i} = lshr {v32} %sum{i}, {splat(16)}",
        f"  %abs{i} = and {v32} %x{i}, {splat(0x7FFFFFFF)}",
        f"  %nan{i} = icmp ugt {v32} %abs{i}, {splat(0x7F800000)}",
        f"  %quiet{i} = or {v32} %lsb{i}, {splat(0x40)}",
        f"  %pick{i} = select <{SIDE} x i1> %nan{i}, {v32} %quiet{i}, {v32} %hi{i}",
        f"  %r0_{i} = trunc {v32} %pick{i} to {v16}",
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
    function = intrin_name(bits) + ("_from_f32" if to_bf16 else "")
    name = f"{function}_{src}_{dst}"
    if TensorIntrin.get(name, allow_missing=True) is None:
        TensorIntrin.register(name, *_make(src, dst, function))
    return name, llvm_ir(bits, to_bf16)


__all__ = ["BITS", "SIDE", "intrin_name", "llvm_ir", "transpose_intrin"]
