"""2-D pooling on the CPU (NCHW max/avg pooling, global average pooling): SIMD over a row.

Without a rule, max pooling compiles as naive loops and average pooling as TVM's scalar
``dlight.cpu.Reduction``. Here the window loops run outside a vector of outputs: one SIMD
register of output columns (or of channels, when the output row is too short, as in global
average pooling), each window tap loading one (strided) vector and folding it in with one
``max``/``add``. The padded input is built one channel plane at a time, next to its use (it
stays in cache), and the channel planes run in parallel when the target has several cores and
the work is large enough. When the planes are fewer than the cores, the output rows are cut into
chunks beside them, or, for a global pooling (one output row), the plane's reduction is cut into
row chunks reduced in parallel (``rfactor``) and combined after.

A window that moves more than one column per output column (a stride-2 max pool) keeps TVM's
default loops, unvectorised: its strided vector version measured 2.5x slower than them. Only on
several cores is it taken, to run its channel planes (and row chunks) in parallel.
"""

from __future__ import annotations

import math

import tvm
from tvm import s_tir, tirx
from tvm.s_tir.dlight.analysis import get_root_block
from tvm.target import Target
from tvm.tirx.analysis import undefined_vars

from .common import (
    CPURule,
    NotApplicable,
    largest_divisor,
    nominal,
    num_cores,
    row_chunks,
    static_extent,
    use_parallel,
    vector_lanes,
)

# A vector of output columns shorter than this is not worth it: vectorise channels instead.
_MIN_ROW_LANES = 4


class CPUPooling(CPURule):
    """One ``max``/``sum`` reduction block over a 4-D (NCHW) input with spatial iterators
    ``n, c, h, w`` and trailing reduction (window) iterators, reading one buffer whose first two
    indices are ``n`` and ``c``; injective producers (padding) before it and injective
    consumers (the average's division) after it. The batch, height and width may be symbolic.
    """

    def takes_shapes(self, sch: s_tir.Schedule) -> bool:
        """Any shapes: :func:`_schedule` checks which extents it needs static."""
        return True

    def apply(  # pylint: disable=missing-function-docstring
        self, func: tirx.PrimFunc, target: Target, _: bool
    ) -> s_tir.Schedule | None:
        return self.schedule_whole(func, target, _schedule)


def _is_pool_combiner(stmt: s_tir.SBlock) -> bool:
    """Whether ``stmt``'s body is ``out = max(out, x)`` or ``out = out + x``."""
    body = stmt.body
    if not isinstance(body, tirx.BufferStore):
        return False
    value = body.value
    if not isinstance(value, (tirx.Max, tirx.Add)):
        return False
    loaded = getattr(value.a, "source", None)  # a load of the output itself
    return loaded is not None and loaded.same_as(body.buffer)


def _strided(index: tirx.PrimExpr, var: tirx.Var) -> bool:
    """Whether ``index`` multiplies ``var`` by a constant other than 1 (``w * 2 + kw``)."""
    if isinstance(index, tirx.Mul):
        a, b = index.a, index.b
        for term, factor in ((a, b), (b, a)):
            if term.same_as(var) and isinstance(factor, tirx.IntImm) and factor.value != 1:
                return True
    return any(
        _strided(getattr(index, name), var)
        for name in ("a", "b")
        if isinstance(getattr(index, name, None), tvm.ir.expr.Expr)
    )


def _find_pool(sch: s_tir.Schedule) -> tuple[list, s_tir.schedule.SBlockRV, list, bool]:
    """The producers, the pooling block, the consumers of ``sch``'s root blocks and whether the
    window moves more than one column per output column."""
    blocks = sch.get_child_blocks(get_root_block(sch))
    kinds = [[iv.iter_type for iv in sch.get(b).iter_vars] for b in blocks]
    reductions = [i for i, k in enumerate(kinds) if tirx.IterVar.CommReduce in k]
    if len(reductions) != 1:
        raise NotApplicable("not exactly one reduction block")
    (index,) = reductions
    pool = blocks[index]
    stmt = sch.get(pool)
    types = kinds[index]
    spatial, reduce = types[:4], types[4:]
    if len(types) < 6 or any(t != tirx.IterVar.DataPar for t in spatial):
        raise NotApplicable("not n, c, h, w followed by window iterators")
    if any(t != tirx.IterVar.CommReduce for t in reduce):
        raise NotApplicable("window iterators are not all trailing")
    if len(stmt.writes) != 1 or not _is_pool_combiner(stmt):
        raise NotApplicable("not a max/sum of one input")
    out = stmt.writes[0]
    source = [r for r in stmt.reads if not r.source.same_as(out.source)]
    if len(source) != 1 or len(source[0].region) != 4 or len(out.region) != 4:
        raise NotApplicable("not a 4-D input and output")
    region = source[0].region
    for axis in (0, 1):  # batch and channel are read as they are written
        used = undefined_vars(region[axis].min)
        if len(used) != 1 or not used[0].same_as(stmt.iter_vars[axis].var):
            raise NotApplicable("input batch/channel index is not the output's")
    width = stmt.iter_vars[3]
    strided = static_extent(width.dom.extent) != 1 and _strided(region[3].min, width.var)
    for i, block_kinds in enumerate(kinds):
        if i != index and any(k != tirx.IterVar.DataPar for k in block_kinds):
            raise NotApplicable("a producer or consumer is not injective")
    return blocks[:index], pool, blocks[index + 1 :], strided


def _extent(sch: s_tir.Schedule, loop) -> int:
    return int(sch.get(loop).extent)


def _schedule_strided(
    sch: s_tir.Schedule, target: Target, producers: list, pool, consumers: list, work: int
) -> bool:
    """TVM's default loops of a strided window, with only its planes (and row chunks) parallel.

    Measured: a vectorised strided window (3x3 stride 2 max pool) ran 2.5x slower than TVM's
    default loops, so the loops inside a task are left as they are; on one core (or for little
    work) the function is left to them whole.
    """
    if not use_parallel(target, work):
        raise NotApplicable("a strided window on one core: TVM's default loops")
    n, c, h, *_ = sch.get_loops(pool)
    tasks = _extent(sch, n) * _extent(sch, c)
    chunks = row_chunks(num_cores(target), tasks, _extent(sch, h))
    plane = sch.fuse(n, c)
    if chunks > 1:
        chunk, _ = sch.split(h, [chunks, None])
        plane = sch.fuse(plane, chunk)
    sch.parallel(plane)
    for block in reversed(producers):  # the padded input: one plane (row chunk) at a time
        sch.compute_at(block, plane, preserve_unit_loops=True)
    for block in consumers:
        sch.reverse_compute_at(block, plane, preserve_unit_loops=True)
    return True


def _rfactor_rows(sch: s_tir.Schedule, target: Target, pool, consumers: list, lanes: int) -> bool:
    """A global pooling over planes fewer than the cores: reduce row chunks in parallel.

    The plane's rows (the first window loop) are cut into :func:`row_chunks` chunks, each
    reduced into its own partial vector (``rfactor``) in parallel beside the channel vectors;
    a short serial loop then adds the chunks' partials and the consumers (the division) follow.
    """
    n, c, h, w, rows, *window = sch.get_loops(pool)
    tasks = _extent(sch, n) * _extent(sch, c) // lanes
    chunks = row_chunks(num_cores(target), tasks, _extent(sch, rows))
    if chunks == 1:
        return False
    c_outer, vec = sch.split(c, [None, lanes])
    chunk, rows = sch.split(rows, [chunks, None])
    sch.reorder(c_outer, chunk, h, w, rows, *window, vec)
    partial = sch.rfactor(chunk, 0)
    plane = sch.fuse(*sch.get_loops(partial)[:3])  # n, c_outer, chunk
    sch.parallel(plane)
    dtype = str(sch.get(pool).writes[0].source.dtype)
    lane_loop = sch.vectorize if dtype != "bfloat16" else sch.unroll
    lane_loop(sch.get_loops(partial)[-1])
    init = sch.decompose_reduction(partial, sch.get_loops(partial)[3])  # before h
    lane_loop(sch.get_loops(init)[-1])
    n, c_outer, chunk, h, w, vec = sch.get_loops(pool)  # the combine of the chunks
    sch.reorder(h, w, chunk)
    lane_loop(vec)
    init = sch.decompose_reduction(pool, chunk)
    lane_loop(sch.get_loops(init)[-1])
    if consumers:  # the average's division, on the vector just combined
        sch.reverse_compute_at(consumers[0], w, preserve_unit_loops=True)
        inner = sch.get_loops(consumers[0])[len(sch.get_loops(init)) - 1 :]
        sch.vectorize(sch.fuse(*inner) if len(inner) > 1 else inner[0])
    return True


def _schedule(sch: s_tir.Schedule, target: Target) -> bool:
    """Schedule the pooling function in place; raises NotApplicable when it is not one.

    Over a symbolic batch, height or width (a model exported with dynamic sizes) the vector is
    one of channels, which needs no tail: a row of outputs of symbolic length would end in a
    predicated vector, which TVM 0.27 scalarises whole. Without this PoolFormer's pooling
    blocks ran as naive loops, 35x their static time.
    """
    producers, pool, consumers, strided = _find_pool(sch)
    loops = sch.get_loops(pool)
    symbolic = any(static_extent(sch.get(loop).extent) is None for loop in loops[:4])
    work = math.prod(nominal(sch.get(loop).extent) for loop in loops)
    if strided:
        if symbolic:
            raise NotApplicable("a strided window over symbolic sizes: TVM's default loops")
        return _schedule_strided(sch, target, producers, pool, consumers, work)
    if static_extent(sch.get(loops[1]).extent) is None:
        raise NotApplicable("a symbolic number of channels")
    for block in producers[:-1]:
        sch.compute_inline(block)
    for block in reversed(consumers[1:]):
        sch.reverse_compute_inline(block)
    lanes = vector_lanes(target, "float32")  # bf16 is widened to fp32 for the arithmetic
    n, c, h, w, *window = sch.get_loops(pool)
    batch, channels, height, width = (nominal(sch.get(loop).extent) for loop in (n, c, h, w))
    if symbolic:
        row_lanes = 0
    else:
        row_lanes = width if width <= lanes else largest_divisor(width, lanes)
    parallel = use_parallel(target, work)
    if row_lanes >= _MIN_ROW_LANES:  # a vector of output columns
        w_outer, vec = sch.split(w, [None, row_lanes])
        sch.reorder(w_outer, *window, vec)
        plane = sch.fuse(n, c)
        cursor = w_outer
    else:  # a vector of channels (global pooling, tiny rows)
        channel_lanes = largest_divisor(channels, lanes)
        tasks = batch * channels // channel_lanes
        few = parallel and tasks < num_cores(target) and not symbolic
        static_window = all(static_extent(sch.get(loop).extent) for loop in window)
        if few and height == 1 and not producers and static_window:  # global: rows in parallel
            if _rfactor_rows(sch, target, pool, consumers, channel_lanes):
                return True
        c_outer, vec = sch.split(c, [None, channel_lanes])
        chunks = row_chunks(num_cores(target), tasks, height) if few else 1
        if chunks > 1:  # output rows in chunks beside the channel vectors
            chunk, h = sch.split(h, [chunks, None])
            sch.reorder(c_outer, chunk, h, w, *window, vec)
            plane = sch.fuse(n, c_outer, chunk)
        else:
            sch.reorder(c_outer, h, w, *window, vec)
            plane = sch.fuse(n, c_outer)
        cursor = w
    if parallel:
        sch.parallel(plane)
    dtype = str(sch.get(pool).writes[0].source.dtype)
    # TVM 0.27's bf16 legalization rejects a vector store of a bf16 max/constant: unroll the
    # lanes and leave the vectors to LLVM's SLP vectoriser.
    (sch.vectorize if dtype != "bfloat16" else sch.unroll)(vec)
    init = sch.decompose_reduction(pool, window[0])
    (sch.vectorize if dtype != "bfloat16" else sch.unroll)(sch.get_loops(init)[-1])
    if producers:  # the padded input: one channel plane (or chunk) at a time
        sch.compute_at(producers[-1], plane, preserve_unit_loops=True)
    if consumers:  # the average's division, on the vector just reduced
        sch.reverse_compute_at(consumers[0], cursor, preserve_unit_loops=True)
        inner = sch.get_loops(consumers[0])[len(sch.get_loops(init)) - 1 :]
        sch.vectorize(sch.fuse(*inner) if len(inner) > 1 else inner[0])
    return True
