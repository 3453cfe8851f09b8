"""Attention scores and their softmax in one bf16 kernel, a row block at a time.

:class:`tvmamp.relay_passes.gemm_softmax.FuseGemmSoftmax` merges ``softmax(epilogue(A @ B))``
into one function. Here its GEMM is packed and padded as in :mod:`.bf16_matmul` and runs with
the loops ``(S, I / rows)`` outermost: each block of rows (8 on the ``vdpbf16ps`` register tile,
32 on the AMX kernel where ``K`` needs no blocking) computes its ``rows x J`` fp32 scores one
tile at a time, the epilogue (scale, mask) applied on the tile, then the softmax of those rows
in cache, and writes only the (bf16) probabilities. Unfused, the scores went to memory and back
(4 + 4 MB for a TransformerEncoderLayer of 8 x 128 tokens).
"""

from __future__ import annotations

import dataclasses
import math

from tvm import s_tir, tirx
from tvm.s_tir.schedule import SBlockRV, ScheduleError
from tvm.target import Target

from ..guard import Guarded
from ..x86 import amx_intrin
from ..x86 import bf16_intrin as intrin
from . import bf16_amx as amx
from .bf16_common import is_bf16_matmul, k_is_innermost, root_blocks
from .bf16_matmul import (
    CPUMatmulBF16,
    make_plan,
    prepare,
    shared_operands,
    tensorize_tile,
    tile,
    use_amx,
)
from .bf16_passes import packs_take_intrinsics
from .common import NotApplicable, all_static, is_reduction, use_parallel, vectorize_tile
from .matmul_analysis import iter_kinds, normalize

# Most columns (keys) of a merged kernel; longer rows stay two kernels. A row block's scores and
# exponentials (fp32) then take at most 256 KiB on vdpbf16ps (8 rows), within L2: on Zen5 the
# merged kernel ran attention of 1024, 2048 and 4096 keys 15-17 % faster than two kernels. AMX
# blocks have 32 rows (256 KiB at 1024 keys); longer rows there are not measured.
MAX_COLUMNS = 4096
AMX_MAX_COLUMNS = 1024


def schedules(target: Target, func: tirx.PrimFunc) -> bool:
    """Whether :class:`CPUGemmSoftmaxBF16` schedules the merged kernel ``func`` on ``target``
    (:class:`tvmamp.relay_passes.gemm_softmax.FuseGemmSoftmax` merges only such pairs)."""
    with target:  # Guarded: a failure of the rule is a "no", logged, never a failed build
        return Guarded(CPUGemmSoftmaxBF16()).apply(func, target, False) is not None


def schedules_gemm(target: Target, func: tirx.PrimFunc) -> bool:
    """Whether a bf16 GEMM rule (this module's, or :class:`CPUMatmulBF16`) schedules ``func``
    on ``target`` with its packing of ``B`` on the packing intrinsics: a GEMM kernel with a
    layout kernel merged into ``B``
    (:class:`tvmamp.relay_passes.gemm_layout.FuseLayoutIntoGemm` merges only such).

    A padded ``B`` (ViT's 197 keys) falls to a gather per vector when it reads through the
    layout, 2-5x slower than its copy and the ragged packing of the copy (measured on ViT-S/16,
    BENCHMARKS.md); such a merge is declined.
    """
    with target:
        for rule in (CPUGemmSoftmaxBF16(), CPUMatmulBF16()):
            sch = Guarded(rule).apply(func, target, False)
            if sch is not None:
                return packs_take_intrinsics(sch.mod["main"])
    return False


class CPUGemmSoftmaxBF16(CPUMatmulBF16):
    """A bf16 GEMM whose fp32 result (after elementwise ops) feeds a softmax over its columns.

    The merged kernels of :class:`tvmamp.relay_passes.gemm_softmax.FuseGemmSoftmax`; static
    shapes, targets with avx512_bf16, columns of whole 16-lane vectors (the softmax's reductions
    accumulate in registers; see :func:`_row_reduction_at`), at most :data:`MAX_COLUMNS`
    (:data:`AMX_MAX_COLUMNS` where the GEMM would run on AMX). The GEMM rule's configuration,
    target gating and fallbacks.
    """

    def takes_shapes(self, sch: s_tir.Schedule) -> bool:
        """Static shapes only (the GEMM rule also takes symbolic rows)."""
        return all_static(sch)

    def apply(  # pylint: disable=missing-function-docstring
        self, func: tirx.PrimFunc, target: Target, _: bool
    ) -> s_tir.Schedule | None:
        return self.schedule_block(
            func, target, merged_gemm, lambda sch, main: schedule(sch, main, target, self.config)
        )


def merged_gemm(sch: s_tir.Schedule) -> SBlockRV | None:
    """The GEMM block of a merged kernel: a bf16 GEMM followed by more than one reduction."""
    blocks = root_blocks(sch)
    reductions = [b for b in blocks if is_reduction(sch.get(b))]
    if len(reductions) < 3 or not is_bf16_matmul(sch.get(reductions[0])):
        return None
    if any(is_bf16_matmul(sch.get(b)) for b in reductions[1:]):
        return None
    return reductions[0]


def schedule(
    sch: s_tir.Schedule, main: SBlockRV, target: Target, config: CPUMatmulBF16.Config
) -> None:
    """Tile the GEMM ``main`` by row blocks and compute the softmax of each block inside.

    On AMX targets the GEMM runs on the AMX kernel (32-row blocks, ``A`` tile-packed) when its
    ``K`` needs no blocking, else on ``vdpbf16ps``.
    """
    if iter_kinds(sch.get(main)) is None:  # one key (a J of extent 1): MobileViT's last stage
        raise NotApplicable("the scores GEMM has no column axis to tile")
    a_contiguous = k_is_innermost(sch.get(main), 0)
    shared = shared_operands(sch, main)
    normalize(sch, main)
    extents = [int(iv.dom.extent) for iv in sch.get(main).iter_vars]
    if not merges_columns(target, extents, config):
        raise NotApplicable(f"{extents[2]} columns: not whole vectors or over the limit")
    amx_plan = _amx_plan(target, extents, config)
    if amx_plan is not None and 0 not in shared:
        prepare(
            sch,
            main,
            target,
            amx.padding(amx_plan),
            a_contiguous,
            pack_a=amx.pack_tiles,
            shared=shared,
        )
        row_block, acc, reduction, panels = _tile_amx(sch, main)
        _scores_and_softmax(sch, acc, row_block, target, extents, amx.vectorize_16_lanes)
        init = sch.decompose_reduction(main, reduction)
        amx.vectorize_16_lanes(sch, init)
        _tensorize_amx(sch, row_block, reduction, amx_plan.k_block, panels)
        return
    plan = make_plan(extents, _narrow(config))
    prepare(sch, main, target, plan.padding, a_contiguous, shared=shared)
    row_block, j_outer, k_outer, j_lane = tile(sch, main, plan, rows_outside=True)
    acc = sch.cache_write(main, 0, "local")
    sch.reverse_compute_at(acc, j_outer, preserve_unit_loops=True)
    _scores_and_softmax(sch, acc, row_block, target, extents, vectorize_tile)
    tensorize_tile(sch, main, plan, row_block, k_outer, j_lane)


def _narrow(config: CPUMatmulBF16.Config) -> CPUMatmulBF16.Config:
    """``config`` without its wide tile: a merged kernel's row block walks all its columns, and
    the wide tile was measured on plain GEMMs only."""
    return dataclasses.replace(config, wide_tile=None)


def merges_columns(
    target: Target, extents: list[int], config: CPUMatmulBF16.Config | None = None
) -> bool:
    """Whether the merged kernel of a GEMM ``[S, I, J, K]`` takes its ``J`` columns: whole
    16-lane vectors, at most :data:`MAX_COLUMNS` (:data:`AMX_MAX_COLUMNS` on AMX)."""
    config = config or CPUMatmulBF16.Config()
    limit = AMX_MAX_COLUMNS if use_amx(target, extents, config) else MAX_COLUMNS
    return extents[2] <= limit and extents[2] % intrin.LANES == 0


def _amx_plan(target: Target, extents: list[int], config: CPUMatmulBF16.Config):
    """The AMX plan of the merged GEMM ``[S, I, J, K]``, or None (vdpbf16ps): AMX where the GEMM
    rule would use it and ``K`` needs no blocking (the row block holds all of a row's columns)."""
    plan = amx.make_plan(extents, None, config.amx_k_block)
    return plan if use_amx(target, extents, config) and not plan.k_blocked else None


def plan_key(extents: list[int], target: Target, config: CPUMatmulBF16.Config) -> tuple:
    """The kernel ``config`` gives a merged GEMM of ``extents`` (equal keys: same code)."""
    amx_plan = _amx_plan(target, extents, config)
    if amx_plan is not None:
        return ("amx", amx_plan.k_block, amx_plan.k_padded)
    plan = make_plan(extents, _narrow(config))
    return ("vdpbf16ps", plan.tile_i, plan.tile_j)


def _tile_amx(sch: s_tir.Schedule, main: SBlockRV) -> tuple:
    """Loops ``(S * I / 32, J / c, 32, c, K)`` with ``c = 32 * call_panels``: a 32-row block,
    then the column blocks of one kernel call each.

    Returns the row-block loop, the call's accumulator block (``local``, written back after
    each call), the call's row loop, which the AMX intrinsic replaces, and its panels.
    """
    s, i, j, k = sch.get_loops(main)
    panels = amx.call_panels(int(sch.get(j).extent))
    i_outer, i_inner = sch.split(i, [None, amx_intrin.ROWS])
    j_outer, j_inner = sch.split(j, [None, amx_intrin.COLS * panels])
    sch.reorder(s, i_outer, j_outer, i_inner, j_inner, k)
    row_block = sch.fuse(s, i_outer)
    acc = sch.cache_write(main, 0, "local")
    sch.reverse_compute_at(acc, j_outer, preserve_unit_loops=True)
    return row_block, acc, i_inner, panels


def _tensorize_amx(sch: s_tir.Schedule, row_block, tile_rows, k_block: int, panels: int) -> None:
    """The AMX micro-kernel on each 32 x ``32 * panels`` x ``k_block`` block (its loops from
    ``tile_rows``)."""
    sch.tensorize(tile_rows, amx_intrin.amx_intrin(k_block, "local", panels))
    sch.annotate(row_block, "pragma_import_llvm", amx_intrin.AMX_LLVM_IR)


def _scores_and_softmax(
    sch: s_tir.Schedule, acc: SBlockRV, row_block, target: Target, extents: list, vectorize
) -> None:
    """The epilogue into ``acc``'s write-back (then ``vectorize(sch, acc)``), the softmax under
    ``row_block``, which runs in parallel when the work is large enough."""
    _inline_scores_epilogue(sch, acc)
    vectorize(sch, acc)
    if use_parallel(target, math.prod(extents)):
        sch.parallel(row_block)  # before any decompose_reduction, which breaks its check
    _softmax_at(sch, acc, row_block)


def _inline_scores_epilogue(sch: s_tir.Schedule, acc: SBlockRV) -> None:
    """Inline the elementwise blocks between the GEMM and the softmax's first reduction (the
    copy of the normalised layout, the scale or mask, with what they read computed in place:
    a causal mask from ``arange`` and ``where``) into ``acc``'s write-back."""
    while True:
        consumers = sch.get_consumers(acc)
        if len(consumers) != 1 or is_reduction(sch.get(consumers[0])):
            return
        _inline_side_inputs(sch, consumers[0], acc)
        try:
            sch.reverse_compute_inline(consumers[0])
        except ScheduleError:
            return


def _inline_side_inputs(sch: s_tir.Schedule, block: SBlockRV, acc: SBlockRV) -> None:
    """Inline into ``block`` every producer chain it reads besides ``acc``."""
    for producer in sch.get_producers(block):
        if not sch.get(producer).same_as(sch.get(acc)):
            _inline_side_inputs(sch, producer, acc)
            sch.compute_inline(producer)


def _softmax_at(sch: s_tir.Schedule, acc: SBlockRV, row_block) -> None:
    """Move the blocks after ``acc`` (the softmax and its epilogue) under ``row_block``.

    The elementwise blocks after the last reduction are inlined into the last block; one
    between reductions (the exponentials) keeps its row-block buffer, computed once. Each
    reduction accumulates 16-lane partial results (``rfactor``), combined once per row; the
    elementwise blocks are vectorised along the row.
    """
    blocks = _consumers_in_order(sch, acc)
    kinds = [is_reduction(sch.get(b)) for b in blocks]
    if not any(kinds) or kinds[-1]:
        raise NotApplicable("the GEMM is not followed by a softmax")
    last = max(i for i, reduces in enumerate(kinds) if reduces)
    # after the last reduction: the normalisation and its casts, into the final block; before
    # it: what no reduction reads (``x - max``, into the exponentials)
    inline = set(range(last + 1, len(blocks) - 1))
    inline |= {i for i in range(last) if not kinds[i] and _feeds_only_elementwise(sch, blocks[i])}
    kept = [b for i, b in enumerate(blocks) if i not in inline]
    for i in sorted(inline):
        sch.compute_inline(blocks[i])
    for block in kept:
        if is_reduction(sch.get(block)):
            _row_reduction_at(sch, block, row_block)
        else:
            sch.reverse_compute_at(block, row_block, preserve_unit_loops=True)
            _vectorize_row(sch, block)
    # the row block's buffers (scores, exponentials, partial results) on the stack, not in
    # workspace memory allocated per row block
    for block in [acc, *kept[:-1]]:
        sch.set_scope(block, 0, "local")


def _feeds_only_elementwise(sch: s_tir.Schedule, block: SBlockRV) -> bool:
    """Whether no reduction reads what ``block`` writes (``x - max`` before the exp)."""
    return not any(is_reduction(sch.get(c)) for c in sch.get_consumers(block))


def _row_reduction_at(sch: s_tir.Schedule, block: SBlockRV, row_block) -> None:
    """Reduce each row of ``block`` into 16 lanes, then the lanes, under ``row_block``.

    The rows must be whole vectors: ``rfactor`` needs the block alone under its loops, so it
    runs before the move, and ``reverse_compute_at`` then gives the partial block of a ragged
    row (FastMath's body of 192 of 197 columns) a wrong lane range (TVM 0.27).
    """
    lanes = intrin.LANES
    stmt = sch.get(block)
    extent = int(sch.get(sch.get_loops(block)[-1]).extent)
    if extent % lanes:
        raise NotApplicable(f"softmax rows of {extent} are not whole vectors")
    _, lane = sch.split(sch.get_loops(block)[-1], [None, lanes])
    partial = sch.rfactor(lane, factor_axis=len(stmt.writes[0].source.shape))
    sch.reverse_compute_at(partial, row_block, preserve_unit_loops=True)
    sch.reverse_compute_at(block, row_block, preserve_unit_loops=True)
    # the partial block's loops are (lane, unit.., row, chunk): rows, chunks, then the lanes
    loops = sch.get_loops(partial)
    lane, row, chunk = loops[1], loops[-2], loops[-1]
    sch.reorder(row, chunk, lane)
    sch.vectorize(lane)
    sch.decompose_reduction(partial, chunk)
    lane, row = sch.get_loops(block)[1], sch.get_loops(block)[-1]
    sch.reorder(row, lane)


def _vectorize_row(sch: s_tir.Schedule, block: SBlockRV) -> None:
    """Vectorise the column loop of an elementwise ``block`` in 16-lane vectors."""
    col = sch.get_loops(block)[-1]
    if int(sch.get(col).extent) % intrin.LANES:
        raise NotApplicable("softmax rows are not whole vectors")
    sch.vectorize(sch.split(col, [None, intrin.LANES])[-1])


def _consumers_in_order(sch: s_tir.Schedule, acc: SBlockRV) -> list[SBlockRV]:
    """The blocks after ``acc`` in program order (the softmax and its epilogue)."""
    blocks = root_blocks(sch)
    index = next(i for i, b in enumerate(blocks) if sch.get(b).same_as(sch.get(acc)))
    return blocks[index + 1 :]


__all__ = [
    "CPUGemmSoftmaxBF16",
    "merged_gemm",
    "merges_columns",
    "plan_key",
    "schedule",
    "schedules",
]
