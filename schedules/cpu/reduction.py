"""Row reductions on the CPU (softmax, layer norm, RMS norm, mean): rows per task, SIMD inside.

TVM's ``dlight.cpu.Reduction`` leaves every reduction scalar (a serial ``max``/``sum`` over the
row, 4-8 ns per element on softmax and layer norm). Here each reduction is split into a SIMD
register of partial results (``rfactor``) that the row streams through, and only the last
``lanes`` values are combined, in halves (a tree of vector adds). Each reduction must cover a
multiple of the register width (TVM 0.27's ``compute_at`` drops the predicate of a partial
chunk); the fast-math softmax splits its rows into such a body and a tail. Injective loops of a
ragged length are left to LLVM's loop vectoriser, which adds a scalar tail (TVM would scalarise
a predicated vector loop whole).
"""

from __future__ import annotations

import math

from tvm import s_tir, tirx
from tvm.s_tir.dlight.analysis import SBlockInfo, normalize_prim_func
from tvm.s_tir.schedule import ScheduleError
from tvm.sym.analyzer import Analyzer
from tvm.target import Target

from .common import (
    CPURule,
    divisible,
    nominal,
    num_cores,
    param_buffers,
    schedule_injective,
    static_extent,
    use_parallel,
    vector_lanes,
)
from .parallel import row_chunks

# The fewest elements of a row one parallel task of a long-row reduction handles: below this
# the extra combine step and the task start cost more than the cores save.
MIN_CHUNK = 1024
# Short rows are handled a few at a time, each stage for all of them before the next: one
# row's stages form a chain of dependent reductions, and independent rows let the core overlap
# them. The group's rows (at most this many elements) stay in L1.
GROUP_ELEMENTS = 2048


class CPURowReduction(CPURule):
    """Softmax-, norm- and mean-like functions: reductions over the trailing axes of each row.

    Fits a function whose blocks all share their leading spatial axes (the rows; their number
    may be symbolic, as under a dynamic batch), with at least one reduction, each over a
    multiple of the SIMD width or shorter than two vectors, and an injective last block. A
    symbolic row length (a dynamic sequence length) is taken too: a reduction over it
    accumulates in SIMD registers where its length is provably whole vectors (the body of
    fast-math softmax, ``relay_passes/fast_math.py``), else it stays a scalar loop (the
    softmax's tail of at most 15 values), and injective loops over it are left to LLVM's loop
    vectoriser; such rows are not grouped or cut into chunks. Casts and other injective blocks
    before the first reduction, and per-row scalars (a mean), are inlined; epilogues are
    inlined into the last block. Rows run in a fused outer loop (parallel when the target has
    several cores and the work is large enough); inside a row every remaining block is a
    vectorised loop, each reduction accumulating one SIMD register of partial results. Short
    rows go in groups of 4 or 2 (:func:`_row_group`), each stage for the whole group before
    the next: a row's max, exp, sum and scale depend on each other, and a group gives the core
    independent work (softmax and layer norm of 64-512 elements 11-36 % faster on Zen5).

    Rows fewer than the cores and long (a group norm of 4-8 groups of 65,536 elements) are cut
    into chunks instead (:func:`_schedule_long_rows`): each pass over the rows is a parallel
    loop over (row, chunk) of its own, the partial results of every chunk combined in between.
    """

    def takes_shapes(self, sch: s_tir.Schedule) -> bool:
        """Any shapes: the rows and their length may be symbolic."""
        return True

    def apply(  # pylint: disable=missing-function-docstring
        self, func: tirx.PrimFunc, target: Target, _: bool
    ) -> s_tir.Schedule | None:
        return self.schedule_whole(func, target, _schedule)


def _infos(sch: s_tir.Schedule) -> list[SBlockInfo] | None:
    infos = normalize_prim_func(sch)
    if not infos or not any(not b.is_injective() for b in infos):
        return None
    return infos


def _leading_spatial(info: SBlockInfo) -> int:
    kinds = info.dom_kind()
    return len(kinds) - len(kinds.lstrip("S"))


def _is_row_reduction(info: SBlockInfo, rows: int) -> bool:
    """``S..S R..R`` with exactly ``rows`` leading spatial axes and a single output."""
    kinds = info.dom_kind()
    return kinds == "S" * rows + "R" * (len(kinds) - rows) and len(kinds) > rows


def _schedule(sch: s_tir.Schedule, target: Target) -> bool:
    infos = _infos(sch)
    if infos is None or not _same_symbolic_rows(sch, infos):
        return False
    _inline(sch, infos)
    infos = _infos(sch)
    last_is_result = infos is not None and not _writes_intermediate(sch, infos[-1].block_rv)
    if last_is_result and not infos[-1].is_injective():
        # a reduction that writes the kernel's result itself (a bare row sum): its result goes
        # through registers and a copy, an injective last block as the rule needs (left
        # unscheduled, a row sum of 2304 x 1024 fp32 was a scalar loop: 8.5 GB/s)
        sch.cache_write(infos[-1].block_rv, 0, "local")
        infos = _infos(sch)
    if infos is None or not infos[-1].is_injective():
        return False
    rows = min(_leading_spatial(b) for b in infos)
    if rows == 0:
        return False
    for info in infos:
        if not info.is_injective() and not _is_row_reduction(info, rows):
            return False
    last = infos[-1].block_rv
    lanes = vector_lanes(target, "float32")
    counts = {_row_count(sch, b.block_rv, rows) for b in infos} - {None}
    if len(counts) > 1:
        # the blocks disagree on their rows: normalize_prim_func drops unit axes, so with a
        # single row (a group norm of one group, [1, 1, N]) the last block's N elements looked
        # like rows, and every element recomputed the sums (PoolFormer: 4 s a norm)
        reductions = [b for b in infos if not b.is_injective()]
        if any(_row_count(sch, b.block_rv, rows) != 1 for b in reductions):
            return False
        return _schedule_one_row(sch, infos, rows, lanes, target)
    lengths = [_row_length(sch, b.block_rv, rows) for b in infos if not b.is_injective()]
    if any(n is not None and n % lanes and n >= 2 * lanes for n in lengths):
        return False  # a long ragged reduction would stay scalar, as in dlight.cpu.Reduction
    symbolic = None in lengths or _row_length(sch, last, rows) is None
    work = sum(_iterations(sch, b.block_rv) for b in infos)
    chunks = 1 if symbolic else _long_row_chunks(sch, infos, rows, lanes, target, work)
    if chunks > 1:
        _schedule_long_rows(sch, infos, rows, lanes, chunks)
        return True
    count = _row_count(sch, last, rows)
    group = 1 if count is None or symbolic else _row_group(count, max(lengths), lanes)
    if rows > 1 and not all(_writes_intermediate(sch, b.block_rv) for b in infos[:-1]):
        group = 1  # a stage writes a kernel output, whose layout must stay
    if group > 1 and rows > 1:
        # one row axis per block and intermediate buffer: the stages of a group of rows then
        # cover exactly its rows (with several row axes their regions covered whole planes)
        for info in infos[:-1]:
            _fuse_buffer_rows(sch, info.block_rv, rows)
        for info in infos:
            _fuse_row_axes(sch, info.block_rv, rows)
        rows = 1
    partials = {}
    for info in infos:
        if not info.is_injective():
            partials[id(info)] = rfactor_lanes(sch, info.block_rv, rows, lanes)
    row_loops = sch.get_loops(last)[:rows]
    if all(isinstance(sch.get(loop).extent, (tirx.IntImm, tirx.Var)) for loop in row_loops):
        row = outer = sch.fuse(*row_loops)
        depth = 1
    else:
        # a row extent such as (samples - 400) // 320 + 1 (wav2vec 2.0's frames): compute_at
        # under the fused rows could not bound their // and %, and guarded every block with
        # a predicate that vectorize refuses; each block goes under the innermost row loop
        row, outer, depth = row_loops[-1], row_loops[0], rows
    if group > 1:
        row, _ = sch.split(row, [None, group])
        outer = row
    if use_parallel(target, work):
        sch.parallel(outer)
    _vector_inner(sch, last, lanes, _row_length(sch, last, rows) if group > 1 else 0, depth)
    for info in reversed(infos[:-1]):
        sch.compute_at(info.block_rv, row, preserve_unit_loops=True)
        if info.is_injective():
            length = _row_length(sch, info.block_rv, rows) if group > 1 else 0
            _vector_inner(sch, info.block_rv, lanes, length, depth)
        elif partials[id(info)] is not None:
            place_partials(sch, partials[id(info)], row, depth)
    return True


def _schedule_one_row(
    sch: s_tir.Schedule, infos: list[SBlockInfo], rows: int, lanes: int, target: Target
) -> bool:
    """One row: each block runs over all its elements at the root, the reductions each into
    ``lanes`` partial results (loops LLVM is left to vectorise), the injective blocks
    vectorised (in parallel when large enough). The reductions must be whole vectors, as in
    :func:`_schedule`."""
    for info in infos:
        block = info.block_rv
        if info.is_injective():
            work = _iterations(sch, block)
            schedule_injective(sch, block, lanes, use_parallel(target, work))
            continue
        length = _row_length(sch, block, rows)
        if length is None or length % lanes:
            return False
        partials = rfactor_lanes(sch, block, rows, lanes, tree=False)  # one combine: no tree
        if partials is not None:  # loops (row, lane, chunk): the chunk loop goes outside
            partial = partials[0]
            lane, chunk = sch.get_loops(partial)[1], sch.get_loops(partial)[-1]
            sch.reorder(chunk, lane)
            sch.decompose_reduction(partial, chunk)
            # TVM cannot vectorise the lanes under the reduction loop at the root, and unrolled
            # (0.27 ms at N = 200704) LLVM took 74 s to compile the kernel: a plain loop, 0.57 ms
    return True


def _row_group(count: int, length: int, lanes: int) -> int:
    """Rows one loop iteration handles, stage by stage (4, 2 or 1, dividing ``count``); 1 for
    rows shorter than two vectors, whose reductions stay scalar (:func:`rfactor_lanes`)."""
    if length < 2 * lanes:
        return 1
    for group in (4, 2):
        if count % group == 0 and group * length <= GROUP_ELEMENTS:
            return group
    return 1


def _row_count(sch: s_tir.Schedule, block: s_tir.schedule.SBlockRV, rows: int) -> int | None:
    """The number of rows of ``block``: the product of its ``rows`` leading extents; None
    when one is symbolic (a dynamic batch)."""
    return _static_product(sch.get(block).iter_vars[:rows])


def _same_symbolic_rows(sch: s_tir.Schedule, infos: list[SBlockInfo]) -> bool:
    """Whether the blocks' leading spatial extents agree where they are symbolic. A pad after a
    layer norm over a symbolic image size (torchvision's Swin) has more rows than the norm:
    scheduled as one set of rows, the kernel was not well-formed."""
    rows = min(_leading_spatial(b) for b in infos)
    analyzer = Analyzer()
    last = sch.get(infos[-1].block_rv).iter_vars[:rows]
    for info in infos[:-1]:
        for iv, other in zip(sch.get(info.block_rv).iter_vars[:rows], last):
            extents = (iv.dom.extent, other.dom.extent)
            if None in map(static_extent, extents) and not analyzer.can_prove_equal(*extents):
                return False
    return True


def _static_product(iter_vars) -> int | None:
    """The product of the extents of ``iter_vars``; None when one is symbolic."""
    extents = [static_extent(iv.dom.extent) for iv in iter_vars]
    return None if None in extents else math.prod(extents)


def _long_row_chunks(
    sch: s_tir.Schedule, infos: list[SBlockInfo], rows: int, lanes: int, target: Target, work: int
) -> int:
    """How many parallel chunks to cut each row into: more than 1 for few, long rows only.

    When the rows are fewer than the target's cores (a group norm of 4-8 groups), each row is
    cut into chunks of at least :data:`MIN_CHUNK` elements, a whole number of vectors each:
    the fewest chunks whose busiest core does at most a tenth more vectors than the least
    possible (:func:`.parallel.row_chunks`). Every reduction and the last block must cover
    the same row length; injective blocks between them must be shorter than a vector (a
    group norm's per-channel ``gamma``). 1 (one task a row) otherwise.
    """
    cores = num_cores(target)
    last = infos[-1].block_rv
    count = _row_count(sch, last, rows)
    if not use_parallel(target, work) or count is None or count >= cores:
        return 1
    length = _row_length(sch, last, rows)
    if length % lanes:
        return 1
    for info in infos[:-1]:
        own = _row_length(sch, info.block_rv, rows)
        if info.is_injective() and own >= lanes:
            return 1
        if not info.is_injective() and (
            own != length or _row_count(sch, info.block_rv, rows) != count
        ):
            return 1
    return row_chunks(cores, count, length // lanes, min_tiles=-(-MIN_CHUNK // lanes))


def _schedule_long_rows(
    sch: s_tir.Schedule, infos: list[SBlockInfo], rows: int, lanes: int, chunks: int
) -> None:
    """Schedule few, long rows: each pass over the rows runs in parallel over (row, chunk).

    Every reduction accumulates one SIMD register of partial results per chunk of each row
    (``rfactor`` over the chunk and lane axes), in parallel over the rows and chunks; a
    serial loop then combines the ``chunks * lanes`` partials of each row. The last block
    runs in parallel over the rows and chunks, vectorised inside. Short injective blocks
    stay serial loops of their own.
    """
    for info in infos[:-1]:
        block = info.block_rv
        if info.is_injective():
            loops = sch.get_loops(block)
            if len(loops) > 1:
                sch.fuse(*loops)
            continue
        loops = sch.get_loops(block)
        red = sch.fuse(*loops[rows:]) if len(loops) > rows + 1 else loops[rows]
        chunk, inner, lane = sch.split(red, [chunks, None, lanes])
        sch.reorder(chunk, lane, inner)
        partial = sch.rfactor(sch.fuse(chunk, lane), factor_axis=rows)
        loops = sch.get_loops(partial)
        chunk, lane = sch.split(loops[rows], [chunks, lanes])
        inner = sch.get_loops(partial)[-1]
        sch.reorder(chunk, inner, lane)
        task = sch.fuse(*sch.get_loops(partial)[:rows], chunk)
        sch.parallel(task)
        sch.vectorize(lane)
        sch.decompose_reduction(partial, inner)
        combine = sch.get_loops(block)
        if len(combine) > 1:
            sch.fuse(*combine)
    last = infos[-1].block_rv
    loops = sch.get_loops(last)
    inner = sch.fuse(*loops[rows:]) if len(loops) > rows + 1 else loops[rows]
    chunk, _, vec = sch.split(inner, [chunks, None, lanes])
    task = sch.fuse(*sch.get_loops(last)[:rows], chunk)
    sch.parallel(task)
    sch.vectorize(vec)


def _row_length(sch: s_tir.Schedule, block: s_tir.schedule.SBlockRV, rows: int) -> int | None:
    """The number of elements one row of the reduction ``block`` reduces (None: symbolic)."""
    return _static_product(sch.get(block).iter_vars[rows:])


def _iterations(sch: s_tir.Schedule, block: s_tir.schedule.SBlockRV) -> int:
    total = 1
    for iv in sch.get(block).iter_vars:
        total *= nominal(iv.dom.extent)
    return total


def _inline(sch: s_tir.Schedule, infos: list[SBlockInfo]) -> None:
    """Inline prologue blocks (before the first reduction), per-row scalars and epilogues.

    Injective blocks with inner axes between two reductions (softmax's ``exp``) are kept, so
    that their value is computed once and read back from a row-sized buffer.
    """
    first = next(i for i, b in enumerate(infos) if not b.is_injective())
    last_red = max(i for i, b in enumerate(infos) if not b.is_injective())
    rows = min(_leading_spatial(b) for b in infos)
    for i, info in enumerate(infos):
        scalar = len(info.iters) <= rows
        if info.is_injective() and (i < first or (scalar and i != len(infos) - 1)):
            try:
                sch.compute_inline(info.block_rv)
            except ScheduleError:
                pass
    epilogue = [
        b for i, b in enumerate(infos) if i > last_red and b.is_injective() and len(b.iters) > rows
    ]
    for info in reversed(epilogue[1:]):
        if not _sole_consumer(sch, info.block_rv):
            continue
        try:
            sch.reverse_compute_inline(info.block_rv)
        except ScheduleError:
            pass


def _sole_consumer(sch: s_tir.Schedule, block: s_tir.schedule.SBlockRV) -> bool:
    """Whether ``block`` is the only reader of what its producers write. TVM's
    ``reverse_compute_inline`` does not check it: inlining ``isnan(p)`` into the softmax that
    wrote ``p`` dropped ``p``, which a ``where(isnan(p), 0, p)`` after it still read (GPT-2 with
    a symbolic length: ill-formed TIR, and the kernel fell to a rule at 1 % of peak)."""
    return all(len(sch.get_consumers(p)) == 1 for p in sch.get_producers(block))


def rfactor_lanes(
    sch: s_tir.Schedule, block: s_tir.schedule.SBlockRV, rows: int, lanes: int, tree: bool = True
) -> list[s_tir.schedule.SBlockRV] | None:
    """Split the reduction of ``block`` into ``lanes`` partial results, and with ``tree`` those
    into halves down to two (:func:`_halves`); return the partial-result blocks, the first one
    first.

    None (the reduction stays scalar) when the row is shorter than two vectors. Rows must be a
    multiple of ``lanes``: ``compute_at`` drops the predicate of a partial last chunk from an
    ``rfactor`` block (TVM 0.27), so the rule declines ragged rows; a kernel's producer can
    split them into a body and a tail (``relay_passes/fast_math.py`` does for softmax).
    """
    loops = sch.get_loops(block)[rows:]
    red = sch.fuse(*loops) if len(loops) > 1 else loops[0]
    extent = static_extent(sch.get(red).extent)
    if extent is None and not divisible(sch.get(red).extent, lanes):
        return None  # symbolic, not provably whole vectors: fast-math softmax's tail
    if extent is not None and extent < 2 * lanes:
        return None
    _, lane = sch.split(red, [None, lanes])
    # the lanes last in the partial-result buffer: a group of rows keeps each row's in a vector
    axis = len(sch.get(block).writes[0].source.shape)
    first = sch.rfactor(lane, factor_axis=axis)
    return [first, *_halves(sch, block, lanes, axis)] if tree else [first]


def _halves(
    sch: s_tir.Schedule, block: s_tir.schedule.SBlockRV, lanes: int, axis: int
) -> list[s_tir.schedule.SBlockRV]:
    """Combine the ``lanes`` partial results that ``block`` adds up as a tree: blocks of
    ``lanes / 2``, ``lanes / 4``, ... 2 partial results, each the sum of its producer's two
    halves; ``block`` then adds the last two.

    Added one by one, a row's 16 partial results were a chain of 15 dependent adds per row:
    a softmax over 8192 rows of 128 took 0.43 ms, now 0.33 (fp32, one thread, Zen5).
    """
    halves = []
    width = lanes // 2
    while width >= 2:
        lane = sch.get_loops(block)[-1]
        _, inner = sch.split(lane, [2, width])
        halves.append(sch.rfactor(inner, factor_axis=axis))
        width //= 2
    return halves


def _vector_partial(sch: s_tir.Schedule, partial: s_tir.schedule.SBlockRV, depth: int = 1) -> None:
    """Vectorise a partial-result block moved under its ``depth`` row loops: its init and its
    update.

    ``compute_at`` leaves its loops as ``row, lane, 1.., chunk``: the chunk loop goes outside
    and the lane loop is vectorised, the partial results staying in one register.
    """
    loops = sch.get_loops(partial)
    lane, chunk = loops[depth], loops[-1]
    sch.reorder(chunk, lane)
    sch.vectorize(lane)
    sch.decompose_reduction(partial, chunk)  # the init's copy of the lane loop stays vectorised


def place_partials(
    sch: s_tir.Schedule, partials: list, row: s_tir.schedule.LoopRV, depth: int
) -> None:
    """Move a reduction's partial-result blocks (:func:`rfactor_lanes`) under ``row``, the last
    first (each before its consumer), and vectorise them."""
    for partial in reversed(partials):
        sch.compute_at(partial, row, preserve_unit_loops=True)
        _vector_partial(sch, partial, depth)


def _vector_inner(
    sch: s_tir.Schedule,
    block: s_tir.schedule.SBlockRV,
    lanes: int,
    row_length: int = 0,
    depth: int = 1,
) -> None:
    """Vectorise the axes of ``block`` inside its ``depth`` row loops (fused). With
    ``row_length`` (rows handled in groups), only the trailing loops that cover one row of
    that many elements.

    A row that is no multiple of ``lanes`` is left as one plain loop: TVM would scalarise a
    predicated vector loop whole, while LLVM's loop vectoriser adds a scalar tail itself.
    """
    loops = sch.get_loops(block)
    inner = loops[depth:]
    if row_length:
        inner = _trailing(sch, loops[depth:], row_length)
    if not inner:
        return
    fused = sch.fuse(*inner) if len(inner) > 1 else inner[0]
    extent = static_extent(sch.get(fused).extent)
    if extent is None or extent < lanes or extent % lanes:
        return  # a symbolic extent too: LLVM's loop vectoriser adds the tail
    _, vec = sch.split(fused, [None, lanes])
    sch.vectorize(vec)


def _fuse_row_axes(sch: s_tir.Schedule, block: s_tir.schedule.SBlockRV, rows: int) -> None:
    """Make the ``rows`` leading axes of ``block`` one axis (row-major), the others kept."""
    extents = [static_extent(iv.dom.extent) for iv in sch.get(block).iter_vars]
    sch.transform_block_layout(block, _leading_fused(extents, rows))


def _writes_intermediate(sch: s_tir.Schedule, block: s_tir.schedule.SBlockRV) -> bool:
    """Whether ``block`` writes a buffer of the kernel's own (not one of its parameters)."""
    written = sch.get(block).writes[0].source
    return not any(written.same_as(p) for p in param_buffers(sch))


def _fuse_buffer_rows(sch: s_tir.Schedule, block: s_tir.schedule.SBlockRV, rows: int) -> None:
    """Make the leading (row) dimensions of the buffer ``block`` writes one dimension."""
    stmt = sch.get(block)
    spatial = sum(iv.iter_type == tirx.IterVar.DataPar for iv in stmt.iter_vars)
    shape = [static_extent(d) for d in stmt.writes[0].source.shape]
    lead = len(shape) - (spatial - rows)  # the dimensions the row axes index
    sch.transform_layout(block, ("write", 0), _leading_fused(shape, lead))


def _leading_fused(extents: list[int], lead: int) -> tirx.IndexMap:
    """The index map of ``extents`` that makes the ``lead`` leading axes one (row-major)."""

    def fuse(*axes):
        row = axes[0]
        for axis in range(1, lead):
            row = row * extents[axis] + axes[axis]
        return (row, *axes[lead:])

    return tirx.IndexMap.from_func(fuse, ndim=len(extents))


def _trailing(sch: s_tir.Schedule, loops: list, length: int) -> list:
    """The innermost of ``loops`` whose extents multiply to ``length`` ([] if none do)."""
    product = 1
    for index in range(len(loops) - 1, -1, -1):
        product *= static_extent(sch.get(loops[index]).extent) or 0
        if product == length:
            return loops[index:]
        if not product or product > length:
            return []
    return []
