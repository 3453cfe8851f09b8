"""The schedule of the depthwise planes kernel (``tvmamp.relay_passes.depthwise_planes``).

One channel plane at a time (planes in parallel when worth it): the padded plane (or its four
polyphase planes, for stride 2) is copied to a flat buffer (rows of ``Wq`` columns, vectorised
along the row, the padding rows and columns looped apart so that the input's are copied
without bounds checks), the conv over the flat output
index ``q`` runs in register tiles of ``tile`` vectors (each tap one unaligned vector load per
vector and the tap's weight broadcast), and the output rows are cropped from it, the fused
epilogue applied, vectorised along the row. Everything a plane touches stays in L1.
"""

from __future__ import annotations

import math

from tvm import s_tir, tirx
from tvm.s_tir.schedule import SBlockRV
from tvm.target import Target

from tvmamp.relay_passes.depthwise_planes import INTERIOR_ATTR, PLANES_ATTR

from .common import CPURule, inline_epilogue, largest_divisor, use_parallel, vector_lanes
from .conv_common import vectorise_interior
from .grouped_conv import _annotated

# Accumulator vectors of one register tile.
_TILE_VECTORS = 8


class CPUDepthwisePlanes(CPURule):
    """The planes kernel: a block annotated ``PLANES_ATTR``, its staging producer and its crop."""

    def apply(  # pylint: disable=missing-function-docstring
        self, func: tirx.PrimFunc, target: Target, _: bool
    ) -> s_tir.Schedule | None:
        return self.schedule_block(
            func, target, lambda sch: _annotated(sch, PLANES_ATTR), _schedule(target)
        )


def _schedule(target: Target):
    def schedule(sch: s_tir.Schedule, conv: SBlockRV) -> None:
        schedule_planes(sch, conv, target)

    return schedule


def schedule_planes(sch: s_tir.Schedule, conv: SBlockRV, target: Target) -> None:
    """Schedule the planes kernel whose reduction block is ``conv``."""
    pitch = int(sch.get(conv).annotations[PLANES_ATTR])
    lanes = vector_lanes(target, "float32")
    (staged,) = sch.get_producers(conv)
    (crop,) = sch.get_consumers(conv)
    inline_epilogue(sch, crop)
    n, c, y, x = sch.get_loops(crop)
    plane = sch.fuse(n, c)
    sch.compute_at(conv, plane, preserve_unit_loops=True)
    length = int(sch.get(conv).iter_vars[2].dom.extent)
    vectors = length // lanes
    tile = largest_divisor(vectors, _TILE_VECTORS)
    q, ky, kx = sch.get_loops(conv)[-3:]
    # The crop reads fewer than ``length`` outputs; the tile computes whole vectors anyway.
    q_outer, q_vector, q_lane = sch.split(
        q, [vectors // tile, tile, lanes], disable_predication=True
    )
    sch.reorder(q_outer, ky, kx, q_vector, q_lane)
    sch.compute_at(staged, plane, preserve_unit_loops=True)
    # Flat planes (each of the four polyphase planes of a stride-2 conv): [..., rows * Wq].
    sch.transform_layout(staged, ("write", 0), lambda *i: (*i[:-2], i[-2] * pitch + i[-1]))
    first_row, rows, first_col, cols = (int(v) for v in sch.get(staged).annotations[INTERIOR_ATTR])
    vectorise_interior(sch, staged, (first_row, rows), (first_col, cols))
    acc = sch.cache_write(conv, 0, "local")
    sch.reverse_compute_at(acc, q_outer, preserve_unit_loops=True)
    acc_vector, acc_lane = sch.split(sch.get_loops(acc)[-1], [None, lanes])
    sch.unroll(acc_vector)
    sch.vectorize(acc_lane)
    sch.unroll(q_vector)
    sch.vectorize(q_lane)
    _vectorise_row(sch, crop, lanes)
    work = math.prod(int(iv.dom.extent) for iv in sch.get(conv).iter_vars)
    if use_parallel(target, work):
        # Before the reduction's init is split off: TVM parallelises only loops whose
        # blocks are all complete or whole reductions.
        sch.parallel(plane)
    init = sch.decompose_reduction(conv, ky)
    sch.vectorize(sch.get_loops(init)[-1])


def _vectorise_row(sch: s_tir.Schedule, block: SBlockRV, lanes: int) -> None:
    """Vectorise the innermost loop of ``block``, in whole vectors when it is a multiple."""
    inner = sch.get_loops(block)[-1]
    extent = int(sch.get(inner).extent)
    if extent > lanes and extent % lanes == 0:
        inner = sch.split(inner, [None, lanes])[-1]
    sch.vectorize(inner)
