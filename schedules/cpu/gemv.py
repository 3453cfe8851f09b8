"""fp32 GEMV and small-batch GEMM on a weight packed at compile time into streamed panels.

A Linear at batch 1 to 8 reads every weight value once per call and does a handful of FMAs
with it: it is bound by memory bandwidth, so what matters is that the weight streams
contiguously. Read in its ``[K, N]`` layout, one column block per outer iteration walks ``K``
rows ``N`` floats apart (a strided access the prefetchers serve badly); read as ``[N, K]`` it
needs a horizontal reduction per output. Here the weight is packed into ``[N / tile_j, K,
tile_j]`` panels by a pre-processing block that :class:`.bf16_passes.SplitPreproc` splits out
and ``FoldConstant`` evaluates at compile time, so each panel is one contiguous stream: at each
``k`` step every row of the activation is broadcast into ``tile_j / lanes`` FMAs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tvm import s_tir, tirx
from tvm.s_tir.dlight.analysis import get_root_block
from tvm.s_tir.dlight.gpu.matmul import IterKind, auto_inline_producers
from tvm.s_tir.schedule import SBlockRV
from tvm.target import Target

from .bf16_common import mark_preproc, reads_only_params
from .common import (
    CPURule,
    NotApplicable,
    inline_epilogue,
    largest_divisor,
    num_cores,
    param_buffers,
    tile_fma_gemm,
    use_parallel,
    vector_bits,
    vector_lanes,
    vectorize_tile,
)
from .matmul_analysis import b_is_k_contiguous, find_matmul_block, iter_kinds, normalize


@dataclass
class GemvConfig:
    """Register tile of the GEMV schedule.

    Attributes
    ----------
    max_rows : int
        At most this many rows (the product of the ``I`` extents) use the GEMV schedule; all of
        them form one register tile, so the weight streams once per call.
    accumulators : int
        Register budget: ``rows x vectors`` accumulators at most.
    max_vectors_j : int
        Most columns of the tile, in SIMD vectors of fp32.
    unroll_k : int
        Upper bound of the unrolled reduction step.
    parallel_min_weight : int
        Fewest weight values for which the column panels run in parallel (with ``num-cores``
        above 1): a smaller weight streams from cache in about the time a parallel launch
        costs.
    """

    max_rows: int = 8
    accumulators: int = 24
    max_vectors_j: int = 8
    unroll_k: int = 4
    parallel_min_weight: int = 1 << 18


# Reduction values per block of the packing copy of a dense ``[N, K]`` weight (one cache line).
DENSE_K_BLOCK = 16

# A wider tile may pad the columns by at most this share more than one vector's tile would.
MAX_PAD_SHARE = 0.125

# Keyed by SIMD width in bits: 32 zmm registers hold up to 24 accumulators, 16 ymm 12.
GEMV_CONFIGS = {512: GemvConfig(), 256: GemvConfig(accumulators=12), 128: GemvConfig()}


def gemv_config(target: Target) -> GemvConfig:
    """Return the GEMV tile configuration for ``target``."""
    return GEMV_CONFIGS[vector_bits(target)]


def _extent(block: s_tir.SBlock, kinds: dict, kind) -> int:
    """The product of the static extents of ``block``'s iterators of role ``kind``."""
    extents = [iv.dom.extent for iv in block.iter_vars if kinds[iv.var] == kind]
    if not all(isinstance(e, tirx.IntImm) for e in extents):
        return -1
    return math.prod(int(e) for e in extents)


def find_gemv_block(sch: s_tir.Schedule, config: GemvConfig) -> SBlockRV | None:
    """Return the fp32 gemm block of ``sch`` if it is a GEMV or small-batch GEMM, else None.

    It must read fp32 ``A`` and ``B`` into an fp32 ``C``, have at most ``config.max_rows`` rows,
    no batch axis, and read its weight ``B`` straight from a function parameter (the weight the
    packing can fold at compile time).
    """
    main = find_matmul_block(sch)
    if main is None:
        return None
    block = sch.get(main)
    dtypes = [str(r.source.dtype) for r in block.reads] + [str(block.writes[0].source.dtype)]
    if dtypes != ["float32"] * 3:
        return None
    kinds = iter_kinds(block)
    batch, rows = (_extent(block, kinds, kind) for kind in (IterKind.kIter_S, IterKind.kIter_I))
    if batch != 1 or not 1 <= rows <= config.max_rows:
        return None
    if not any(block.reads[1].source.same_as(p) for p in param_buffers(sch)):
        return None
    return main


@dataclass
class GemvPlan:
    """Tile sizes of one normalised GEMV ``[S, I, J, K]``: all ``I`` rows in one tile."""

    extents: list[int]
    tile_j: int
    unroll_k: int

    @property
    def padding(self) -> list[int]:
        """The ``pad_einsum`` factors: whole column tiles."""
        return [1, 1, self.tile_j, 1]


def make_gemv_plan(extents: list[int], lanes: int, config: GemvConfig, cores: int = 1) -> GemvPlan:
    """Choose the tile for ``extents = [S, I, J, K]`` with ``lanes`` fp32 per vector.

    The widest power-of-two number of vectors that the register budget allows for ``I`` rows
    and whose padding of ``J`` stays within :data:`MAX_PAD_SHARE` of the narrowest tile's,
    narrowed further until the column panels (the parallel tasks) are at least ``cores``: a
    1000-class head has 8 panels of 128 columns, 16 of 64.
    """
    rows, cols = extents[1], extents[2]
    budget = max(1, min(config.max_vectors_j, config.accumulators // rows))
    vectors = 1 << (budget.bit_length() - 1)
    narrowest = -(-cols // lanes) * lanes
    while vectors > 1 and -(-cols // (lanes * vectors)) * lanes * vectors > narrowest * (
        1 + MAX_PAD_SHARE
    ):
        vectors //= 2
    while vectors > 1 and -(-cols // (lanes * vectors)) < cores:
        vectors //= 2
    return GemvPlan(
        extents=extents,
        tile_j=lanes * vectors,
        unroll_k=largest_divisor(extents[3], config.unroll_k),
    )


def schedule_gemv(sch: s_tir.Schedule, main: SBlockRV, target: Target, config: GemvConfig) -> None:
    """Pack the weight, tile, vectorise and parallelise the GEMV block ``main`` in place.

    Loops: ``(J / tile_j) [parallel], K / uk, uk [unrolled], I [unrolled], tile_j [vector]``;
    the ``I x tile_j`` accumulator tile is a ``local`` buffer (registers), initialised and
    finished with the fused epilogue once per column block.
    """
    dense = b_is_k_contiguous(sch.get(main))
    normalize(sch, main)
    extents = [int(iv.dom.extent) for iv in sch.get(main).iter_vars]
    weight = extents[2] * extents[3]
    parallel = weight >= config.parallel_min_weight and use_parallel(target, math.prod(extents))
    cores = num_cores(target) if parallel else 1
    plan = make_gemv_plan(extents, vector_lanes(target, "float32"), config, cores)
    _prepare(sch, main, plan, dense)
    # one tile of all the rows
    outer, rows, k_outer = tile_fma_gemm(sch, main, plan.extents[1], plan.tile_j, plan.unroll_k)
    acc = sch.cache_write(main, 0, "local")
    sch.reverse_compute_at(acc, rows, preserve_unit_loops=True)
    inline_epilogue(sch, acc)
    vectorize_tile(sch, acc)
    if parallel:
        sch.parallel(outer)  # before decompose_reduction, which breaks the check
    init = sch.decompose_reduction(main, k_outer)
    vectorize_tile(sch, init)


def _prepare(sch: s_tir.Schedule, main: SBlockRV, plan: GemvPlan, dense: bool) -> None:
    """Pad ``J`` to whole tiles, read ``A`` in place and pack the weight ``B`` into panels."""
    if plan.extents[2] % plan.tile_j:
        sch.pad_einsum(main, plan.padding)
    reindex_a, reindex_b = sch.get_producers(main)
    auto_inline_producers(sch, reindex_a)
    auto_inline_producers(sch, reindex_b)
    if not reads_only_params(sch, reindex_b):
        raise NotApplicable("the weight is computed inside the kernel")
    sch.compute_inline(reindex_a)
    _pack_panels(sch, reindex_b, plan.tile_j, dense)


def _pack_panels(sch: s_tir.Schedule, pack: SBlockRV, tile_j: int, dense: bool) -> None:
    """Lay ``B[S, J, K]`` out as ``[S, J / tile_j, K, tile_j]`` in a pre-processing block.

    ``SplitPreproc`` moves the block into its own function, folded at compile time for a
    constant weight (at run time, once per call, otherwise). A ``[K, N]`` source is copied row
    by row with vector loads; a ``dense`` ``[N, K]`` one in ``tile_j x`` :data:`DENSE_K_BLOCK`
    blocks, so that both sides stay in cache.
    """
    sch.transform_layout(pack, ("write", 0), lambda s, j, k: (s, j // tile_j, k, j % tile_j))
    j, k = sch.get_loops(pack)[-2:]  # a unit S loop may be absent
    j_outer, j_inner = sch.split(j, [None, tile_j])
    k_block = largest_divisor(int(sch.get(k).extent), DENSE_K_BLOCK)
    if dense and k_block > 1:
        k_outer, k_inner = sch.split(k, [None, k_block])
        sch.reorder(j_outer, k_outer, j_inner, k_inner)
        sch.unroll(k_inner)
    else:
        sch.reorder(j_outer, k, j_inner)
        sch.vectorize(j_inner)
    mark_preproc(sch, pack)


__all__ = [
    "GEMV_CONFIGS",
    "GemvConfig",
    "GemvPlan",
    "TVMGemvWithEpilogue",
    "find_gemv_block",
    "gemv_config",
    "make_gemv_plan",
    "schedule_gemv",
]


class TVMGemvWithEpilogue(CPURule):
    """TVM's ``dlight.cpu.GEMV``, then the root blocks it leaves as they are, vectorised and in
    parallel.

    A squeeze-and-excitation gate (``x * sigmoid(conv1x1(pooled))``, EfficientNet and
    MobileNetV3 at O0) fuses into one kernel whose GEMV TVM's rule schedules, while the
    broadcast multiply over the whole feature map (160 x 40 x 40) stayed a serial, scalar
    loop nest.
    """

    def __init__(self):
        from tvm.s_tir import dlight as dl  # pylint: disable=import-outside-toplevel

        self.rule = dl.cpu.GEMV()

    def apply(  # pylint: disable=missing-function-docstring
        self, func: tirx.PrimFunc, target: Target, tunable: bool
    ) -> s_tir.Schedule | None:
        sch = self.rule.apply(func, target, tunable)
        if not isinstance(sch, s_tir.Schedule):
            return sch
        for block in sch.get_child_blocks(get_root_block(sch)):
            if _left_alone(sch, block):
                _schedule_epilogue(sch, block, target)
        return sch


def _schedule_epilogue(sch: s_tir.Schedule, block: SBlockRV, target: Target) -> None:
    """The outermost loop in parallel, the others fused and vectorised.

    The outer loop is kept apart: what the GEMV computed per channel (the gate's sigmoid)
    stays invariant in the inner loops, where LLVM hoists it; fused with them, it was
    recomputed for every element (0.26 against 0.19 ms for a 160 x 40 x 40 gate).
    """
    stmt = sch.get(block)
    loops = sch.get_loops(block)
    elements = math.prod(int(iv.dom.extent) for iv in stmt.iter_vars)
    lanes = vector_lanes(target, str(stmt.writes[0].source.dtype))
    outer, inner = loops[0], (sch.fuse(*loops[1:]) if len(loops) > 1 else None)
    if inner is not None:
        extent = int(sch.get(inner).extent)
        width = largest_divisor(extent, lanes)
        if width > 1:
            sch.vectorize(sch.split(inner, [None, width])[-1])
    if use_parallel(target, elements) and int(sch.get(outer).extent) > 1:
        sch.parallel(outer)


def _left_alone(sch: s_tir.Schedule, block: SBlockRV) -> bool:
    """A spatial root block with static extents whose loops are all plain serial loops."""
    stmt = sch.get(block)
    loops = sch.get_loops(block)
    spatial = all(iv.iter_type == tirx.IterVar.DataPar for iv in stmt.iter_vars)
    static = all(isinstance(iv.dom.extent, tirx.IntImm) for iv in stmt.iter_vars)
    plain = all(
        sch.get(loop).kind == tirx.ForKind.SERIAL and not sch.get(loop).annotations
        for loop in loops
    )
    return bool(loops) and spatial and static and plain and len(stmt.writes) == 1
