"""Shared helpers for the tvmamp CPU schedule rules."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

from tvm import DataType, s_tir, tirx
from tvm.s_tir.dlight.analysis import get_root_block
from tvm.s_tir.dlight.base import ScheduleRule
from tvm.s_tir.dlight.gpu.matmul import auto_inline_consumers
from tvm.s_tir.schedule import LoopRV, ScheduleError
from tvm.sym.analyzer import Analyzer
from tvm.target import Target
from tvm.target.codegen import target_has_features
from tvm.tirx.analysis import undefined_vars

from . import transpose_intrin as transpose
from .parallel import num_cores, row_chunks

# Vector register width in bits, by the widest x86 feature the target has.
_VECTOR_BITS_BY_FEATURE = (("avx512f", 512), ("avx2", 256), ("avx", 256))
_DEFAULT_VECTOR_BITS = 128
# Below this many scalar operations a parallel loop costs more than it saves.
PARALLEL_MIN_WORK = 1 << 16

logger = logging.getLogger("tvmamp.schedules")


def rule_schedule(func: tirx.PrimFunc) -> s_tir.Schedule:
    """A Schedule of ``func`` whose errors do not print the function.

    The rules try primitives and take a ``ScheduleError`` as "does not fit" (an inline that
    is refused, a rule that declines). By default TVM renders the whole function into each
    error's message: Mamba's unrolled scan makes elementwise kernels of hundreds of blocks,
    and the failed inlines of 22 of them took 125 of its 147 s build.
    """
    return s_tir.Schedule(func, error_render_level="none")


class CPURule(ScheduleRule):
    """Base class of the tvmamp CPU rules: applicable to ``llvm`` targets only."""

    def is_target_available(self, target: Target) -> bool:
        """Return whether ``target`` is an LLVM (CPU) target."""
        return target.kind.name == "llvm"

    #: Exceptions that mean the function does not fit this rule after all: ``schedule_block``
    #: then returns None and the next rule schedules the function.
    DOES_NOT_FIT: tuple = (ScheduleError,)

    def static_schedule(self, func: tirx.PrimFunc, target: Target) -> s_tir.Schedule | None:
        """A Schedule of ``func`` if this rule may apply: a PrimFunc, this target, and shapes
        the rule takes (:meth:`takes_shapes`)."""
        if not isinstance(func, tirx.PrimFunc) or not self.is_target_available(target):
            return None
        sch = rule_schedule(func)
        return sch if self.takes_shapes(sch) else None

    def takes_shapes(self, sch: s_tir.Schedule) -> bool:
        """Whether the rule schedules the function's shapes: static ones only, unless a rule
        handles symbolic extents itself."""
        return all_static(sch)

    def schedule_block(
        self,
        func: tirx.PrimFunc,
        target: Target,
        find: Callable[[s_tir.Schedule], s_tir.schedule.SBlockRV | None],
        schedule: Callable[[s_tir.Schedule, s_tir.schedule.SBlockRV], None],
    ) -> s_tir.Schedule | None:
        """The body of ``apply``: ``schedule`` the block ``find`` returns, or None.

        None when ``func`` is not a static-shape PrimFunc for this target, when ``find`` finds no
        block, or when scheduling raises ``NotApplicable`` or one of ``DOES_NOT_FIT``.
        """
        sch = self.static_schedule(func, target)
        block = find(sch) if sch is not None else None
        if block is None:
            return None
        try:
            schedule(sch, block)
        except (NotApplicable, *self.DOES_NOT_FIT) as err:
            logger.info("%s left a function to the next rule: %s", type(self).__name__, err)
            return None
        return sch

    def schedule_whole(
        self,
        func: tirx.PrimFunc,
        target: Target,
        schedule: Callable[[s_tir.Schedule, Target], bool],
    ) -> s_tir.Schedule | None:
        """The body of ``apply`` for a rule that looks at the whole function itself.

        ``schedule(sch, target)`` returns whether the function fits; None when it does not,
        when ``func`` is not a static-shape PrimFunc for this target, or when scheduling raises
        ``NotApplicable`` or one of ``DOES_NOT_FIT``.
        """
        sch = self.static_schedule(func, target)
        if sch is None:
            return None
        try:
            return sch if schedule(sch, target) else None
        except (NotApplicable, *self.DOES_NOT_FIT) as err:
            logger.info("%s left a function to the next rule: %s", type(self).__name__, err)
            return None


def vector_bits(target: Target) -> int:
    """Return the SIMD register width of ``target`` in bits (128 when unknown).

    Parameters
    ----------
    target : Target
        An ``llvm`` target; ``mcpu`` and ``mattr`` decide the features.

    Returns
    -------
    bits : int
        512 for AVX-512, 256 for AVX/AVX2, otherwise 128.
    """
    for feature, bits in _VECTOR_BITS_BY_FEATURE:
        try:
            if target_has_features(feature, target):
                return bits
        except (RuntimeError, ValueError):  # non-x86 triples know no x86 features
            return _DEFAULT_VECTOR_BITS
    return _DEFAULT_VECTOR_BITS


def vector_lanes(target: Target, dtype: str = "float32") -> int:
    """Return how many ``dtype`` elements fit in one SIMD register of ``target``."""
    return max(1, vector_bits(target) // DataType(dtype).bits)


def use_parallel(target: Target, work: int) -> bool:
    """Return whether a loop nest doing ``work`` scalar operations should run in parallel."""
    return num_cores(target) > 1 and work >= PARALLEL_MIN_WORK


def parallel_with_rows(
    sch: s_tir.Schedule, target: Target, outer: LoopRV, row_loop: LoopRV, work: int
) -> LoopRV | None:
    """Return the loop to run in parallel for a GEMM doing ``work``, or None (serial).

    ``outer`` runs the column tasks and ``row_loop``, directly inside it, the row tiles. When
    the column tasks are too few for the target's cores (:func:`row_chunks`), the row tiles are
    split into chunks and the chunk loop is fused into ``outer``. Call it before
    ``decompose_reduction``, which breaks ``sch.parallel``'s check.
    """
    if not use_parallel(target, work):
        return None
    rows = static_extent(sch.get(row_loop).extent)
    tasks = static_extent(sch.get(outer).extent)
    if rows is None or tasks is None:  # a symbolic batch or rows: the outer tasks alone
        return outer
    chunks = row_chunks(num_cores(target), tasks, rows)
    if chunks > 1:
        chunk, _ = sch.split(row_loop, [chunks, None])
        outer = sch.fuse(outer, chunk)
    return outer


# Largest left operand (bytes per batch, as the GEMM reads it) whose row tiles all walk each
# weight strip in turn; a larger one is walked in blocks of row tiles, each over the whole
# weight, so that the block stays in the last-level cache while the weight streams past
# (:func:`row_block_tiles`). Zen5, one thread, paired, bf16: 4096^3 407 -> 505 GFLOP/s,
# 2048 x 4096 x 4096 451 -> 506 (two threads: 804 -> 973, 866 -> 933); GEMMs whose left
# operand is 8-16 MiB with K <= 4096 unchanged.
A_BLOCK_BYTES = 8 << 20


def row_block_tiles(extents: list[int], tile_i: int, element_bytes: int) -> int | None:
    """Row tiles per block of the left operand of a ``[S, I, J, K]`` GEMM whose row tiles
    have ``tile_i`` rows of ``element_bytes`` values, when the operand exceeds
    :data:`A_BLOCK_BYTES`: the most that divide the row tiles and fit it. None when it fits,
    or when no divisor reaches half the fit (a block of a few tiles would stream the weight
    once for each)."""
    rows = -(-extents[1] // tile_i)
    tile_bytes = tile_i * extents[3] * element_bytes
    if rows * tile_bytes <= A_BLOCK_BYTES:
        return None
    fit = max(1, A_BLOCK_BYTES // tile_bytes)
    tiles = largest_divisor(rows, fit)
    return tiles if 2 * tiles >= fit else None


def static_extent(expr: tirx.PrimExpr) -> int | None:
    """Return ``expr`` as a Python int when it is a constant, else ``None``."""
    return int(expr.value) if isinstance(expr, tirx.IntImm) else None


# What a symbolic extent (a dynamic batch, the rows of one expert of a MoE layer) counts as
# where a schedule weighs work: enough to run in parallel, too few to block for the cache.
NOMINAL_EXTENT = 256


def nominal(extent) -> int:
    """``extent`` (an int or a PrimExpr) as an int: :data:`NOMINAL_EXTENT` when symbolic."""
    if isinstance(extent, int):
        return extent
    value = static_extent(extent)
    return NOMINAL_EXTENT if value is None else value


def divisible(extent, factor: int) -> bool:
    """Whether ``extent`` (an int or a PrimExpr) is provably a multiple of ``factor``."""
    if isinstance(extent, int):
        return extent % factor == 0
    return Analyzer().can_prove(tirx.floormod(extent, factor) == 0)


def param_buffers(sch: s_tir.Schedule) -> list[tirx.Buffer]:
    """The buffers among the parameters of the function ``sch`` schedules (not its size vars:
    in TVM 0.27 ``tirx.Buffer`` is ``tvm.ir.Var``, so ``isinstance`` admits those too)."""
    return [p for p in sch.mod["main"].params if tirx.is_buffer_var(p)]


def static_but_batch(sch: s_tir.Schedule) -> bool:
    """Whether every parameter buffer's shape is constant but for its leading axis, and each
    block's iterators have constant extents but for those over a leading axis (a model
    exported with a dynamic batch)."""
    if any(static_extent(d) is None for b in param_buffers(sch) for d in list(b.shape)[1:]):
        return False
    batch = {d for b in param_buffers(sch) for d in list(b.shape)[:1] if static_extent(d) is None}
    for block in sch.get_child_blocks(get_root_block(sch)):
        for iter_var in sch.get(block).iter_vars[1:]:
            if static_extent(iter_var.dom.extent) is None:
                return False
        first = sch.get(block).iter_vars[:1]
        if first and static_extent(first[0].dom.extent) is None:
            if not any(first[0].dom.extent.same_as(d) for d in batch):
                return False
    return True


def all_static(sch: s_tir.Schedule) -> bool:
    """Return whether every block iterator of the function has a constant extent."""
    root = get_root_block(sch)
    for block in sch.get_child_blocks(root):
        for iter_var in sch.get(block).iter_vars:
            if static_extent(iter_var.dom.extent) is None:
                return False
    return True


def is_reduction(block: s_tir.SBlock) -> bool:
    """Return whether ``block`` has a reduction (``CommReduce``) iterator."""
    return any(iv.iter_type == tirx.IterVar.CommReduce for iv in block.iter_vars)


MAX_WHOLE_VECTOR = 8
"""A loop that no vector width divides is vectorised as one TVM vector up to this many
registers; a longer one is left to LLVM's loop vectoriser, which hoists the loop's invariant
guards and adds a remainder loop. One TVM vector of 1500 bf16 (the padded copy of attention's
P over 1500 keys) copied at 8 GB/s, LLVM's loop at 31 GB/s."""


def vectorize_whole_or_leave(sch: s_tir.Schedule, loop, lanes: int) -> bool:
    """Vectorise ``loop`` as one vector if it spans at most :data:`MAX_WHOLE_VECTOR` registers
    of ``lanes``; return whether it did."""
    extent = static_extent(sch.get(loop).extent)
    if extent is None or extent > MAX_WHOLE_VECTOR * lanes:
        return False
    sch.vectorize(loop)
    return True


def largest_divisor(extent: int, limit: int) -> int:
    """Return the largest divisor of ``extent`` that is at most ``limit``."""
    for factor in range(min(extent, limit), 0, -1):
        if extent % factor == 0:
            return factor
    return 1


def try_inline_all(sch: s_tir.Schedule, blocks: list[s_tir.schedule.SBlockRV]) -> list:
    """Inline every block of ``blocks`` that can be inlined; return the rest.

    Each block is tried with ``compute_inline`` then ``reverse_compute_inline``, repeatedly,
    until no more progress is made.
    """
    remaining = list(blocks)
    progress = True
    while progress:
        progress = False
        for block in list(remaining):
            for inline in (sch.compute_inline, sch.reverse_compute_inline):
                try:
                    inline(block)
                except ScheduleError:
                    continue
                remaining.remove(block)
                progress = True
                break
    return remaining


class NotApplicable(Exception):
    """Raised inside a rule when the function turns out not to fit it; the rule returns None."""


# Rounds of inlining an epilogue's side inputs, one producer level each.
_MAX_INLINE_ROUNDS = 32


def inline_epilogue(sch: s_tir.Schedule, block: s_tir.schedule.SBlockRV) -> None:
    """Inline every consumer chain of ``block`` into it.

    Raises
    ------
    NotApplicable
        When a consumer cannot be inlined (it is not injective).
    """
    auto_inline_consumers(sch, block)
    # inline the consumers' other producers (ReLU's backward mask; Swin V2's 16 * sigmoid of
    # its position bias, a chain of 8 blocks), one level a round, until nothing moves
    for _ in range(_MAX_INLINE_ROUNDS):
        consumers = sch.get_consumers(block)
        if not consumers:
            break
        moved = False
        for consumer in consumers:
            for producer in sch.get_producers(consumer):
                if not sch.get(producer).same_as(sch.get(block)):
                    try:
                        sch.compute_inline(producer)
                        moved = True
                    except ScheduleError:
                        pass
        auto_inline_consumers(sch, block)
        if not moved:
            break
    if sch.get_consumers(block):
        raise NotApplicable("an epilogue block cannot be inlined")


def fuse_transposed_inner(sch: s_tir.Schedule, block: s_tir.schedule.SBlockRV) -> bool:
    """Fuse the innermost loops of a transposing copy that no read's last index uses.

    ``out[n, c, h, w] = rows[h * W + w, c]`` becomes ``[n, c, h * w]``, whose two innermost loops
    :func:`schedule_injective` then tiles in squares. Returns False (nothing done) when the
    block does not read a transposed operand or its loops were already transformed.

    A pure copy that :func:`.transpose_intrin.strided_copy` finds transposing (a reshape's
    ``((g * 160 + c) // 480 + p) % 196 // 14`` hides it from :func:`_reads_transposed`) first
    has its indices simplified (``x[0, g * 160 + c, p // 14, p % 14]``), and counts as
    transposed.
    """
    stmt = sch.get(block)
    loops = sch.get_loops(block)
    if len(loops) != len(stmt.iter_vars):
        return False
    strided = transpose.strided_copy(stmt) is not None
    if strided:
        stmt = _simplify_indices(sch, block)
    if not _reads_transposed(stmt):
        return strided
    loops = sch.get_loops(block)
    last = set()
    for read in stmt.reads:
        if read.region:  # a 0-d read (a scalar) has no last index
            last.update(undefined_vars(read.region[-1].min))
    count = 0
    for iv in reversed(stmt.iter_vars):
        if iv.var in last:
            break
        count += 1
    if count >= 2:
        sch.fuse(*loops[-count:])
    return True


def _simplify_indices(sch: s_tir.Schedule, block) -> s_tir.SBlock:
    """Simplify the buffer indices of ``block`` with its iterators' ranges (an identity
    ``transform_block_layout``); return the block, as it was when that does not apply."""
    count = len(sch.get(block).iter_vars)
    try:
        sch.transform_block_layout(block, tirx.IndexMap.from_func(lambda *v: list(v), ndim=count))
    except ScheduleError:
        pass
    return sch.get(block)


def _reads_transposed(stmt: s_tir.SBlock) -> bool:
    """Return whether a read of ``stmt`` uses its innermost iterator, but not in its last index."""
    if not stmt.iter_vars:
        return False
    inner = stmt.iter_vars[-1].var
    for read in stmt.reads:
        used = [inner in undefined_vars(rng.min) for rng in read.region]
        if any(used) and not used[-1]:
            return True
    return False


def tile_fma_gemm(
    sch: s_tir.Schedule,
    main: s_tir.schedule.SBlockRV,
    tile_i: int,
    tile_j: int,
    unroll_k: int,
    fuse_outer: bool = True,
) -> tuple:
    """Split a normalised ``[S, I, J, K]`` gemm into ``(S*J/tj, I/ti, K/uk, uk, ti, tj)`` loops.

    The register tile of the fp32 (FMA) matmul and GEMV rules: the inner three loops are
    unrolled, unrolled and vectorised. Returns the fused outer loop, the row-tile loop and the
    outer reduction loop.
    """
    s, i, j, k = sch.get_loops(main)
    i_outer, i_inner = sch.split(i, [None, tile_i])
    j_outer, j_inner = sch.split(j, [None, tile_j])
    k_outer, k_inner = sch.split(k, [None, unroll_k])
    sch.reorder(s, j_outer, i_outer, k_outer, k_inner, i_inner, j_inner)
    sch.unroll(k_inner)
    sch.unroll(i_inner)
    sch.vectorize(j_inner)
    return (sch.fuse(s, j_outer) if fuse_outer else j_outer), i_outer, k_outer


def vectorize_tile(sch: s_tir.Schedule, block: s_tir.schedule.SBlockRV) -> None:
    """Vectorise the column loop of a ``[.., rows, cols]`` tile block and unroll its rows.

    The register tile of the matmul rules: its accumulator block and, after
    ``decompose_reduction``, its initialisation.
    """
    row, col = sch.get_loops(block)[-2:]
    sch.vectorize(col)
    sch.unroll(row)


def _symbolic_rows(sch: s_tir.Schedule, loops: list, parallel: bool) -> None:
    """Leave a loop nest whose innermost extent is symbolic as it is, for LLVM's loop
    vectoriser (a vector loop and its tail), with the outermost loop parallel when
    ``parallel``. Fusing its loops into one and splitting out a vector of one lane, as before,
    made every index a ``//`` and ``%`` of products of symbolic sizes: XLNet's relative-shift
    reshape over ``(batch, heads, seq, 2 * seq - 1)`` then took 141 s to build (41 s with only
    the outer loops fused, 0.1 s left as it is)."""
    if parallel and len(loops) > 1:
        sch.parallel(loops[0])


def schedule_injective(
    sch: s_tir.Schedule, block: s_tir.schedule.SBlockRV, lanes: int, parallel: bool
) -> None:
    """Vectorise and parallelise a root-level spatial block.

    The innermost loop is split by ``lanes`` when it divides evenly; otherwise all loops are
    fused and split by the largest divisor of the total that fits in ``lanes``. A symbolic
    innermost extent leaves the nest to LLVM's loop vectoriser (:func:`_symbolic_rows`). A
    block that reads a transposed operand is tiled in squares of at most ``lanes``
    (:func:`_square_tile`) over its two innermost loops. The loops outside the vector are
    fused and, when ``parallel``, run in parallel; where an extent is symbolic, only the two
    outermost are fused, for the parallel loop (fused further, every index is a chain of
    ``//`` and ``%`` by symbolic sizes, which TVM's iter-map rewriter failed to lower over
    wav2vec 2.0's frames).

    With vectors of 16 elements or more, a transposing copy (or fp32 -> bf16 cast) of 16- or
    32-bit elements is copied by 16 x 16 register transposes (:mod:`.transpose_intrin`): in
    whole tiles over the two innermost loops when they are multiples of 16
    (:func:`_tensorize_transpose`), else over the whole nest with overlapping last tiles
    (:func:`_tensorize_strided`).
    """
    loops = sch.get_loops(block)
    extents = [static_extent(sch.get(loop).extent) for loop in loops]
    if extents[-1] is None:  # a symbolic innermost extent: LLVM's loop vectoriser takes it
        _symbolic_rows(sch, loops, parallel)
        return
    if None in extents[:1] and _transpose_over_batch(sch, block, extents, lanes, parallel):
        return
    if None in extents:  # a symbolic extent (a dynamic batch): the innermost loop is the vector
        vector = largest_divisor(extents[-1], lanes)
        vec_outer, vec = sch.split(loops[-1], [None, vector])
        sch.vectorize(vec)
        outer = [*loops[:-1], vec_outer]
        if parallel:  # the two outermost loops: fusing more makes every index a // and % chain
            sch.parallel(sch.fuse(*outer[:2]) if len(outer) > 1 else outer[0])
        return
    square = _square_tile(extents, lanes) if len(loops) > 1 else None
    transposed = square is not None and _reads_transposed(sch.get(block))
    if lanes >= transpose.SIDE:
        if transposed and square == transpose.SIDE:
            found = _tensorize_transpose(sch, block, extents)
            if found is not None:
                llvm_ir, tile = found
                fused = sch.fuse(*sch.get_loops(tile))
                if parallel:
                    sch.parallel(fused)
                sch.annotate(fused, "pragma_import_llvm", llvm_ir)
                return
        if _tensorize_strided(sch, block, parallel):
            return
    if transposed:
        outer, vec = _tile_square(sch, loops, square)
    elif extents[-1] % lanes == 0:
        vec_outer, vec = sch.split(loops[-1], [None, lanes])
        outer = [*loops[:-1], vec_outer]
    else:
        factor = largest_divisor(math.prod(extents), lanes)
        vec_outer, vec = sch.split(sch.fuse(*loops), [None, factor])
        outer = [vec_outer]
    sch.vectorize(vec)
    fused = sch.fuse(*outer)
    if parallel:
        sch.parallel(fused)


# Square tiles of a transposing copy: 8 x 8 to 16 x 16 elements. Measured on Zen5 (one
# thread, bf16 1024 x 1024): 16 x 16 tiles copy at 17.5 GB/s, 32 x 32 tiles at 5.5 GB/s.
_MIN_SQUARE = 8
_MAX_SQUARE = 16


def _square_tile(extents: list, lanes: int) -> int | None:
    """The side of the square tile of a transposing copy over the two innermost loops.

    The largest power of two from ``min(lanes, 16)`` down to ``min(lanes, 8)`` that divides both
    extents; else ``min(lanes, 16)`` with partial tiles at the edges when both extents are at
    least ``min(lanes, 8)``; else None.

    A bf16 ``[3136, 144]`` transpose (MobileNetV2's layout change) used to need whole 32-lane
    registers (144 % 32 != 0) and fell back to an element-wise copy at 6.8 GB/s; its 16 x 16
    tiles copy at 18-21 GB/s. SqueezeNet's bf16 ``[12321, 64]`` (111 x 111 pixels)
    copies at 14.9 GB/s in 16 x 16 tiles with a partial last column of tiles, against 5.0 GB/s
    element-wise.
    """
    top, bottom = min(lanes, _MAX_SQUARE), min(lanes, _MIN_SQUARE)
    if top < 2:  # scalar stores (bf16 constant fills): nothing to tile
        return None
    side = top
    while side >= bottom:
        if extents[-1] % side == 0 and extents[-2] % side == 0:
            return side
        side //= 2
    return top if min(extents[-2:]) >= bottom else None


def _transpose_over_batch(sch: s_tir.Schedule, block, extents: list, lanes: int, parallel: bool):
    """A transposing copy whose only symbolic loop is the outermost (a dynamic batch): its two
    innermost loops tiled in squares as for static shapes (16 x 16 register transposes where
    they apply), its two outermost loops fused, in parallel when ``parallel``. Returns False,
    ``sch`` unchanged, where that does not apply."""
    if None in extents[1:] or len(extents) < 3:
        return False
    square = _square_tile(extents, lanes)
    if square is None or not _reads_transposed(sch.get(block)):
        return False
    found = None
    if lanes >= transpose.SIDE and square == transpose.SIDE:
        found = _tensorize_transpose(sch, block, extents)
    if found is not None:
        llvm_ir, tile = found
        outer = sch.get_loops(tile)
    else:
        outer, vec = _tile_square(sch, sch.get_loops(block), square)
        sch.vectorize(vec)
    fused = sch.fuse(*outer[:2])
    if parallel:
        sch.parallel(fused)
    if found is not None:
        sch.annotate(fused, "pragma_import_llvm", llvm_ir)
    return True


def _tensorize_transpose(sch: s_tir.Schedule, block, extents: list) -> tuple | None:
    """Tile the two innermost loops by 16 x 16 and copy each tile with :mod:`.transpose_intrin`.

    Only whole tiles of a bare copy of 16- or 32-bit elements, or of an fp32 -> bf16 cast.
    Returns the LLVM IR the kernel must import and the tensorized tile block (under the
    tiles' outer loops), or None with ``sch`` unchanged.
    """
    stmt = sch.get(block)
    if len(stmt.reads) != 1 or any(e is None or e % transpose.SIDE for e in extents[-2:]):
        return None
    src, dst = str(stmt.reads[0].source.dtype), str(stmt.writes[0].source.dtype)
    found = transpose.transpose_intrin(src, dst)
    if found is None:
        return None
    intrin, llvm_ir = found

    def tensorize(target: s_tir.Schedule):
        _tile_square(target, target.get_loops(block), transpose.SIDE)
        tile = target.blockize(target.get_loops(block)[-2])
        target.tensorize(tile, intrin)
        return tile

    try:
        tensorize(sch.copy())  # a failed tensorize must leave no trace in ``sch``
    except (ScheduleError, ValueError, KeyError):
        return None
    return llvm_ir, tensorize(sch)


def _tensorize_strided(sch: s_tir.Schedule, block, parallel: bool) -> bool:
    """Copy a transposing copy with 16 x 16 register transposes over its whole loop nest.

    For pure copies and fp32 -> bf16 casts only (:func:`.transpose_intrin.strided_copy`):
    extents that are not multiples of 16 (196 or 49 pixels), a group axis between the
    transposed ones (``[196, 3, 160]`` from ``[480, 196]``), reshapes' ``//`` and ``%``. The
    loop nest is blockized and tensorized by :func:`.transpose_intrin.strided_copy_intrin`,
    whose outer loop runs in parallel when ``parallel``. Returns False with ``sch`` unchanged
    when the block is not such a copy or does not fit.
    """
    copy = transpose.strided_copy(sch.get(block))
    if copy is None:
        return False

    def nest(target: s_tir.Schedule):
        loops = target.get_loops(block)
        if not loops or len(target.get_child_blocks(loops[0])) != 1:
            raise NotApplicable("the block shares its loop nest")
        return target.blockize(loops[0], preserve_unit_iters=False)

    try:
        trial = sch.copy()  # a failed tensorize must leave no trace in ``sch``
        outer = nest(trial)
        intrin = transpose.strided_copy_intrin(copy, _realize(trial, outer), parallel)
        if intrin is None:
            return False
        trial.tensorize(outer, intrin)
    except (NotApplicable, RuntimeError, ValueError, KeyError) as err:  # ScheduleError, TVM's
        logger.info("a transposing copy keeps the vector copy: %s", err)
        return False
    sch.tensorize(nest(sch), intrin)
    return True


def _realize(sch: s_tir.Schedule, block) -> s_tir.SBlockRealize:
    """The ``SBlockRealize`` of ``block``, a block of the function's root scope."""
    target = sch.get(block)
    stack = [sch.get(get_root_block(sch)).body]
    while stack:
        node = stack.pop()
        if isinstance(node, s_tir.SBlockRealize):
            if node.block.same_as(target):
                return node
            stack.append(node.block.body)
        elif isinstance(node, tirx.SeqStmt):
            stack.extend(node.seq)
        elif hasattr(node, "body"):
            stack.append(node.body)
    raise NotApplicable("no realize of the block")


def _tile_square(sch: s_tir.Schedule, loops: list, lanes: int) -> tuple[list, object]:
    """Tile the two innermost ``loops`` by ``lanes x lanes``; return the outer loops and vector."""
    row_outer, row_inner = sch.split(loops[-2], [None, lanes])
    col_outer, vec = sch.split(loops[-1], [None, lanes])
    sch.reorder(row_outer, col_outer, row_inner, vec)
    return [*loops[:-2], row_outer, col_outer], vec
