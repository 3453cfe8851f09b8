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
    schedule_injective,
    try_inline_all,
    use_parallel,
    vector_lanes,
)


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
                _fuse_inner_loops(sch, block, lanes)
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


def _fuse_inner_loops(sch: s_tir.Schedule, block: s_tir.schedule.SBlockRV, lanes: int) -> None:
    """Fuse the innermost loops until the innermost extent is a whole number of vectors.

    An NCHW tensor of width 56 is then vectorised over ``h * w`` (3136 = 98 x 32): the lanes
    stay inside one fused loop, whose index recombines into a contiguous address, instead of
    the whole nest being fused and every lane computing its own ``//`` and ``%``.
    """
    loops = sch.get_loops(block)
    while len(loops) > 1 and int(sch.get(loops[-1]).extent) % lanes:
        sch.fuse(loops[-2], loops[-1])
        loops = sch.get_loops(block)
