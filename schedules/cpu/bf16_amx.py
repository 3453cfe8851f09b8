"""Blocking of a prepared bf16 gemm block onto the AMX micro-kernel of ``x86/amx_intrin.py``."""

from __future__ import annotations

import math
from dataclasses import dataclass

from tvm import s_tir
from tvm.s_tir.schedule import SBlockRV
from tvm.target import Target

from ..x86 import amx_intrin
from .common import inline_epilogue, largest_divisor, num_cores, use_parallel
from .parallel import divisors

TILE_ROWS = 16  # rows of one A tile
TILE_K = amx_intrin.K_STEP  # bf16 values of K in one A tile row (64 bytes)
# The automatic blocks (``n_block=None``). Rows whose K-blocked fp32 accumulator (padded rows x
# at most AUTO_N_BLOCK columns) fits ACCUMULATOR_BYTES take K blocks of at most SHORT_K_BLOCK and
# AUTO_N_BLOCK columns. More rows take K blocks as long as ``k_block`` allows, with a packed
# weight slice (K block x columns, bf16) of at most WEIGHT_SLICE_BYTES, half the 2 MiB L2 of
# Sapphire and Emerald Rapids. Measured on Emerald Rapids, one thread: 1024 x 2048 x 512 ran at
# 869 GFLOP/s with K unblocked and 256 columns (1 MiB) against 568 with 512 (2 MiB) and 647
# with K blocks of 1024 (a 2 MiB accumulator); 4096^3 at 900 with 128 columns against 587 with
# 256 and 533 K-blocked; 257 x 4096 x 1024 at 439 / 542 (W constant / at run time) against
# 359 / 507 K-blocked. With 128-197 rows (BERT's and ViT's K = 1536 GEMMs, a 192-344 KiB
# accumulator) the two plans measured within noise end to end, so those keep K blocks of 1024.
AUTO_N_BLOCK = 512
SHORT_K_BLOCK = 1024
# Most 32-column panels one call of the kernel walks with the same 32 rows of A: the call, its
# tile configuration and the zeroing of the accumulator are paid once for all of them. With
# four (a 16 KiB local accumulator) on Emerald Rapids, paired against one: the
# TransformerEncoderLayer 7 % and SimpleNet b256 9 % faster, 128-row GEMMs with K or N = 384
# 10-18 % slower (BENCHMARKS.md, 2026-11-26 late evening).
PANELS_PER_CALL = 4
# The most padding of J, as a share of its 32-column panels, that a column block not dividing
# them may add (:func:`_parallel_blocks`).
MAX_COLUMN_PADDING = 0.02
ACCUMULATOR_BYTES = 512 << 10
WEIGHT_SLICE_BYTES = 1 << 20


@dataclass
class AMXPlan:
    """Cache blocking of one ``[S, I, J, K]`` gemm for the AMX kernel.

    Attributes
    ----------
    n_block : int
        Columns per outer block: its ``k_block x n_block`` packed weight slice stays in L2
        while every 32-row block of ``A`` walks it.
    k_block : int
        Reduction values per kernel call. When it is shorter than ``K`` the fp32 block of
        ``I x n_block`` accumulates in memory across the ``K`` blocks.
    k_padded : int
        ``K`` padded to whole ``k_block``.
    row_chunks : int
        Parallel chunks the rows are cut into, so that there are enough ``(column block, row
        chunk)`` tasks for the cores when the column blocks alone are too few (1: not cut).
    """

    n_block: int
    k_block: int
    k_padded: int
    row_chunks: int = 1

    @property
    def call_panels(self) -> int:
        """32-column panels per kernel call: see :func:`call_panels`."""
        return call_panels(self.n_block)

    @property
    def k_blocked(self) -> bool:
        return self.k_block < self.k_padded


def make_plan(extents: list[int], n_block: int | None, k_block: int, cores: int = 1) -> AMXPlan:
    """Choose the blocks for ``extents = [S, I, J, K]`` and the ``n_block``/``k_block`` bounds.

    ``K`` is cut into the fewest blocks of at most ``k_block`` values, balanced so that padding
    ``K`` to whole blocks adds less than one 32-step per block. ``n_block=None`` chooses both
    bounds (see ``ACCUMULATOR_BYTES``): K blocks of at most 1024 and 512 columns for few rows,
    else ``k_block`` and :func:`auto_n_block` of that K block. The column block and the row chunks
    come from :func:`_parallel_blocks`: on one core, the largest number of 32-column panels that
    divides the padded ``J`` and fits the bound, with the rows uncut.
    """
    for name, value in (("amx_n_block", n_block), ("amx_k_block", k_block)):
        if value is None and name == "amx_n_block":
            continue
        if value < amx_intrin.COLS or value % amx_intrin.COLS:
            raise ValueError(f"tvmamp.schedules: {name}={value} is not a positive multiple of 32")
    if n_block is None and _short_k_blocks(extents):
        n_block, k_block = AUTO_N_BLOCK, min(k_block, SHORT_K_BLOCK)
    steps = -(-extents[3] // TILE_K)
    blocks = -(-steps // (k_block // TILE_K))
    block_steps = -(-steps // blocks)
    if n_block is None:
        n_block = auto_n_block(block_steps * TILE_K)
    n_panels, row_chunks = _parallel_blocks(extents, n_block // amx_intrin.COLS, cores)
    return AMXPlan(
        n_block=n_panels * amx_intrin.COLS,
        k_block=block_steps * TILE_K,
        k_padded=blocks * block_steps * TILE_K,
        row_chunks=row_chunks,
    )


def _short_k_blocks(extents: list[int]) -> bool:
    """Whether the fp32 accumulator of K-blocked ``extents`` fits ``ACCUMULATOR_BYTES``."""
    rows = -(-extents[1] // amx_intrin.ROWS) * amx_intrin.ROWS
    cols = min(AUTO_N_BLOCK, -(-extents[2] // amx_intrin.COLS) * amx_intrin.COLS)
    return rows * cols * 4 <= ACCUMULATOR_BYTES


def auto_n_block(k_block: int) -> int:
    """Columns (a multiple of 32) whose ``k_block``-long packed weight slice fits L2's share."""
    fit = WEIGHT_SLICE_BYTES // (2 * k_block) // amx_intrin.COLS * amx_intrin.COLS
    return max(amx_intrin.COLS, min(AUTO_N_BLOCK, fit))


def plan_for(target: Target, extents: list[int], n_block: int | None, k_block: int) -> AMXPlan:
    """:func:`make_plan` for ``target``: blocks for its cores when the gemm runs in parallel."""
    parallel = use_parallel(target, math.prod(extents))
    return make_plan(extents, n_block, k_block, num_cores(target) if parallel else 1)


def _parallel_blocks(extents: list[int], max_panels: int, cores: int) -> tuple[int, int]:
    """Return (32-column panels per column block, row chunks) for ``cores`` parallel workers.

    The parallel tasks are ``S x column blocks x row chunks``; each does ``rows / chunks``
    rows of one column block. Among the column blocks of at most ``max_panels`` panels (so the
    weight slice stays in L2) and the row chunks that divide the padded ``I`` into 32-row
    blocks, the choice keeps the busiest core's work within a tenth of the least possible and,
    among those, reads the fewest bytes (each task reads its rows of ``A`` and its slice of the
    weight). On one core that is the widest column block with the rows uncut. With only the
    column blocks in parallel, a 1024-column gemm had two tasks, and 14 of 16 threads idled.

    A column block either divides the padded ``J`` or pads it to whole blocks by at most
    :data:`MAX_COLUMN_PADDING` of its panels: GPT-2's 50257-column LM head has a prime 1571
    panels, which no wider block divides, and would walk ``A`` once per 32 columns.
    """
    rows = -(-extents[1] // amx_intrin.ROWS)
    panels = -(-extents[2] // amx_intrin.COLS)

    def cost(choice: tuple[int, int]) -> tuple[int, int]:
        n_panels, chunks = choice
        blocks = -(-panels // n_panels)
        tasks = extents[0] * blocks * chunks
        busiest = -(-tasks // cores) * (rows // chunks) * n_panels
        reads = extents[0] * (blocks * rows + chunks * blocks * n_panels)
        return busiest, reads

    widths = [
        n
        for n in range(1, max(1, max_panels) + 1)
        if -(-panels // n) * n <= panels * (1 + MAX_COLUMN_PADDING)
    ]
    choices = [(n, c) for n in widths for c in divisors(rows)]
    least = min(cost(c)[0] for c in choices)
    near = [c for c in choices if cost(c)[0] <= least * 1.1]  # a tenth more: reads decide
    return min(near, key=lambda c: cost(c)[::-1])


def call_panels(columns: int) -> int:
    """The most 32-column panels, at most :data:`PANELS_PER_CALL`, that divide ``columns`` (a
    multiple of 32): how many one kernel call walks."""
    panels = columns // amx_intrin.COLS
    return largest_divisor(panels, max(1, PANELS_PER_CALL))


def padding(plan: AMXPlan) -> list[int]:
    """Return the ``pad_einsum`` factors of ``[S, I, J, K]`` for the AMX kernel: ``J`` to whole
    column blocks, ``K`` to whole reduction blocks."""
    return [1, amx_intrin.ROWS, plan.n_block, plan.k_block]


def pack_tiles(sch: s_tir.Schedule, pack: SBlockRV) -> None:
    """Lay ``A[S, I, K]`` out as ``[S, I / 16, K / 32, 16, 32]``: contiguous 1 KB AMX tiles."""
    sch.transform_layout(
        pack,
        ("write", 0),
        lambda s, i, k: (s, i // TILE_ROWS, k // TILE_K, i % TILE_ROWS, k % TILE_K),
    )
    i, k = sch.get_loops(pack)[-2:]
    i_outer, i_row = sch.split(i, [None, TILE_ROWS])
    k_outer, k_col = sch.split(k, [None, TILE_K])
    sch.reorder(i_outer, k_outer, i_row, k_col)
    sch.vectorize(k_col)


def schedule(sch: s_tir.Schedule, main: SBlockRV, target: Target, plan: AMXPlan) -> None:
    """Block ``main`` (padded ``[S, I, J, K]``) and tensorize its 32 x ``32 * call_panels`` x
    ``k_block`` blocks.

    The loops are ``(S * J / n_block * row_chunks, K / k_block, I / 32 / row_chunks,
    n_block / 32 / call_panels)`` outside the kernel, the first in parallel: each 32-row block
    of ``A`` is reused across ``n_block`` columns while the weight slice stays in cache. Without
    ``K`` blocking each call's fp32 block is a ``local`` buffer; with it, an ``I / row_chunks x
    n_block`` buffer accumulates across the ``K`` blocks. The epilogue is fused into whichever
    holds the result.
    """
    extents = [int(iv.dom.extent) for iv in sch.get(main).iter_vars]
    s, i, j, k = sch.get_loops(main)
    per_call = plan.call_panels * amx_intrin.COLS
    j_outer, j_mid, j_inner = sch.split(j, [None, plan.n_block // per_call, per_call])
    i_chunk, i_outer, i_inner = sch.split(i, [plan.row_chunks, None, amx_intrin.ROWS])
    if plan.k_blocked:
        k_outer, k = sch.split(k, [None, plan.k_block])
        sch.reorder(s, j_outer, i_chunk, k_outer, i_outer, j_mid, i_inner, j_inner, k)
    else:
        sch.reorder(s, j_outer, i_chunk, i_outer, j_mid, i_inner, j_inner, k)
    outer = sch.fuse(s, j_outer, i_chunk)
    scope = "global" if plan.k_blocked else "local"
    acc = sch.cache_write(main, 0, scope)
    sch.reverse_compute_at(acc, outer if plan.k_blocked else j_mid, preserve_unit_loops=True)
    inline_epilogue(sch, acc)
    vectorize_16_lanes(sch, acc)
    if use_parallel(target, math.prod(extents)):
        sch.parallel(outer)
    init = sch.decompose_reduction(main, k_outer if plan.k_blocked else i_inner)
    vectorize_16_lanes(sch, init)
    sch.tensorize(i_inner, amx_intrin.amx_intrin(plan.k_block, scope, plan.call_panels))
    sch.annotate(outer, "pragma_import_llvm", amx_intrin.AMX_LLVM_IR)


def vectorize_16_lanes(sch: s_tir.Schedule, block: SBlockRV) -> None:
    """Vectorise the column loop of a fp32 block in 16-lane vectors."""
    col = sch.get_loops(block)[-1]
    extent = int(sch.get(col).extent)
    if extent > TILE_ROWS and extent % TILE_ROWS == 0:
        col = sch.split(col, [None, TILE_ROWS])[-1]
    sch.vectorize(col)
