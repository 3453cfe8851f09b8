"""Default CPU schedule for NCHW conv2d (dense or grouped) with padding and fused epilogues."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from tvm import s_tir, tirx
from tvm.s_tir.schedule import SBlockRV
from tvm.target import Target

from .common import (
    CPURule,
    nominal,
    num_cores,
    static_but_batch,
    use_parallel,
    vector_lanes,
)
from .conv_common import (
    ConvShape,
    TilePlan,
    accumulate_dtype,
    choose_plan,
    find_conv,
    finish,
    pack_weight,
    spread_columns,
    stage_data,
    tile_pixels,
    vector_width,
)
from .grouped_conv import (
    find_permute,
    find_window,
    schedule_columns,
    schedule_groups,
    schedule_permute,
    schedule_window,
)

# The kernels on NHWC rows of tvmamp.relay_passes.conv2d_to_gemm that this rule schedules.
_ROWS_KERNELS = ((find_window, schedule_window), (find_permute, schedule_permute))


class CPUConv2d(CPURule):
    """Direct NCHW conv2d, any groups, stride, dilation and padding; static shapes, or a
    symbolic batch (a CNN exported with a dynamic batch axis: the conv-to-GEMM rewrite needs
    static shapes, and TVM's loops ran such a CNN 300x slower than its static build).

    Dense and grouped convs whose groups fill SIMD vectors are vectorised over the output
    channels of a group (the weight packed to ``[F / tile_f, Cg, KH, KW, tile_f]``, the data
    broadcast); depthwise convs and narrow groups over the groups instead
    (:func:`.grouped_conv.schedule_groups`). :func:`.conv_common.choose_plan` picks the tiling
    and the ``tile_y x tile_x`` output pixels of each register tile. Each accumulator tile is a
    ``local`` buffer; bias, batch-norm, activation and cast epilogues run on the finished tile.
    bf16 and fp16 inputs are widened to the fp32 accumulator dtype once, in the padding copy
    and in the weight packing (folded at compile time for constant weights).
    """

    @dataclass
    class Config:
        """Per-target register budget.

        Attributes
        ----------
        registers : int
            SIMD registers an accumulator tile may take.
        """

        registers: int = 24

    # Keyed by SIMD width in bits (AVX-512 has 32 registers, AVX2 and SSE 16).
    CONFIGS = {512: Config(), 256: Config(registers=12), 128: Config(registers=12)}

    def takes_shapes(self, sch: s_tir.Schedule) -> bool:
        """Static shapes, or a symbolic batch (:func:`.common.static_but_batch`); the rows
        kernels also over a symbolic batch's rows padded to whole tiles."""
        return static_but_batch(sch) or any(find(sch) is not None for find, _ in _ROWS_KERNELS)

    def apply(  # pylint: disable=missing-function-docstring
        self, func: tirx.PrimFunc, target: Target, _: bool
    ) -> s_tir.Schedule | None:
        for find_rows, schedule_rows in _ROWS_KERNELS:  # rows over a static or symbolic batch
            rows = self.schedule_block(
                func, target, find_rows, functools.partial(schedule_rows, target=target)
            )
            if rows is not None:
                return rows
        found = {}

        def find(sch):
            match = find_conv(sch)
            if match is None:
                return None
            found["shape"] = match[1]
            return match[0]

        def schedule(sch, conv):
            config = self.CONFIGS[vector_lanes(target) * 32]
            lanes = vector_lanes(target, accumulate_dtype(sch, conv))
            plan = choose_plan(
                found["shape"], lanes, config.registers, *_batch_and_cores(sch, conv, target)
            )
            if plan.mode == "groups":
                schedule_groups(sch, conv, found["shape"], plan, target)
            elif plan.mode == "columns":
                schedule_columns(sch, conv, plan, target)
            else:
                _schedule_filters(sch, conv, plan, target)

        return self.schedule_block(func, target, find, schedule)


def _schedule_filters(sch: s_tir.Schedule, conv: SBlockRV, plan: TilePlan, target: Target):
    """Vectorise over ``plan.tile_v`` output channels (in power-of-two vectors, unrolled); tile,
    pack and parallelise in place: batch, channel tiles and row tiles, and chunks of the column
    tiles when those are fewer than the cores (:func:`.conv_common.spread_columns`)."""
    dtype = accumulate_dtype(sch, conv)
    stage_data(sch, conv, dtype, always=False)
    tile_f = plan.tile_v
    pack_weight(sch, conv, dtype, lambda f, c, ky, kx: (f // tile_f, c, ky, kx, f % tile_f))
    n, f = sch.get_loops(conv)[:2]
    width = vector_width(tile_f, vector_lanes(target, dtype))
    f_outer, f_chunk, f_inner = sch.split(f, [None, tile_f // width, width])
    outer, x_outer = tile_pixels(sch, conv, plan, [n, f_outer], [f_chunk, f_inner])
    outer, x_outer = spread_columns(sch, conv, outer, x_outer, target)
    sch.unroll(f_chunk)
    sch.vectorize(f_inner)
    # Channels innermost in the accumulator tile, so that each row of it is one vector.
    finish(sch, conv, outer, x_outer, lambda n, f, y, x: (n, y, x, f), target)


def _batch_and_cores(sch: s_tir.Schedule, conv: SBlockRV, target: Target) -> tuple[int, int]:
    """The conv's batch, and the cores its tiles should keep busy (1 when it runs serially)."""
    extents = [nominal(iv.dom.extent) for iv in sch.get(conv).iter_vars]
    return extents[0], num_cores(target) if use_parallel(target, math.prod(extents)) else 1


__all__ = ["CPUConv2d", "ConvShape"]
