"""fp16 matmul and dense on F16C CPUs: fp16 weights packed at compile time, fp32 FMA."""

from __future__ import annotations

import math
from dataclasses import dataclass

import tvm
from tvm import s_tir, tirx
from tvm.s_tir.dlight.gpu.matmul import auto_inline_producers
from tvm.s_tir.schedule import SBlockRV, ScheduleError
from tvm.target import Target
from tvm.target.codegen import llvm_cpu_has_features

from ..x86 import f16c_intrin as intrin
from . import prefetch
from .bf16_common import mark_preproc
from .common import (
    CPURule,
    NotApplicable,
    inline_epilogue,
    largest_divisor,
    parallel_with_rows,
    row_block_tiles,
    use_parallel,
    vector_bits,
    vector_lanes,
    vectorize_tile,
    vectorize_whole_or_leave,
)
from .matmul_analysis import find_matmul_block, normalize


def has_f16c(target: Target) -> bool:
    """Return whether the LLVM ``target`` converts fp16 vectors (F16C) and has FMA."""
    try:
        return bool(llvm_cpu_has_features(["f16c", "fma"], target))
    except (RuntimeError, ValueError):  # targets without x86 features
        return False


def is_fp16_matmul(block: s_tir.SBlock) -> bool:
    """Return whether ``block`` reads two fp16 buffers and accumulates into fp32."""
    reads = [str(r.source.dtype) for r in block.reads]
    return reads == ["float16", "float16"] and str(block.writes[0].source.dtype) == "float32"


def _fp16_gemm(sch: s_tir.Schedule) -> SBlockRV | None:
    """The fp16 x fp16 -> fp32 matmul block of ``sch``, or None."""
    main = find_matmul_block(sch)
    return main if main is not None and is_fp16_matmul(sch.get(main)) else None


class CPUMatmulFP16(CPURule):
    """``C[I, J] += A[I, K] * B[J, K]`` with fp16 ``A``, ``B`` and fp32 ``C``, on F16C CPUs.

    ``B`` (a 2-D weight: no batch axis) is packed to ``[J / tile_j, K, tile_j]`` fp16 panels
    by a pre-processing function that ``SplitPreproc`` splits out and ``FoldConstant`` runs at
    compile time, so the kernel streams each panel contiguously: fp16 vector loads widened
    with ``vcvtph2ps`` (the intrinsic of :mod:`tvmamp.schedules.x86.f16c_intrin`) and fp32
    FMAs into a ``tile_i x tile_j`` register tile. ``A`` is widened once per call into an fp32
    copy, so the FMAs broadcast fp32 values. The fused epilogue runs on the finished tile. Few
    rows (GEMV, memory-bound) get a wide tile over all the rows, which reads the weight once. A
    batched ``B`` (attention's activations) is left to the generic rule. Static shapes only.
    """

    @dataclass
    class Config:
        """Tile sizes.

        Attributes
        ----------
        tile_i : int
            Rows of the register tile (unrolled) for many rows.
        vectors_j : int
            Columns of the register tile, in fp32 SIMD vectors, for many rows.
        gemv_rows : int
            At most this many rows are one tile (no row padding): the weight streams once.
        gemv_accumulators : int
            Register budget of the GEMV tile: ``rows x vectors`` at most this many vectors.
        gemv_vectors_j : int
            Most columns of the GEMV tile, in fp32 SIMD vectors.
        unroll_k : int
            Upper bound of the unrolled inner reduction step.
        """

        tile_i: int = 8
        vectors_j: int = 2
        gemv_rows: int = 4
        gemv_accumulators: int = 16
        gemv_vectors_j: int = 8
        unroll_k: int = 4

    # Keyed by SIMD width in bits: 32 zmm registers hold 8x2 accumulators, 16 ymm hold 6x2.
    CONFIGS = {512: Config(), 256: Config(tile_i=6, gemv_accumulators=8)}

    # The generic rule schedules what this rule gives up on.
    DOES_NOT_FIT = (ScheduleError, tvm.error.InternalError)

    def __init__(self, config: Config | None = None):
        self.config = config

    def get_config(self, target: Target) -> Config:
        """Return the configuration given at construction, else the one for ``target``."""
        return self.config or self.CONFIGS.get(vector_bits(target), self.CONFIGS[256])

    def is_target_available(self, target: Target) -> bool:
        """Return whether ``target`` is an LLVM target with F16C and FMA."""
        return super().is_target_available(target) and has_f16c(target)

    def apply(  # pylint: disable=missing-function-docstring
        self, func: tirx.PrimFunc, target: Target, _: bool
    ) -> s_tir.Schedule | None:
        return self.schedule_block(
            func,
            target,
            _fp16_gemm,
            lambda sch, main: schedule_matmul(sch, main, target, self.get_config(target)),
        )


@dataclass
class Plan:
    """Tile sizes of one normalised fp16 matmul ``[S, I, J, K]``."""

    extents: list[int]
    tile_i: int
    tile_j: int
    unroll_k: int

    @property
    def padding(self) -> list[int]:
        """The ``pad_einsum`` factors: whole row tiles and whole column tiles."""
        return [1, self.tile_i, self.tile_j, 1]

    @property
    def needs_padding(self) -> bool:
        return any(e % p for e, p in zip(self.extents, self.padding, strict=True))


def make_plan(extents: list[int], lanes: int, config: CPUMatmulFP16.Config) -> Plan:
    """Choose the register tile for ``extents = [S, I, J, K]`` and ``lanes`` fp32 per vector."""
    rows = extents[1]
    gemv = rows <= config.gemv_rows
    if gemv:
        budget = max(1, min(config.gemv_vectors_j, config.gemv_accumulators // rows))
        vectors = 1 << (budget.bit_length() - 1)  # a power of two: no padding of J = 2^n
    else:
        vectors = config.vectors_j
    while vectors > 1 and lanes * (vectors // 2) >= extents[2]:
        vectors //= 2
    return Plan(
        extents=extents,
        tile_i=rows if gemv else min(config.tile_i, rows),
        tile_j=lanes * vectors,
        unroll_k=largest_divisor(extents[3], config.unroll_k),
    )


def schedule_matmul(
    sch: s_tir.Schedule, main: SBlockRV, target: Target, config: CPUMatmulFP16.Config
) -> None:
    """Pack ``B``, pad, tile and vectorise the fp16 gemm block ``main`` in place."""
    normalize(sch, main)
    extents = [int(iv.dom.extent) for iv in sch.get(main).iter_vars]
    if extents[0] != 1:
        raise NotApplicable(f"a batched weight (batch {extents[0]}) is an activation")
    lanes = vector_lanes(target, "float32")
    plan = make_plan(extents, lanes, config)
    _prepare(sch, main, plan, target)
    packed = sch.get(main).reads[1].source
    outer, row_tile, k_outer, j_lane = _tile(sch, main, plan, lanes)
    acc = sch.cache_write(main, 0, "local")
    sch.reverse_compute_at(acc, row_tile, preserve_unit_loops=True)
    inline_epilogue(sch, acc)
    vectorize_tile(sch, acc)
    parallel = parallel_with_rows(sch, target, outer, row_tile, math.prod(plan.extents))
    if parallel is not None:
        sch.parallel(parallel)
    init = sch.decompose_reduction(main, k_outer)
    vectorize_tile(sch, init)
    sch.tensorize(j_lane, intrin.register(lanes))
    (update,) = sch.get_child_blocks(k_outer)
    prefetch.mark(sch, update, packed, axis=1, ahead=1)  # the next panel: see .prefetch


def _prepare(sch: s_tir.Schedule, main: SBlockRV, plan: Plan, target: Target) -> None:
    """Pad ``main`` to whole tiles, widen ``A`` to an fp32 copy and pack ``B`` into panels."""
    if plan.needs_padding:
        sch.pad_einsum(main, plan.padding)
    reindex_a, reindex_b = sch.get_producers(main)
    auto_inline_producers(sch, reindex_a)
    auto_inline_producers(sch, reindex_b)
    if sch.get_producers(reindex_b):
        raise NotApplicable("the weight is computed inside the kernel")
    _widen_rows(sch, reindex_a, target)
    _pack_panels(sch, reindex_b, plan.tile_j)


def _widen_rows(sch: s_tir.Schedule, copy: SBlockRV, target: Target) -> None:
    """Turn the (padded) copy of ``A[S, I, K]`` into one fp32 copy, vectorised along ``K``.

    The row tile then broadcasts fp32 values straight into its FMAs instead of converting
    ``tile_i`` scalars at every ``k`` step. The reads become ``f32(f16(copy))``, exact since
    every value came from fp16; the intrinsic of :mod:`tvmamp.schedules.x86.f16c_intrin` drops
    the round trip.
    """
    sch.unsafe_set_dtype(copy, 0, "float32")
    *rows, inner = sch.get_loops(copy)
    lanes = vector_lanes(target, "float32")
    extent = int(sch.get(inner).extent)
    work = extent * math.prod(int(sch.get(loop).extent) for loop in rows)
    if extent % lanes == 0:
        sch.vectorize(sch.split(inner, [None, lanes])[-1])
    else:  # one vector, or LLVM's loop for a long ragged K (see common.MAX_WHOLE_VECTOR)
        vectorize_whole_or_leave(sch, inner, lanes)
    if use_parallel(target, work):
        sch.parallel(sch.fuse(*rows))


def _pack_panels(sch: s_tir.Schedule, pack: SBlockRV, tile_j: int) -> None:
    """Lay ``B[S, J, K]`` out as ``[S, J / tile_j, K, tile_j]`` in a pre-processing block."""
    sch.transform_layout(pack, ("write", 0), lambda s, j, k: (s, j // tile_j, k, j % tile_j))
    j, k = sch.get_loops(pack)[-2:]  # a unit S loop may be absent
    j_outer, j_inner = sch.split(j, [None, tile_j])
    sch.reorder(j_outer, k, j_inner)
    sch.vectorize(j_inner)
    mark_preproc(sch, pack)


def _tile(sch: s_tir.Schedule, main: SBlockRV, plan: Plan, lanes: int) -> tuple:
    """Order the loops ``(S * J / tj, I / ti, K / uk, uk, ti, tj / lanes, lanes)``; a widened
    ``A`` larger than :data:`.common.A_BLOCK_BYTES` adds a serial loop over blocks of row tiles
    outermost (:func:`.common.row_block_tiles`).

    Returns the fused outer loop, the row-tile loop, the outer reduction loop and the lane
    loop that the intrinsic replaces.
    """
    s, i, j, k = sch.get_loops(main)
    i_outer, i_inner = sch.split(i, [None, plan.tile_i])
    j_outer, j_vec, j_lane = sch.split(j, [None, plan.tile_j // lanes, lanes])
    k_outer, k_inner = sch.split(k, [None, plan.unroll_k])
    tiles = row_block_tiles(plan.extents, plan.tile_i, 4)  # A is widened to fp32
    if tiles is None:
        sch.reorder(s, j_outer, i_outer, k_outer, k_inner, i_inner, j_vec, j_lane)
    else:
        i_block, i_outer = sch.split(i_outer, [None, tiles])
        sch.reorder(i_block, s, j_outer, i_outer, k_outer, k_inner, i_inner, j_vec, j_lane)
    for loop in (k_inner, i_inner, j_vec):
        sch.unroll(loop)
    return sch.fuse(s, j_outer), i_outer, k_outer, j_lane


__all__ = ["CPUMatmulFP16", "has_f16c", "make_plan", "schedule_matmul"]
