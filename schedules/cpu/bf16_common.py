"""Helpers shared by the bf16 CPU rules: feature gating, dtype checks and pre-processing blocks.

TVM promotes every bf16 buffer allocated inside a kernel to fp32 (``BF16ComputeLegalize``),
so the packed and padded bf16 operands that ``vdpbf16ps`` reads cannot live inside the kernel.
The rules mark the blocks that produce them with :data:`PREPROC`; the pass
``relax.transform.SplitLayoutRewritePreproc`` moves each into its own function whose output is
a bf16 tensor of the Relax program, and ``FoldConstant`` then evaluates the ones that only read
weights at compile time. :func:`tvmamp.schedules.cpu.cpu_schedule_passes` runs both.
"""

from __future__ import annotations

from tvm import DataType, s_tir, tirx
from tvm.s_tir import TensorIntrin
from tvm.s_tir.dlight.analysis import get_root_block
from tvm.s_tir.schedule import SBlockRV
from tvm.script import tirx as T
from tvm.target import Target
from tvm.target.codegen import llvm_cpu_has_features

from . import transpose_intrin as transpose
from .common import param_buffers
from .matmul_analysis import iter_kinds

# The annotation SplitLayoutRewritePreproc looks for.
PREPROC = "meta_schedule.layout_rewrite_preproc"
# Pre-processing of activations, split out only after the weight packing has been folded:
# SplitLayoutRewritePreproc puts all marked blocks of a kernel into one function, which
# FoldConstant could not evaluate if it also read an activation.
PREPROC_ACTIVATION = "tvmamp.preproc_activation"
# A weight-packing block whose loops are (K / 2, J / 32, 32, 2): tensorized with
# PACK_PAIRS_INTRIN after it is split out (SplitLayoutRewritePreproc rejects tensorized blocks).
PACK_PAIRS = "tvmamp.pack_pairs"
# A packing block reading B as [J, K], loops (J / 16, K / 32, 16, 32): tensorized with
# PACK_PAIRS_T_INTRIN after it is split out.
PACK_PAIRS_T = "tvmamp.pack_pairs_t"


def has_avx512bf16(target: Target) -> bool:
    """Return whether the LLVM ``target`` executes ``vdpbf16ps`` (avx512_bf16)."""
    try:
        return bool(llvm_cpu_has_features(["avx512bf16"], target))
    except (RuntimeError, ValueError):  # targets without x86 features
        return False


def has_amx_bf16(target: Target) -> bool:
    """Return whether the LLVM ``target`` has AMX tiles with bf16 (``tdpbf16ps``)."""
    try:
        return bool(llvm_cpu_has_features(["amx-tile", "amx-bf16"], target))
    except (RuntimeError, ValueError):
        return False


# LLVM's models of Intel's avx512_bf16 cores. Their vdpbf16ps does half the FLOPs a cycle of their
# fp32 FMAs: Emerald Rapids ran the C loops of bench_cpu_bf16.py at 83-86 GFLOP/s against
# 172-176 on one core (BENCHMARKS.md, 2026-11-27), where Zen5 runs 558 against 280. ``cooperlake``
# is also the model targets/llvm.host_cpu picks for any Intel avx512_bf16 host whose AMX is off.
HALF_RATE_BF16_DOT_CPUS = frozenset(
    ("cooperlake", "sapphirerapids", "emeraldrapids", "graniterapids", "graniterapids-d")
)


def bf16_dot_at_half_rate(target: Target) -> bool:
    """Return whether the LLVM ``target``'s ``vdpbf16ps`` does half the FLOPs of its fp32 FMAs
    (:data:`HALF_RATE_BF16_DOT_CPUS`), so bf16 widened to fp32 multiplies faster."""
    mcpu = str(target.attrs.get("mcpu", "")) if target.kind.name == "llvm" else ""
    return mcpu in HALF_RATE_BF16_DOT_CPUS and has_avx512bf16(target)


def is_bf16_matmul(block: s_tir.SBlock) -> bool:
    """Return whether ``block`` reads two bf16 buffers and accumulates into fp32."""
    reads = [str(r.source.dtype) for r in block.reads]
    return reads == ["bfloat16", "bfloat16"] and str(block.writes[0].source.dtype) == "float32"


def k_is_innermost(block: s_tir.SBlock, read: int) -> bool:
    """Return whether the last index of ``block.reads[read]`` is a reduction iterator."""
    kinds = iter_kinds(block)
    last = block.reads[read].region[-1].min
    return (
        isinstance(last, tirx.Var)
        and kinds is not None
        and kinds.get(last) is not None
        and last in {iv.var for iv in block.iter_vars if iv.iter_type == tirx.IterVar.CommReduce}
    )


def mark_preproc(sch: s_tir.Schedule, block: SBlockRV, weight: bool = True) -> None:
    """Mark ``block`` to be split into its own pre-processing function.

    ``weight=False`` marks a block that reads activations; it is split out in a second round,
    after the weight packing has been folded (see :func:`.bf16_passes.SplitPreproc`).
    """
    sch.annotate(block, PREPROC if weight else PREPROC_ACTIVATION, True)


def reads_only_params(sch: s_tir.Schedule, block: SBlockRV) -> bool:
    """Return whether every buffer ``block`` reads is a parameter of the function."""
    params = param_buffers(sch)
    return all(any(r.source.same_as(p) for p in params) for r in sch.get(block).reads)


def root_blocks(sch: s_tir.Schedule) -> list[SBlockRV]:
    """Return the blocks directly under the function's root block."""
    return list(sch.get_child_blocks(get_root_block(sch)))


# Two rows of 32 bf16 -> two 16-column panels of pairs: one pair-interleaving step of the weight
# packing, as two 64-byte loads, two shuffles and two 64-byte stores.
PACK_PAIRS_INTRIN = "tvmamp_x86_pack_pairs_2x32"
_PACK_LO = ", ".join(f"i32 {j}, i32 {j + 32}" for j in range(16))
_PACK_HI = ", ".join(f"i32 {j}, i32 {j + 32}" for j in range(16, 32))
PACK_PAIRS_LLVM_IR = f"""
define linkonce_odr void @tvmamp_pack_pairs_2x32(ptr %d, i64 %ldd, ptr %s, i64 %lds) #0 {{
  %s1 = getelementptr i8, ptr %s, i64 %lds
  %d1 = getelementptr i8, ptr %d, i64 %ldd
  %r0 = load <32 x i16>, ptr %s, align 2
  %r1 = load <32 x i16>, ptr %s1, align 2
  %lo = shufflevector <32 x i16> %r0, <32 x i16> %r1, <32 x i32> <{_PACK_LO}>
  %hi = shufflevector <32 x i16> %r0, <32 x i16> %r1, <32 x i32> <{_PACK_HI}>
  store <32 x i16> %lo, ptr %d, align 2
  store <32 x i16> %hi, ptr %d1, align 2
  ret void
}}

attributes #0 = {{ alwaysinline nounwind }}
"""
_CONCAT32 = ", ".join(f"i32 {i}" for i in range(32))


# The same from two rows of 32 fp32, rounded to bf16 on the way (a run-time fp32 weight):
# with vcvtneps2bf16 (``native``, avx512_bf16 targets only), or with integer arithmetic that any
# x86 target runs (a pack that ``FoldConstant`` evaluates at compile time: TVM builds it for
# plain "llvm", where LLVM lowers a native rounding to a ``__truncsfbf2`` call that its JIT
# cannot resolve).
def pack_pairs_f32_llvm_ir(native: bool) -> str:
    """The LLVM IR of ``tvmamp_pack_pairs_2x32_from_f32[_native]``."""
    rounds = [
        transpose.round_to_bf16(name, ptr, native=native)
        for name, ptr in (("a0", "%s"), ("a1", "%s0h"), ("b0", "%s1"), ("b1", "%s1h"))
    ]
    return "\n".join(
        [
            f"define linkonce_odr void @{pack_pairs_name(True, native)}("
            "ptr %d, i64 %ldd, ptr %s, i64 %lds) #0 {",
            "  %s1 = getelementptr i8, ptr %s, i64 %lds",
            "  %d1 = getelementptr i8, ptr %d, i64 %ldd",
            "  %s0h = getelementptr i8, ptr %s, i64 64",
            "  %s1h = getelementptr i8, ptr %s1, i64 64",
            *(line for lines in rounds for line in lines),
            f"  %r0 = shufflevector <16 x i16> %a0, <16 x i16> %a1, <32 x i32> <{_CONCAT32}>",
            f"  %r1 = shufflevector <16 x i16> %b0, <16 x i16> %b1, <32 x i32> <{_CONCAT32}>",
            f"  %lo = shufflevector <32 x i16> %r0, <32 x i16> %r1, <32 x i32> <{_PACK_LO}>",
            f"  %hi = shufflevector <32 x i16> %r0, <32 x i16> %r1, <32 x i32> <{_PACK_HI}>",
            "  store <32 x i16> %lo, ptr %d, align 2",
            "  store <32 x i16> %hi, ptr %d1, align 2",
            "  ret void",
            "}",
            "",
            "attributes #0 = { alwaysinline nounwind }",
            "",
        ]
    )


def pack_pairs_name(from_f32: bool, native: bool) -> str:
    """The LLVM function of the pair-interleaving helper (from bf16, or from fp32 rounded)."""
    return (
        "tvmamp_pack_pairs_2x32"
        + ("_from_f32" if from_f32 else "")
        + ("_native" if from_f32 and native else "")
    )


def _pack_intrin(src: str, function: str, transposed: bool, region: tuple[int, ...] = ()):
    """The (description, implementation) of one packing step of ``B`` read as ``src``.

    Not ``transposed``: two rows of 32 columns of ``B[K, J]`` (``S[2, 32]``) into two packed
    rows of one 16-column panel pair; the helper's destination row stride is ``D``'s first
    stride. ``transposed``: a ``B[J, K]`` tile ``S[16, 32]`` into the 16 pair rows of one
    panel (a 64-byte row stride). An fp32 ``src`` is rounded to bf16 on the way.

    ``region``, if given, is the shape of the tile in a source of more axes: the rows and
    columns above with unit axes between or before them (``(16, 1, 32)``: a head's rows of
    ``qkv[tokens, batch, 3 * heads * dim]``, read through the layout ops the GEMM kernel
    absorbed; see :mod:`tvmamp.relay_passes.gemm_layout`).
    """
    src_bytes = DataType(src).bits // 8
    s_rows, d_shape = (16, (1, 16, 16, 2)) if transposed else (2, (2, 1, 16, 2))
    j_extent, k_extent = (16, 32) if transposed else (32, 2)
    region = region or (s_rows, 32)
    row_axis, last = region.index(s_rows), len(region) - 1
    whole = tuple(slice(0, e) for e in region)

    def at(row, col):  # the source index of element (row, col) of the tile
        return tuple(row if i == row_axis else col if i == last else 0 for i in range(last + 1))

    def strides(row_stride):
        return [row_stride if i == row_axis else T.int64() for i in range(last)] + [1]

    @T.prim_func(s_tir=True)
    def desc(s: T.handle, d: T.handle) -> None:
        S = T.match_buffer(s, region, src, offset_factor=1, strides=strides(T.int64()))
        D = T.match_buffer(d, d_shape, "bfloat16", offset_factor=1, strides=[T.int64(), 32, 2, 1])
        with T.sblock("root"):
            T.reads(S[whole])
            T.writes(D[0 : d_shape[0], 0 : d_shape[1], 0:16, 0:2])
            for j, k in T.grid(j_extent, k_extent):
                with T.sblock("pack"):
                    vj, vk = T.axis.remap("SS", [j, k])
                    D[vj // 16, vk // 2, vj % 16, vk % 2] = (
                        T.Cast("bfloat16", S[at(vj, vk) if transposed else at(vk, vj)])
                        if src != "bfloat16"
                        else (S[at(vj, vk) if transposed else at(vk, vj)])
                    )

    lds = T.int64()

    @T.prim_func(s_tir=True)
    def impl(s: T.handle, d: T.handle) -> None:
        ldd = T.int64()
        S = T.match_buffer(s, region, src, offset_factor=1, strides=strides(lds))
        D = T.match_buffer(d, d_shape, "bfloat16", offset_factor=1, strides=[ldd, 32, 2, 1])
        with T.sblock("root"):
            T.reads(S[whole])
            T.writes(D[0 : d_shape[0], 0 : d_shape[1], 0:16, 0:2])
            T.evaluate(
                T.call_extern(
                    "void",
                    function,
                    T.address_of(D[0, 0, 0, 0]),
                    T.int64(64) if transposed else ldd * 2,
                    T.address_of(S[at(0, 0)]),
                    lds * src_bytes,
                )
            )

    return desc, impl


def pack_pairs_intrin(
    src: str = "bfloat16", native: bool = True, region: tuple[int, ...] = ()
) -> tuple[str, str]:
    """Register (once) the weight-packing intrinsic for 2 rows x 32 columns of ``src`` (bf16,
    or fp32 rounded on the way, with ``vcvtneps2bf16`` when ``native``), in a source tile of
    shape ``region`` if given (see :func:`_pack_intrin`); return its name and the LLVM IR to
    import."""
    from_f32 = src == "float32"
    function = pack_pairs_name(from_f32, native)
    name = PACK_PAIRS_INTRIN + function.removeprefix("tvmamp_pack_pairs_2x32") + _suffix(region)
    if TensorIntrin.get(name, allow_missing=True) is None:
        TensorIntrin.register(name, *_pack_intrin(src, function, False, region))
    return name, pack_pairs_f32_llvm_ir(native) if from_f32 else PACK_PAIRS_LLVM_IR


def _suffix(region: tuple[int, ...]) -> str:
    """The intrinsic-name suffix of a source tile shape of more than two axes."""
    return "_" + "x".join(map(str, region)) if len(region) > 2 else ""


# A 16 x 32 tile of B[J, K] -> one 16-column panel of 16 pairs: a 16 x 16 transpose of the
# 32-bit pairs in registers (:mod:`.transpose_intrin`, 32-bit elements).
PACK_PAIRS_T_INTRIN = "tvmamp_x86_pack_pairs_t_16x32"


def pack_pairs_t_intrin(
    src: str = "bfloat16", native: bool = True, region: tuple[int, ...] = ()
) -> tuple[str, str]:
    """Register (once) the transposing weight-packing intrinsic for a 16 x 32 ``src`` tile
    (bf16, or fp32 rounded on the way, with ``vcvtneps2bf16`` when ``native``), in a source
    tile of shape ``region`` if given; return its name and the LLVM IR to import."""
    from_f32 = src == "float32"
    native = native and from_f32
    function = transpose.function_name(32, from_f32, native=native)
    name = PACK_PAIRS_T_INTRIN + function.removeprefix(transpose.intrin_name(32)) + _suffix(region)
    if TensorIntrin.get(name, allow_missing=True) is None:
        TensorIntrin.register(name, *_pack_intrin(src, function, True, region))
    return name, transpose.llvm_ir(32, to_bf16=from_f32, native=native)
