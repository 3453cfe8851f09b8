"""Full reductions on the CPU: a whole tensor to one value (a loss mean, the all-finite check).

TVM's ``dlight.cpu.Reduction`` leaves a reduction with no kept axis one serial scalar loop, each
step waiting for the one before (126 us for the sum of a 512 x 512 fp32 tensor here, 8 GB/s).
Here the fused reduction loop is split into ``accumulators x lanes`` partial results
(``rfactor``): the input streams through ``accumulators`` independent SIMD registers, and only
those partials are combined one by one at the end.
"""

from __future__ import annotations

from tvm import DataType, s_tir, tirx
from tvm.s_tir.dlight.analysis import get_root_block
from tvm.target import Target

from .common import CPURule, is_reduction, static_extent, try_inline_all, vector_lanes

# Independent vector accumulators: enough to hide the latency of a vector add or min/max.
ACCUMULATORS = 4


class CPUFullReduction(CPURule):
    """One reduction block that reduces every axis of its input to a single value.

    Injective producers (casts, ``isfinite``) are inlined into the reduction; scalar consumers
    (the divide of a mean, a comparison) stay as they are. The fused reduction loop must hold
    at least two vectors of the widest dtype the block touches; a ragged last chunk is
    predicated.
    """

    def apply(  # pylint: disable=missing-function-docstring
        self, func: tirx.PrimFunc, target: Target, _: bool
    ) -> s_tir.Schedule | None:
        return self.schedule_whole(func, target, _schedule)


def _schedule(sch: s_tir.Schedule, target: Target) -> bool:
    main = _full_reduction(sch)
    if main is None:
        return False
    loops = sch.get_loops(main)
    fused = sch.fuse(*loops) if len(loops) > 1 else loops[0]
    total = static_extent(sch.get(fused).extent)
    lanes = vector_lanes(target, _widest_dtype(sch.get(main)))
    if total is None or total < 2 * lanes:
        return False
    partials = lanes * _accumulators(total, lanes)
    _, part = sch.split(fused, [None, partials])
    rf = sch.rfactor(part, factor_axis=0)
    chunk, part = sch.get_loops(rf)  # rfactor keeps the partials' loop inside
    acc, lane = sch.split(part, [None, lanes])
    sch.unroll(acc)
    sch.vectorize(lane)
    init = sch.decompose_reduction(rf, chunk)
    init_loops = sch.get_loops(init)
    if len(init_loops) == 1:
        sch.vectorize(init_loops[0])
    return True


def _full_reduction(sch: s_tir.Schedule) -> s_tir.schedule.SBlockRV | None:
    """The single reduction block, with no kept axis, once its producers are inlined."""
    blocks = sch.get_child_blocks(get_root_block(sch))
    reductions = [b for b in blocks if is_reduction(sch.get(b))]
    if len(reductions) != 1:
        return None
    (main,) = reductions
    stmt = sch.get(main)
    if any(
        iv.iter_type != tirx.IterVar.CommReduce and static_extent(iv.dom.extent) != 1
        for iv in stmt.iter_vars
    ):
        return None
    others = [b for b in blocks if not sch.get(b).same_as(stmt)]
    producers = [b for b in others if _before(sch, b, main)]
    consumers = [b for b in others if not _before(sch, b, main)]
    if not all(_scalar(sch.get(c)) for c in consumers) or try_inline_all(sch, producers):
        return None
    for consumer in consumers:
        if not sch.get_loops(consumer):
            sch.add_unit_loop(consumer)  # rfactor fails beside a block with no loop (TVM 0.27)
    return main if len(stmt.writes) == 1 else None


def _before(sch: s_tir.Schedule, block, main) -> bool:
    """Whether ``block`` is one of ``main``'s (transitive) producers."""
    pending, seen = list(sch.get_producers(main)), []
    while pending:
        producer = pending.pop()
        if sch.get(producer).same_as(sch.get(block)):
            return True
        if any(sch.get(producer).same_as(sch.get(s)) for s in seen):
            continue
        seen.append(producer)
        pending.extend(sch.get_producers(producer))
    return False


def _scalar(block: s_tir.SBlock) -> bool:
    return all(static_extent(iv.dom.extent) == 1 for iv in block.iter_vars)


def _widest_dtype(block: s_tir.SBlock) -> str:
    """The dtype of the block's buffers with the most bits (it sets the vector lanes)."""
    buffers = [r.source for r in block.reads] + [w.source for w in block.writes]
    return str(max((b.dtype for b in buffers), key=lambda d: DataType(str(d)).bits))


def _accumulators(total: int, lanes: int) -> int:
    """Vector accumulators for ``total`` elements: ``ACCUMULATORS`` while two rounds fit."""
    count = ACCUMULATORS
    while count > 1 and total < 2 * count * lanes:
        count //= 2
    return count


__all__ = ["CPUFullReduction"]
