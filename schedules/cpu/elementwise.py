"""Default CPU schedule for injective (spatial-only) functions: fuse, vectorise, parallelise."""

from __future__ import annotations

import math

import tvm
from tvm import s_tir, tirx
from tvm.s_tir.dlight.analysis import get_root_block
from tvm.s_tir.schedule import ScheduleError
from tvm.target import Target
from tvm.tirx.analysis import undefined_vars

from . import transpose_intrin as transpose
from .bf16_conv import im2col_channels, schedule_im2col
from .common import (
    MAX_WHOLE_VECTOR,
    CPURule,
    all_static,
    fuse_transposed_inner,
    largest_divisor,
    nominal,
    rule_schedule,
    schedule_injective,
    static_extent,
    try_inline_all,
    use_parallel,
    vector_lanes,
    vectorize_whole_or_leave,
)

# The operand fields of the TIR expressions a concat's epilogue can hold (casts, arithmetic).
_EXPR_FIELDS = ("a", "b", "value", "condition", "true_value", "false_value")
# The shortest vector used to avoid fusing a whole nest (see ``_fuse_inner_loops``).
_MIN_SHORT_LANES = 4


class CPUElementwise(CPURule):
    """Inline what can be inlined, then give each remaining block one parallel outer loop and
    a vectorised inner loop of one SIMD register. With a symbolic extent (a dynamic batch),
    only the innermost loop is vectorised (:func:`.common.schedule_injective`); functions with a
    reduction are left to the other rules. The im2col gathers of ``Conv2dToGemm`` get their
    own schedule (:func:`.bf16_conv.schedule_im2col`), over a symbolic batch too.
    """

    def apply(  # pylint: disable=missing-function-docstring
        self, func: tirx.PrimFunc, target: Target, _: bool
    ) -> s_tir.Schedule | None:
        if not isinstance(func, tirx.PrimFunc) or not self.is_target_available(target):
            return None
        sch = rule_schedule(func)
        blocks = sch.get_child_blocks(get_root_block(sch))
        if not blocks or not all(_is_spatial(sch, b) for b in blocks):
            return None
        static = all_static(sch)
        channels = im2col_channels(func)  # also over a symbolic batch's rows
        if channels is not None and len(blocks) == 1:
            schedule_im2col(sch, blocks[0], channels, target)
            return sch
        remaining = try_inline_all(sch, blocks[:-1]) + blocks[-1:]
        if not static and len(remaining) == 1:
            replaced = _symbolic_transpose(sch, remaining[0], target)
            if replaced is not None:
                return replaced
        try:
            for block in remaining:
                stmt = sch.get(block)
                dtype = str(stmt.writes[0].source.dtype)
                parallel = use_parallel(target, _num_elements(sch, block))
                # TVM 0.27's bf16 legalization rejects a vector store of a bf16 constant
                # (``zeros``/``full``): fill those one element at a time.
                lanes = 1 if dtype == "bfloat16" and not stmt.reads else vector_lanes(target, dtype)
                if not static:  # schedule_injective vectorises the innermost loop
                    if schedule_concat(sch, block, lanes, parallel):  # over symbolic rows
                        continue
                    if _static_but_outer(sch, block):  # a transpose over a dynamic batch
                        fuse_transposed_inner(sch, block)
                    schedule_injective(sch, block, lanes, parallel)
                    continue
                if schedule_concat(sch, block, lanes, parallel):
                    continue
                if not fuse_transposed_inner(sch, block):
                    if _long_ragged_rows(sch, block, lanes):
                        # the row stays a plain loop, for LLVM's loop vectoriser and its tail
                        _fuse_outer(sch, sch.get_loops(block)[:-1], parallel)
                        continue
                    lanes = _fuse_inner_loops(sch, block, lanes)
                schedule_injective(sch, block, lanes, parallel)
        except ScheduleError:
            return None
        return sch


def _symbolic_transpose(
    sch: s_tir.Schedule, block: s_tir.schedule.SBlockRV, target: Target
) -> s_tir.Schedule | None:
    """The kernel of ``block``, a transposing copy over symbolic sizes (the keys of a key-value
    cache, ``[batch, past + 1, heads, dim] -> [batch, heads, dim, past + 1]``), as 16 x 16
    register transposes (:func:`.transpose_intrin.symbolic_copy_function`), or None.

    Left to LLVM's loop vectoriser, such a copy ran at 5 GB/s (a 768 x 513 bf16 transpose:
    0.31 ms, against 0.03 ms for the same copy of static shape); over a dynamic batch, tiled in
    vector squares, at 8 GB/s (``[b, 513, 12, 64] -> [b, 12, 64, 513]``, 513 positions being no
    whole tiles).
    """
    stmt = sch.get(block)
    dtype = str(stmt.writes[0].source.dtype)
    if vector_lanes(target, dtype) < transpose.SIDE:
        return None
    copy = transpose.strided_copy(stmt, symbolic=True)
    if copy is None:
        return None
    parallel = use_parallel(target, _num_elements(sch, block))
    func = transpose.symbolic_copy_function(copy, sch.mod["main"], parallel)
    return None if func is None else s_tir.Schedule(func)


def _static_but_outer(sch: s_tir.Schedule, block: s_tir.schedule.SBlockRV) -> bool:
    """Whether every loop of ``block`` but the outermost has a constant extent (a copy over
    a dynamic batch, whose inner loops are scheduled as for static shapes)."""
    loops = sch.get_loops(block)
    return all(static_extent(sch.get(loop).extent) is not None for loop in loops[1:])


def _is_spatial(sch: s_tir.Schedule, block: s_tir.schedule.SBlockRV) -> bool:
    """Return whether ``block`` has only data-parallel iterators and at least one loop."""
    stmt = sch.get(block)
    spatial = all(iv.iter_type == tirx.IterVar.DataPar for iv in stmt.iter_vars)
    return spatial and len(stmt.writes) == 1 and len(sch.get_loops(block)) > 0


def schedule_concat(
    sch: s_tir.Schedule, block: s_tir.schedule.SBlockRV, lanes: int, parallel: bool
) -> bool:
    """Cut a concatenation along the innermost axis into one vectorised loop per input.

    Legalized, ``concat`` selects its input element by element (``if_then_else(off_i <= c,
    x_i[.., c - off_i], ...)``): vectorised as one loop, every lane loads from every input and
    selects (DenseNet's concat of 25 inputs with its batch-norm and ReLU: 2.8 GB/s). The
    innermost loop is partitioned at the offsets (``loop_partition``), where each part's
    condition is known, and each part is split into vectors of the largest divisor of its width
    up to ``lanes``. Returns False, doing nothing, when the block selects on no constant offset
    of its innermost iterator.
    """
    stmt = sch.get(block)
    loops = sch.get_loops(block)
    if not stmt.iter_vars or len(loops) != len(stmt.iter_vars):
        return False
    extent = static_extent(sch.get(loops[-1]).extent)
    cuts = _concat_offsets(stmt, stmt.iter_vars[-1].var, extent)
    if extent is None or not cuts:
        return _schedule_outer_concat(sch, block, lanes, parallel)
    bounds = [0, *cuts, extent]
    widths = [b - a for a, b in zip(bounds, bounds[1:])]
    parts = sch.loop_partition(loops[-1], [*widths[:-1], None])  # the last one is inferred
    for part, start, width in zip(parts, bounds, widths):
        vector = largest_divisor(width, lanes)
        if start == 0 and vector > 1:
            sch.vectorize(sch.split(part, [None, vector])[-1])
        else:  # split needs a loop from 0: one wide vector, or LLVM's loop vectoriser
            vectorize_whole_or_leave(sch, part, lanes)
    _fuse_outer(sch, loops[:-1], parallel)
    return True


def _schedule_outer_concat(
    sch: s_tir.Schedule, block: s_tir.schedule.SBlockRV, lanes: int, parallel: bool
) -> bool:
    """A concatenation along an outer axis (NCHW channels: MixNet's mixed depthwise convs),
    its loop over that axis partitioned at the offsets; in each part the loops inside it are
    fused and vectorised as for any elementwise block.

    Fused into one vectorised loop, each lane's channel (``//`` and ``%`` of the lane) picked
    its input by selects of gathers, and an epilogue that reads its input many times (a fast
    sigmoid) repeated them: a ``[2, 1200, 4, 4]`` concat with its batch norm and SiLU took
    2.2 ms (0.6 GFLOP/s). Returns False, doing nothing, when no outer loop is cut so, or when
    the loops inside the cut one have a symbolic extent.
    """
    stmt = sch.get(block)
    loops = sch.get_loops(block)
    for axis in range(len(loops) - 2, -1, -1):
        extent = static_extent(sch.get(loops[axis]).extent)
        cuts = _concat_offsets(stmt, stmt.iter_vars[axis].var, extent)
        if cuts:
            break
    else:
        return False
    inner = len(loops) - axis - 1
    if any(static_extent(sch.get(loop).extent) is None for loop in loops[axis + 1 :]):
        return False
    bounds = [0, *cuts, extent]
    widths = [b - a for a, b in zip(bounds, bounds[1:])]

    def partition(target: s_tir.Schedule) -> None:
        parts = target.loop_partition(target.get_loops(block)[axis], [*widths[:-1], None])
        for part in parts:
            (copy,) = target.get_child_blocks(part)
            inside = target.get_loops(copy)[-inner:]
            fused = target.fuse(*inside) if len(inside) > 1 else inside[0]
            vector = largest_divisor(static_extent(target.get(fused).extent), lanes)
            if vector > 1:
                target.vectorize(target.split(fused, [None, vector])[-1])

    try:
        partition(sch.copy())  # a failure must leave no trace in ``sch``
    except (ScheduleError, ValueError):
        return False
    outer = loops[:axis]
    partition(sch)
    _fuse_outer(sch, outer, parallel)
    return True


def _concat_offsets(stmt: s_tir.SBlock, var: tirx.Var, extent: int | None) -> list[int]:
    """The constant offsets ``off`` of ``if_then_else(off <= var, ...)`` selects in ``stmt``."""
    if extent is None or not isinstance(stmt.body, tirx.BufferStore):
        return []
    offsets = set()
    pending = [stmt.body.value]
    while pending:  # TVM 0.27 has no Python visitor for TIR expressions
        node = pending.pop()
        if isinstance(node, tvm.ir.Call):
            cond = node.args[0] if node.op.name.endswith("if_then_else") else None
            if isinstance(cond, tirx.LE) and isinstance(cond.a, tirx.IntImm):
                if cond.b.same_as(var):
                    offsets.add(int(cond.a.value))
            pending.extend(node.args)
        else:
            pending.extend(
                getattr(node, field)
                for field in _EXPR_FIELDS
                if isinstance(getattr(node, field, None), tvm.ir.Expr)
            )
    return sorted(o for o in offsets if 0 < o < extent)


def _num_elements(sch: s_tir.Schedule, block: s_tir.schedule.SBlockRV) -> int:
    """Return the number of iterations of ``block`` (a symbolic extent counts as
    :data:`.common.NOMINAL_EXTENT`)."""
    return math.prod(nominal(iv.dom.extent) for iv in sch.get(block).iter_vars)


def _long_ragged_rows(sch: s_tir.Schedule, block: s_tir.schedule.SBlockRV, lanes: int) -> bool:
    """Whether ``block``'s innermost loop is a long row of no whole vectors (more than
    :data:`.common.MAX_WHOLE_VECTOR` registers) inside other loops, and an operand is broadcast
    along it.

    Fused with the loops outside it (a multiple of ``lanes`` only across rows), each lane
    computed its own row and column, and an operand broadcast along the row (a group norm's
    per-channel scale) became a gather: wav2vec 2.0's ``[256, 3199]`` scale, shift and GELU
    ran at 9.8 GB/s, against 48 GB/s over 3200 columns.
    """
    loops = sch.get_loops(block)
    inner = int(sch.get(loops[-1]).extent)
    if len(loops) == 1 or inner % lanes == 0 or inner <= MAX_WHOLE_VECTOR * lanes:
        return False
    return _broadcast_along_rows(sch.get(block))


def _broadcast_along_rows(stmt) -> bool:
    """Whether ``stmt`` reads an operand whose index does not move with its innermost iterator
    (one value per row); without one, the fused loop's addresses stay contiguous."""
    inner = stmt.iter_vars[-1].var
    for read in stmt.reads:
        used = [v for r in read.region for v in undefined_vars(r.min)]
        if used and not any(v.same_as(inner) for v in used):  # per row; a scalar is uniform
            return True
    return False


def _fuse_outer(sch: s_tir.Schedule, outer: list, parallel: bool) -> None:
    """Fuse the loops ``outer`` (those outside a block's row loop) into one, parallel when
    ``parallel``; nothing when there are none."""
    if not outer:
        return
    fused = sch.fuse(*outer) if len(outer) > 1 else outer[0]
    if parallel:
        sch.parallel(fused)


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
