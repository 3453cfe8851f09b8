"""Default CPU schedule for injective (spatial-only) functions: fuse, vectorise, parallelise."""

from __future__ import annotations

import math

from tvm import s_tir, tirx
from tvm.s_tir.dlight.analysis import get_root_block
from tvm.s_tir.schedule import ScheduleError
from tvm.target import Target

from .bf16_conv import im2col_channels, schedule_im2col
from .common import (
    CPURule,
    all_static,
    fuse_transposed_inner,
    schedule_injective,
    try_inline_all,
    use_parallel,
    vector_lanes,
)

# The shortest vector used to avoid fusing a whole nest (see ``_fuse_inner_loops``).
_MIN_SHORT_LANES = 4


class CPUElementwise(CPURule):
    """Inline what can be inlined, then give each remaining block one parallel outer loop and
    a vectorised inner loop of one SIMD register. Static shapes only; functions with a
    reduction are left to the other rules. The im2col gathers of ``Conv2dToGemm`` get their
    own schedule (:func:`.bf16_conv.schedule_im2col`).
    """

    def apply(  # pylint: disable=missing-function-docstring
        self, func: tirx.PrimFunc, target: Target, _: bool
    ) -> s_tir.Schedule | None:
        if not isinstance(func, tirx.PrimFunc) or not self.is_target_available(target):
            return None
        sch = s_tir.Schedule(func)
        blocks = sch.get_child_blocks(get_root_block(sch))
        if not blocks or not all_static(sch) or not all(_is_spatial(sch, b) for b in blocks):
            return None
        channels = im2col_channels(func)
        if channels is not None and len(blocks) == 1:
            schedule_im2col(sch, blocks[0], channels, target)
            return sch
        remaining = try_inline_all(sch, blocks[:-1]) + blocks[-1:]
        try:
            for block in remaining:
                stmt = sch.get(block)
                dtype = str(stmt.writes[0].source.dtype)
                parallel = use_parallel(target, _num_elements(sch, block))
                # TVM 0.27's bf16 legalization rejects a vector store of a bf16 constant
                # (``zeros``/``full``): fill those one element at a time.
                lanes = 1 if dtype == "bfloat16" and not stmt.reads else vector_lanes(target, dtype)
                if not fuse_transposed_inner(sch, block):
                    lanes = _fuse_inner_loops(sch, block, lanes)
                schedule_injective(sch, block, lanes, parallel)
        except ScheduleError:
            return None
        return sch


def _is_spatial(sch: s_tir.Schedule, block: s_tir.schedule.SBlockRV) -> bool:
    """Return whether ``block`` has only data-parallel iterators and at least one loop."""
    stmt = sch.get(block)
    spatial = all(iv.iter_type == tirx.IterVar.DataPar for iv in stmt.iter_vars)
    return spatial and len(stmt.writes) == 1 and len(sch.get_loops(block)) > 0


def _num_elements(sch: s_tir.Schedule, block: s_tir.schedule.SBlockRV) -> int:
    """Return the number of iterations of ``block`` (its shapes are static)."""
    return math.prod(int(iv.dom.extent) for iv in sch.get(block).iter_vars)


def _fuse_inner_loops(sch: s_tir.Schedule, block: s_tir.schedule.SBlockRV, lanes: int) -> int:
    """Fuse the innermost loops until the innermost extent is a whole number of vectors; return
    the vector length to use.

    An NCHW tensor of width 56 is then vectorised over ``h * w`` (3136 = 98 x 32): the lanes
    stay inside one fused loop, whose index recombines into a contiguous address, instead of
    the whole nest being fused and every lane computing its own ``//`` and ``%``. When only the
    whole nest is a multiple of ``lanes`` (bf16's 32 lanes over a 28 x 28 plane), a shorter
    vector (a power of two, at least 4) that divides an inner extent is used instead
    (16 over 784), so a channel shuffle keeps contiguous vectors.
    """
    loops = sch.get_loops(block)
    extents = [int(sch.get(loop).extent) for loop in loops]
    count, lanes = _vector_loops(extents, lanes)
    for _ in range(count - 1):
        loops = sch.get_loops(block)
        sch.fuse(loops[-2], loops[-1])
    return lanes


def _vector_loops(extents: list[int], lanes: int) -> tuple[int, int]:
    """How many innermost loops of ``extents`` to fuse, and the vector length over them.

    The fewest loops whose extent is a multiple of ``lanes``, unless that takes the whole nest
    and a power of two of at least 4 divides a smaller suffix: then the largest such.
    """
    shorter = None
    inner = 1
    for count in range(1, len(extents) + 1):
        inner *= extents[-count]
        whole = math.prod(extents[:-count]) == 1
        if whole and shorter is not None:
            return shorter
        if inner % lanes == 0:
            return count, lanes
        pow2 = inner & -inner  # the largest power of two dividing ``inner``
        if pow2 >= _MIN_SHORT_LANES and (shorter is None or pow2 > shorter[1]):
            shorter = (count, pow2)
    return len(extents), lanes
