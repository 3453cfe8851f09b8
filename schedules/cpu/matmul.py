"""Default CPU schedule for matmul, dense and batch-matmul with fused prologues and epilogues."""

from __future__ import annotations

import math
from dataclasses import dataclass

import tvm
from tvm import s_tir, tirx
from tvm.s_tir.dlight.gpu.matmul import auto_inline_producers
from tvm.s_tir.schedule import LoopRV, SBlockRV
from tvm.target import Target

from . import bounds
from .bf16_common import mark_preproc, reads_only_params, root_blocks
from .common import (
    CPURule,
    all_static,
    divisible,
    inline_epilogue,
    largest_divisor,
    logger,
    nominal,
    parallel_with_rows,
    schedule_injective,
    static_extent,
    tile_fma_gemm,
    use_parallel,
    vector_bits,
    vector_lanes,
    vectorize_tile,
)
from .gemv import GemvConfig, find_gemv_block, gemv_config, schedule_gemv
from .matmul_analysis import b_is_k_contiguous, find_matmul_block, normalize
from .reduction import place_partials, rfactor_lanes


class CPUMatmul(CPURule):
    """Register-tiled matmul, normalised to ``C[S, I, J] += A[S, I, K] * B[S, J, K]``.

    ``I`` and ``J`` are padded to whole tiles; ``B`` is packed into ``[S, J / tile_j, K,
    tile_j]`` panels, one panel per outer ``J`` iteration so that it stays in L2; each
    ``tile_i x tile_j`` accumulator lives in a ``local`` buffer that LLVM keeps in vector
    registers; the fused epilogue runs on the finished tile. Any extent may be symbolic (an
    attention's matmuls over a dynamic batch and sequence length): the padded copy of ``A`` and
    the packed panels of ``B`` are buffers of the kernel, padded to whole tiles there, so no
    extent needs to be known at compile time. A symbolic ``K`` is not unrolled.

    An fp32 GEMV or small-batch GEMM (few rows, a 2-D weight read from a parameter) gets the
    schedule of :mod:`.gemv` instead: its weight is packed at compile time into panels that
    stream contiguously. ``gemv=False`` turns that off; ``gemv_config`` replaces the
    per-target :data:`.gemv.GEMV_CONFIGS`.
    """

    @dataclass
    class Config:
        """Per-target tile sizes.

        Attributes
        ----------
        tile_i : int
            Rows of the register tile (unrolled).
        vectors_j : int
            Columns of the register tile, in SIMD vectors of the accumulator dtype.
        unroll_k : int
            Upper bound of the unrolled inner reduction step.
        pack_min_rows : int
            Pack a ``[K, N]`` weight only when ``I`` has at least this many rows; a dense
            ``[N, K]`` weight is always packed, since unpacked it needs gathers.
        """

        tile_i: int = 8
        vectors_j: int = 2
        unroll_k: int = 4
        pack_min_rows: int = 16

    # Keyed by SIMD width in bits: 32 zmm registers hold 8x2 accumulators, 16 ymm hold 6x2.
    CONFIGS = {512: Config(), 256: Config(tile_i=6), 128: Config()}

    def __init__(self, gemv: bool = True, gemv_config: GemvConfig | None = None):
        self.gemv = gemv
        self.gemv_config = gemv_config

    def takes_shapes(self, sch: s_tir.Schedule) -> bool:
        """Any shapes: a symbolic extent is padded to whole tiles in the kernel."""
        return True

    def get_config(self, target: Target) -> Config:
        """Return the tile configuration for ``target``."""
        return self.CONFIGS[vector_bits(target)]

    def get_gemv_config(self, target: Target) -> GemvConfig | None:
        """Return the GEMV configuration for ``target``, or None when GEMV is off."""
        if not self.gemv:
            return None
        return self.gemv_config or gemv_config(target)

    def apply(  # pylint: disable=missing-function-docstring
        self, func: tirx.PrimFunc, target: Target, _: bool
    ) -> s_tir.Schedule | None:
        sch = self._apply_gemv(func, target)
        if sch is not None:
            return sch
        return self.schedule_block(
            func,
            target,
            find_matmul_block,
            lambda sch, main: _schedule(sch, main, target, self.get_config(target)),
        )

    def _apply_gemv(self, func: tirx.PrimFunc, target: Target) -> s_tir.Schedule | None:
        """The GEMV schedule of ``func``, or None (then the register tiles below apply)."""
        gemv = self.get_gemv_config(target)
        if gemv is None or not isinstance(func, tirx.PrimFunc):
            return None
        if not all_static(s_tir.Schedule(func)):  # GEMV plans need static shapes
            return None
        try:
            return self.schedule_block(
                func,
                target,
                lambda sch: find_gemv_block(sch, gemv),
                lambda sch, main: schedule_gemv(sch, main, target, gemv),
            )
        except (tvm.error.InternalError, ValueError) as err:
            logger.info("CPUMatmul: the GEMV schedule failed, using the tiles: %s", err)
            return None


@dataclass
class _Plan:
    """Tile sizes and packing decisions for one normalised matmul."""

    extents: list  # [S, I, J, K]: ints, or PrimExprs where symbolic
    tile_i: int
    tile_j: int
    unroll_k: int
    pack_b: bool

    @property
    def pad_i(self) -> bool:
        return not divisible(self.extents[1], self.tile_i)

    @property
    def pad_j(self) -> bool:
        return not divisible(self.extents[2], self.tile_j)

    @property
    def symbolic(self) -> bool:
        return not all(isinstance(e, int) for e in self.extents)

    @property
    def work(self) -> int:
        """Multiply-adds, a symbolic extent counted as :data:`.common.NOMINAL_EXTENT`."""
        return math.prod(nominal(e) for e in self.extents)


def _make_plan(
    sch: s_tir.Schedule, main: SBlockRV, target: Target, config: CPUMatmul.Config, dense: bool
) -> _Plan:
    """Choose the tiles for the normalised block ``main``; a symbolic extent counts as
    :data:`.common.NOMINAL_EXTENT` (many rows, columns and reduction values)."""
    block = sch.get(main)
    acc_dtype = str(block.writes[0].source.dtype)
    lanes = vector_lanes(target, acc_dtype)
    extents = [static_extent(iv.dom.extent) for iv in block.iter_vars]
    extents = [e if e is not None else iv.dom.extent for e, iv in zip(extents, block.iter_vars)]
    _, rows, cols, depth = (nominal(e) for e in extents)
    tile_j = lanes * config.vectors_j
    while tile_j > lanes and tile_j // 2 >= cols:
        tile_j //= 2
    return _Plan(
        extents=extents,
        tile_i=min(config.tile_i, rows),
        tile_j=tile_j,
        unroll_k=largest_divisor(depth, config.unroll_k) if isinstance(extents[3], int) else 1,
        pack_b=dense or (rows >= config.pack_min_rows and not _in_place(block, extents, tile_j)),
    )


def _in_place(block: s_tir.SBlock, extents: list, tile_j: int) -> bool:
    """Whether an fp32 ``[K, J]`` ``B`` is read in place over symbolic rows: ``J`` is static,
    at most two column tiles and needs no padding, so each row of ``B`` is one or two tiles'
    width already (attention's ``probs @ v`` over a run-time number of keys, ``v`` of 64
    columns). Packed in the kernel on every call, its panels cost a copy of ``B`` with a bounds
    check per element. A bf16 ``B`` keeps the panels, which TVM stores as fp32: read in place,
    every multiply would widen it again, on the FMA ports of Intel cores."""
    _, rows, cols, _ = extents
    return (
        str(block.reads[1].source.dtype) == "float32"
        and not isinstance(rows, int)
        and isinstance(cols, int)
        and cols % tile_j == 0
        and cols <= 2 * tile_j
    )


def _schedule(
    sch: s_tir.Schedule, main: SBlockRV, target: Target, config: CPUMatmul.Config
) -> None:
    """Tile, pack, vectorise and parallelise the gemm-like block ``main`` in place."""
    dense = b_is_k_contiguous(sch.get(main))
    reindex_a, reindex_b = normalize(sch, main)
    if dense and _dots(sch.get(main), vector_lanes(target, "float32")):
        _schedule_dots(sch, main, reindex_a, reindex_b, target)
        return
    plan = _make_plan(sch, main, target, config, dense)
    if plan.pad_i or plan.pad_j:
        sch.pad_einsum(main, [1, plan.tile_i, plan.tile_j, 1])
        reindex_a, reindex_b = sch.get_producers(main)
    auto_inline_producers(sch, reindex_a)
    auto_inline_producers(sch, reindex_b)
    widen_a = _widens_a(sch.get(main))
    if not plan.pad_i and not widen_a:
        sch.compute_inline(reindex_a)
    else:  # the padded or widened copy of A is a root block: vectorised, parallel when large
        if widen_a:
            sch.unsafe_set_dtype(reindex_a, 0, "float32")
        work = math.prod(nominal(sch.get(loop).extent) for loop in sch.get_loops(reindex_a))
        schedule_injective(sch, reindex_a, vector_lanes(target), use_parallel(target, work))
    if not plan.pack_b:
        sch.compute_inline(reindex_b)

    fuse = not _checks_last_tiles(target, plan)
    outer, i_outer, k_outer = tile_fma_gemm(
        sch, main, plan.tile_i, plan.tile_j, plan.unroll_k, fuse_outer=fuse
    )
    acc = sch.cache_write(main, 0, "local")
    sch.reverse_compute_at(acc, i_outer, preserve_unit_loops=True)
    if not fuse:  # the padded tile's store: only the last column tile needs its bounds check
        bounds.mark(sch, acc)
    inline_epilogue(sch, acc)
    vectorize_tile(sch, acc)
    parallel = parallel_with_rows(sch, target, outer, i_outer, plan.work)
    if plan.pack_b and _packs_once(sch, reindex_b, plan):
        _pack_weight(sch, reindex_b, plan.tile_j)
    elif plan.pack_b:  # one panel per parallel task (row chunks pack their own)
        panels = outer if parallel is None else parallel
        _pack_panels(sch, reindex_b, panels, plan.tile_j, checks_last=not fuse)
    if parallel is not None:
        sch.parallel(parallel)
    init = sch.decompose_reduction(main, k_outer)
    vectorize_tile(sch, init)


def _dots(block: s_tir.SBlock, lanes: int) -> bool:
    """Whether the normalised ``block`` is one row's dot products with a run-time ``B``: one
    row (``I = 1``), a symbolic number of columns (``B`` is no weight, whose extents are
    static), and a static reduction of whole vectors, at least two.

    A decoder's attention scores for one new token, ``q @ k^T`` over the cached keys, read
    ``k`` as a dense ``B[J, K]``: packed into column panels on every call, it is read through a
    transposing gather, twice the cache's bytes and more (:func:`_schedule_dots` reads it
    once, in place).
    """
    _, rows, cols, depth = (static_extent(iv.dom.extent) for iv in block.iter_vars)
    if str(block.writes[0].source.dtype) != "float32":
        return False
    return (
        rows == 1
        and cols is None
        and depth is not None
        and depth % lanes == 0
        and (depth >= 2 * lanes)
    )


def _schedule_dots(
    sch: s_tir.Schedule, main: SBlockRV, reindex_a: SBlockRV, reindex_b: SBlockRV, target: Target
) -> None:
    """Each output of ``main`` (:func:`_dots`) a dot product of ``A``'s row and a row of ``B``,
    both read in place: the reduction accumulates ``lanes`` partial results in a register and
    adds them in halves (:func:`.reduction.rfactor_lanes`), the epilogue runs on each output."""
    for reindex in (reindex_a, reindex_b):
        auto_inline_producers(sch, reindex)
        sch.compute_inline(reindex)
    acc = sch.cache_write(main, 0, "local")
    inline_epilogue(sch, acc)
    lanes = vector_lanes(target, "float32")
    work = math.prod(nominal(iv.dom.extent) for iv in sch.get(main).iter_vars)
    partials = rfactor_lanes(sch, main, 3, lanes)
    row = sch.fuse(*sch.get_loops(main)[:3])
    if use_parallel(target, work):
        sch.parallel(row)
    sch.reverse_compute_at(acc, row, preserve_unit_loops=True)
    place_partials(sch, partials, row, 1)


def _widens_a(block: s_tir.SBlock) -> bool:
    """Whether the gemm ``block`` multiplies a bf16 ``A`` into fp32: ``A`` is then copied to
    fp32 once, before the register tiles.

    Read in place, each of a tile's broadcasts of ``A`` was a scalar load, a shift and a
    broadcast from a general register; the last two take the ports of Intel's FMAs. An fp32
    copy is broadcast from memory (``vbroadcastss``, a load). On an Emerald Rapids core with AMX
    off (one thread, BENCHMARKS.md, 2026-11-28) the GEMMs left to the FMAs ran 1024^3 at 71-73
    GFLOP/s before and 80-90 after, 128 x 768 x 3072 at 66-68 and 83-85, and SimpleNet at O2 in
    69-70 ms and 54-56. The copy costs one pass over ``A``; ``B``'s packed panels are fp32
    already (TVM stores a bf16 buffer of the kernel's own as fp32).
    """
    return (
        str(block.reads[0].source.dtype) == "bfloat16"
        and str(block.writes[0].source.dtype) == "float32"
    )


def _checks_last_tiles(target: Target, plan: _Plan) -> bool:
    """Whether a serial GEMM over symbolic extents keeps its batch and column-tile loops apart,
    its padded panels and tiles bounds-checked only where the check can fail.

    Padded to whole tiles, the panels packed in the kernel read ``B`` through a bounds check,
    and the tiles store through one; TVM vectorises such a load or store lane by lane behind
    branches, on every tile. Under one fused batch and column-tile loop each check is a ``//``
    and ``%`` of symbolic sizes; over the column-tile loop itself, marked ``likely``
    (:mod:`.bounds`), LoopPartition splits the whole tiles off the last. A decode step's scores
    over 2049 cached keys (``q @ k^T``, 12 heads, fp32, one thread): 0.62 -> 0.25 ms. A
    parallel kernel keeps the fused loop, whose tasks span the batch and the column tiles.
    """
    return plan.pack_b and plan.symbolic and not use_parallel(target, plan.work)


def _packs_once(sch: s_tir.Schedule, pack: SBlockRV, plan: _Plan) -> bool:
    """Whether ``B``'s panels are packed by a function of their own (:func:`_pack_weight`):
    for a GEMM over symbolic rows whose ``B`` is fp32, has static extents, is read from the
    kernel's parameters, and is read by no other block of the kernel (its packed copy replaces
    it among the parameters). A bf16 ``B`` keeps its panels in the kernel, which TVM stores as
    fp32 there (BF16ComputeLegalize): packed apart they would stay bf16, and every
    multiply would widen them again.

    Packed in the kernel, one panel per column tile, the weight was packed again on every call:
    a GPT-2 decoder exported with symbolic lengths spent 12 of 13 ms of an fp32 decode step in
    its Linear kernels, at 11-12 GB/s of weights (onnxruntime reads them at 29).
    """
    if isinstance(plan.extents[1], int) or str(sch.get(pack).writes[0].source.dtype) != "float32":
        return False
    if any(static_extent(sch.get(loop).extent) is None for loop in sch.get_loops(pack)):
        return False
    if not reads_only_params(sch, pack):
        return False
    sources = [read.source for read in sch.get(pack).reads]
    for block in root_blocks(sch):
        if sch.get(block).same_as(sch.get(pack)):
            continue
        if any(r.source.same_as(src) for r in sch.get(block).reads for src in sources):
            return False
    return True


def _pack_weight(sch: s_tir.Schedule, pack: SBlockRV, tile_j: int) -> None:
    """Lay ``B[S, J, K]`` out as ``[S, J / tile_j, K, tile_j]`` in a pre-processing block, which
    ``SplitPreproc`` (:mod:`.bf16_passes`) splits out of the kernel and, for a constant ``B``
    (a weight), evaluates at compile time."""
    sch.transform_layout(pack, ("write", 0), lambda s, j, k: (s, j // tile_j, k, j % tile_j))
    j_loop, k_loop = sch.get_loops(pack)[-2:]
    j_outer, j_inner = sch.split(j_loop, [None, tile_j])
    sch.reorder(j_outer, k_loop, j_inner)
    sch.vectorize(j_inner)
    mark_preproc(sch, pack)


def _pack_panels(
    sch: s_tir.Schedule, pack: SBlockRV, outer: LoopRV, tile_j: int, checks_last: bool = False
) -> None:
    """Lay ``B[S, J, K]`` out as ``[S, J / tile_j, K, tile_j]``; pack one panel per ``outer``.
    ``checks_last``: a padded ``B``'s bounds check is marked ``likely``
    (:func:`_checks_last_tiles`)."""
    sch.transform_layout(pack, ("write", 0), lambda s, j, k: (s, j // tile_j, k, j % tile_j))
    sch.compute_at(pack, outer, preserve_unit_loops=True)
    j_loop, k_loop = sch.get_loops(pack)[-2:]
    sch.reorder(k_loop, j_loop)
    sch.vectorize(j_loop)
    if checks_last:
        bounds.mark(sch, pack)
