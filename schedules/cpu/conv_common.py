"""NCHW conv2d analysis shared by the direct conv schedules: matching, tile choice, staging.

A (grouped) conv block is ``O[n, f, y, x] += D[n, f // Fg * Cg + c, y', x'] * W[f, c, ky, kx]``
with ``G`` groups of ``Fg`` output and ``Cg`` input channels (``G == 1``: a dense conv;
``Cg == 1, G == C``: depthwise with channel multiplier ``Fg``). Two register tilings exist:

* ``filters``: a vector runs over ``tile_f`` output channels of one group and the data is
  broadcast (:mod:`.conv`); good when ``Fg`` fills vectors;
* ``groups``: a vector runs over ``tile_g`` groups, all ``Fg`` channels of each unrolled, on
  data laid out with the groups innermost (:mod:`.grouped_conv`); good for depthwise convs and
  groups narrower than a vector;
* ``columns``: a vector runs over output columns of one channel plane, read from a padded copy
  of that plane (:mod:`.grouped_conv`); depthwise convs with unit column stride and wide rows.

:func:`choose_plan` takes ``columns`` where it applies, else scores the other two with one model
of the inner loop (FMAs and loads per reduction step) and returns the better.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from tvm import s_tir, tirx
from tvm.s_tir.dlight.analysis import get_root_block
from tvm.s_tir.dlight.gpu.matmul import get_reduction_blocks
from tvm.s_tir.schedule import LoopRV, SBlockRV
from tvm.sym import detect_linear_equation
from tvm.sym.analyzer import Analyzer
from tvm.target import Target

from .bf16_common import mark_preproc, reads_only_params
from .common import (
    inline_epilogue,
    nominal,
    num_cores,
    row_chunks,
    schedule_injective,
    use_parallel,
    vector_lanes,
)


@dataclass(frozen=True)
class ConvShape:
    """Extents of a matched conv block: output ``[n, f, oh, ow]``, ``groups``, ``fg``, ``cg``,
    and ``stride_x``, the input columns between output columns (0 when unknown)."""

    f: int
    oh: int
    ow: int
    groups: int
    fg: int
    cg: int
    stride_x: int = 0


@dataclass(frozen=True)
class TilePlan:
    """A register tiling: ``mode`` (``filters`` or ``groups``), the vector's channel or group
    count ``tile_v``, and the output rows and columns ``tile_y x tile_x`` of one tile."""

    mode: str
    tile_v: int
    tile_y: int
    tile_x: int
    score: float


def _index_vars(region) -> list[tirx.Var | None]:
    """Return each index of ``region`` when it is a bare variable, else ``None``."""
    return [rng.min if isinstance(rng.min, tirx.Var) else None for rng in region]


def match_conv2d(block: s_tir.SBlock) -> ConvShape | None:
    """Match ``O[n, f, y, x] += D[n, f // Fg * Cg + c, ., .] * W[f, c, ky, kx]``; its shape."""
    if len(block.reads) != 2 or len(block.writes) != 1 or len(block.iter_vars) != 7:
        return None
    kinds = "".join("S" if iv.iter_type == tirx.IterVar.DataPar else "R" for iv in block.iter_vars)
    if kinds != "SSSSRRR":
        return None
    n, f, y, x, c, ky, kx = (iv.var for iv in block.iter_vars)
    data, weight = block.reads
    if _index_vars(block.writes[0].region) != [n, f, y, x]:
        return None
    if _index_vars(weight.region) != [f, c, ky, kx] or len(data.region) != 4:
        return None
    if _index_vars(data.region)[0] != n:
        return None
    extents = [nominal(iv.dom.extent) for iv in block.iter_vars]  # the batch may be symbolic
    channels, cg = int(data.source.shape[1]), extents[4]
    if channels % cg or extents[1] % (channels // cg):
        return None
    groups = channels // cg
    fg = extents[1] // groups
    analyzer = Analyzer()
    for iv in block.iter_vars:
        analyzer.bind(iv.var, iv.dom)
    expected = tirx.floordiv(f, fg) * cg + c
    if not analyzer.can_prove_equal(data.region[1].min, expected):
        return None
    stride_x = _coefficient(data.region[3].min, x)
    return ConvShape(extents[1], extents[2], extents[3], groups, fg, cg, stride_x)


def _coefficient(index: tirx.PrimExpr, var: tirx.Var) -> int:
    """The constant factor of ``var`` in the linear ``index`` (0 when it is not one)."""
    coefficients = detect_linear_equation(index, [var])
    if len(coefficients) != 2 or not isinstance(coefficients[0], tirx.IntImm):
        return 0
    return int(coefficients[0].value)


def find_conv(sch: s_tir.Schedule) -> tuple[SBlockRV, ConvShape] | None:
    """Return the conv block of ``sch`` and its shape, when the function is one conv."""
    blocks = sch.get_child_blocks(get_root_block(sch))
    reductions = get_reduction_blocks(sch, blocks)
    if reductions is None or len(reductions) != 1:
        return None
    shape = match_conv2d(sch.get(reductions[0]))
    return None if shape is None else (reductions[0], shape)


def _divisors(extent: int, limit: int) -> list[int]:
    return [d for d in range(1, min(extent, limit) + 1) if extent % d == 0]


def vector_width(tile: int, lanes: int) -> int:
    """The largest power of two that divides ``tile`` and is at most ``lanes``.

    Vectors are powers of two: LLVM legalises a 40-wide float vector into a tangle of element
    inserts and spills, so a 40-channel tile is five 8-wide vectors instead.
    """
    return math.gcd(tile & -tile, lanes)


def _score(useful: float, weights: int, pixels: int) -> float:
    """Vector-FMA efficiency of one reduction step: ``weights * pixels`` FMAs on 2 ports, and
    ``weights + pixels`` loads on 3; ``useful`` is the fraction of vector lanes that count."""
    cycles = max(weights * pixels / 2, (weights + pixels) / 3)
    return useful * weights * pixels / 2 / cycles


def choose_plan(
    shape: ConvShape, lanes: int, registers: int, batch: int = 1, cores: int = 1
) -> TilePlan:
    """The best register tiling of ``shape`` with ``registers`` accumulator vectors.

    Pixel tiles are ``tile_y x tile_x`` with ``tile_y | oh`` and ``tile_x | ow``; a
    ``filters`` tile takes ``tile_f | Fg`` channels (``tile_f / vector_width`` vectors), a
    ``groups`` tile ``tile_g | G`` groups, a power of two (one vector per channel of the
    group). Ties go to the larger tile.

    With ``cores`` > 1, a ``filters`` tiling whose ``batch`` images have fewer tiles than
    cores (a narrow conv on a 7 x 7 image) gives way to the ``filters`` tiling of the least
    time on the busiest core (:func:`_spread_plan`).
    """
    columns = _columns_plan(shape, lanes, registers)
    if columns is not None:
        return columns
    plans = _scored_plans(shape, lanes, registers)
    best = max(plans, key=lambda pair: pair[0])[1]  # the first of the equal keys
    if cores > 1 and best.mode == "filters" and plan_tiles(shape, best, batch) < cores:
        filters = [p for _, p in plans if p.mode == "filters"]
        return _spread_plan(shape, best, filters, batch, cores)
    return best


def _scored_plans(shape: ConvShape, lanes: int, registers: int) -> list[tuple[tuple, TilePlan]]:
    """Every ``filters`` and ``groups`` tiling of :func:`choose_plan`, each with its sort key."""
    plans = []
    options = []
    for tile in _divisors(shape.fg, 3 * lanes):
        width = vector_width(tile, lanes)
        options.append(("filters", tile, tile // width, width / lanes))
    if shape.groups > 1 and shape.fg <= registers // 2:
        for tile in _divisors(shape.groups, lanes):
            if vector_width(tile, lanes) == tile:
                options.append(("groups", tile, shape.fg, tile / lanes))
    for mode, tile_v, weights, useful in options:
        for tile_y in _divisors(shape.oh, registers):
            for tile_x in _divisors(shape.ow, registers):
                if weights * tile_y * tile_x > registers:
                    continue
                plan = TilePlan(
                    mode, tile_v, tile_y, tile_x, _score(useful, weights, tile_y * tile_x)
                )
                plans.append(((round(plan.score, 3), tile_v * tile_y * tile_x, tile_x), plan))
    return plans


def plan_tiles(shape: ConvShape, plan: TilePlan, batch: int) -> int:
    """How many register tiles ``plan`` cuts ``batch`` images of ``shape`` into."""
    channels = shape.groups * shape.fg if plan.mode == "filters" else shape.groups
    pixels = (shape.oh // plan.tile_y) * (shape.ow // plan.tile_x)
    return batch * channels // plan.tile_v * pixels


def _spread_plan(
    shape: ConvShape, first: TilePlan, plans: list[TilePlan], batch: int, cores: int
) -> TilePlan:
    """The plan of ``plans`` whose busiest core, its tiles dealt out to ``cores``, takes the
    least time (tiles a core times tile work over efficiency); ties go to the earlier plan's
    larger tile, as in :func:`choose_plan`. ``first`` (the best plan on one core) stays unless
    that saves more than a tenth of its time: its tiles can be spread too, in column chunks."""

    def cost(plan: TilePlan) -> float:
        tiles = plan_tiles(shape, plan, batch)
        return round(-(-tiles // cores) / tiles / plan.score, 6)

    best = None
    for plan in plans:
        key = (-cost(plan), round(plan.score, 3), plan.tile_v * plan.tile_y * plan.tile_x)
        if best is None or key > best[0]:
            best = (key, plan)
    return best[1] if cost(first) > cost(best[1]) * _SPREAD_GAIN else first


def _columns_plan(shape: ConvShape, lanes: int, registers: int) -> TilePlan | None:
    """A ``columns`` tiling for a depthwise conv with unit column stride and rows of whole
    vectors of at least 8 columns: ``tile_v`` columns per vector, ``tile_x`` vectors per row,
    ``tile_y`` rows. None for other convs.

    Measured on Zen5 (one thread, depthwise 3x3 over 144 x 56 x 56): 91 us vectorised over the
    columns of a padded plane (8-wide vectors, 2 rows x 7 vectors), 162 us over 16 channels
    (the ``groups`` tiling, whose input copy transposes NCHW to channels-innermost).
    """
    width = vector_width(shape.ow, lanes)
    if (shape.cg, shape.fg, shape.stride_x) != (1, 1, 1) or width < _MIN_COLUMN_LANES:
        return None
    budget = registers * 2 // 3  # accumulators; the rest hold the tap's loads and weight
    vectors = max(_divisors(shape.ow // width, budget))
    tile_y = max(_divisors(shape.oh, max(1, budget // vectors)))
    return TilePlan("columns", width, tile_y, vectors, 1.0)


# The least saving (a factor of the busiest core's time) for which a conv with too few tiles
# for the cores takes a smaller tiling.
_SPREAD_GAIN = 1.1

# Fewest columns in a vector of the ``columns`` tiling (narrower rows vectorise the channels).
_MIN_COLUMN_LANES = 8


def stage_data(sch: s_tir.Schedule, conv: SBlockRV, dtype: str, always: bool) -> SBlockRV | None:
    """Return a block that writes the conv's (padded) input in ``dtype``, or None if not needed.

    The padding block, when there is one, becomes that block; otherwise a copy is made (when
    ``always`` or when the input is not ``dtype``: bf16/fp16 inputs are widened once, so the
    inner loop reads fp32).
    """
    data = sch.get(conv).reads[0].source
    producer = next((p for p in sch.get_producers(conv) if _writes(sch, p, data)), None)
    if producer is None and not always and str(data.dtype) == dtype:
        return None
    if producer is None or sch.get_producers(producer):
        producer = sch.cache_read(conv, 0, "global")
    if str(sch.get(producer).writes[0].source.dtype) != dtype:
        sch.unsafe_set_dtype(producer, 0, dtype)
    return producer


def _writes(sch: s_tir.Schedule, block: SBlockRV, buffer: tirx.Buffer) -> bool:
    return any(w.source.same_as(buffer) for w in sch.get(block).writes)


def pack_weight(sch: s_tir.Schedule, conv: SBlockRV, dtype: str, index_map) -> SBlockRV:
    """Copy the conv weight into the layout ``index_map`` (of ``f, c, ky, kx``), in ``dtype``.

    The copy is marked for :class:`.bf16_passes.SplitPreproc`, which moves it out of the
    kernel and evaluates it at compile time when the weight is a constant.
    """
    pack = sch.reindex(conv, ("read", 1))
    if str(sch.get(pack).writes[0].source.dtype) != dtype:
        sch.unsafe_set_dtype(pack, 0, dtype)
    sch.transform_layout(pack, ("write", 0), index_map)
    if reads_only_params(sch, pack):
        mark_preproc(sch, pack)
    return pack


def accumulate_dtype(sch: s_tir.Schedule, conv: SBlockRV) -> str:
    """The dtype the conv accumulates in (its output buffer's)."""
    return str(sch.get(conv).writes[0].source.dtype)


def tile_pixels(
    sch: s_tir.Schedule,
    conv: SBlockRV,
    plan: TilePlan,
    head: list,
    tail: list,
    fuse_rows: bool = True,
    chunks: int = 1,
) -> tuple[LoopRV, LoopRV]:
    """Order ``(*head, y/ty, x/tx, c, ky, kx, ty, tx, *tail)``, unroll ``ty, tx``.

    ``head`` and ``tail`` are the split channel loops, before the conv's last five loops
    ``y, x, c, ky, kx``; returns the fused outer loop (``*head, y/ty``, or only ``*head``
    when not ``fuse_rows``) and the column-tile loop. Not ``fuse_rows``, ``chunks`` > 1 cuts
    the row tiles into that many chunks (it divides them) and fuses the chunk loop into the
    outer loop: ``(*head, chunk), y/ty/chunks, ...``.
    """
    y, x, c, ky, kx = sch.get_loops(conv)[-5:]
    y_outer, y_inner = sch.split(y, [None, plan.tile_y])
    x_outer, x_inner = sch.split(x, [None, plan.tile_x])
    sch.reorder(*head, y_outer, x_outer, c, ky, kx, y_inner, x_inner, *tail)
    sch.unroll(y_inner)
    sch.unroll(x_inner)
    if fuse_rows:
        return sch.fuse(*head, y_outer), x_outer
    if chunks > 1:
        chunk, _ = sch.split(y_outer, [chunks, None])
        return sch.fuse(*head, chunk), x_outer
    return sch.fuse(*head), x_outer


def spread_columns(
    sch: s_tir.Schedule, conv: SBlockRV, outer: LoopRV, x_outer: LoopRV, target: Target
) -> tuple[LoopRV, LoopRV]:
    """Give a conv whose parallel ``outer`` loop has fewer tasks than the target's cores more:
    cut the column tiles ``x_outer``, directly inside it, into chunks (:func:`.row_chunks`) and
    fuse the chunk loop into ``outer``. Returns the new ``outer`` and column-tile loops (the
    same when ``outer`` has enough tasks or the conv runs serially).

    A conv1d as a height-1 conv2d has a single row tile: its 123 column tiles ran serially, in
    2 to 8 tasks, however many cores.
    """
    work = math.prod(nominal(iv.dom.extent) for iv in sch.get(conv).iter_vars)
    cores, tasks = num_cores(target), nominal(sch.get(outer).extent)
    if not use_parallel(target, work) or tasks >= cores:
        return outer, x_outer
    chunks = row_chunks(cores, tasks, int(sch.get(x_outer).extent))
    if chunks == 1:
        return outer, x_outer
    chunk, x_outer = sch.split(x_outer, [chunks, None])
    return sch.fuse(outer, chunk), x_outer


def finish(
    sch: s_tir.Schedule,
    conv: SBlockRV,
    outer: LoopRV,
    x_outer: LoopRV,
    acc_layout,
    target: Target,
    write_back: Callable[[s_tir.Schedule, SBlockRV], bool] | None = None,
) -> None:
    """Accumulate in a ``local`` tile laid out by ``acc_layout``, inline the epilogue into its
    write-back, parallelise ``outer`` and vectorise the blocks that feed the conv.

    ``write_back(sch, block)``, when given, schedules the write-back block and returns True, or
    returns False to leave it to the default (its innermost loop vectorised).
    """
    acc = sch.cache_write(conv, 0, "local")
    sch.transform_layout(conv, ("write", 0), acc_layout)
    sch.reverse_compute_at(acc, x_outer, preserve_unit_loops=True)
    inline_epilogue(sch, acc)
    if write_back is None or not write_back(sch, acc):
        sch.vectorize(sch.get_loops(acc)[-1])
    work = math.prod(nominal(iv.dom.extent) for iv in sch.get(conv).iter_vars)
    parallel = use_parallel(target, work)
    cores = num_cores(target)
    for block in _producers(sch, conv):  # the data copy, padding, dilation, weight packing
        if not _is_scheduled(sch, block) and not schedule_padding(sch, block, parallel, cores):
            schedule_injective(sch, block, vector_lanes(target), parallel)
    if parallel:
        sch.parallel(outer)  # before decompose_reduction, which breaks the check
    loops = [sch.get(loop) for loop in sch.get_loops(conv)]
    c_loop = sch.get_loops(conv)[[loop.same_as(sch.get(x_outer)) for loop in loops].index(True) + 1]
    init = sch.decompose_reduction(conv, c_loop)
    sch.vectorize(sch.get_loops(init)[-1])


def _producers(sch: s_tir.Schedule, block: SBlockRV) -> list[SBlockRV]:
    """Every block that ``block`` depends on, transitively, nearest first."""
    found, queue = [], list(sch.get_producers(block))
    while queue:
        producer = queue.pop(0)
        if not any(sch.get(producer).same_as(sch.get(b)) for b in found):
            found.append(producer)
            queue.extend(sch.get_producers(producer))
    return found


def _is_scheduled(sch: s_tir.Schedule, block: SBlockRV) -> bool:
    """Whether a loop of ``block`` is already vectorised, parallel or annotated (a tensorized
    copy imports its intrinsic with a loop annotation)."""
    loops = [sch.get(loop) for loop in sch.get_loops(block)]
    return any(loop.kind != tirx.ForKind.SERIAL or loop.annotations for loop in loops)


def schedule_padding(sch: s_tir.Schedule, block: SBlockRV, parallel: bool, cores: int = 1) -> bool:
    """Schedule a root-level NCHW padding copy ``P[n, c, y, x] = D[n, c, y - top, x - left]``
    (zero outside ``D``, cast or not) one plane at a time (planes in parallel when
    ``parallel``), its rows and columns of zeros looped apart from the input's and each row
    segment vectorised (:func:`vectorise_interior`). False (``sch`` untouched) for any other
    block.

    Fused and cut into vectors of 16, a padded plane's rows (30 for 28 x 28) did not line up
    with the vectors: each element's indices took an integer division and the copy ran
    element by element (a grouped 32 x 28 x 28 conv: 0.081 ms at O2, 0.048 at O0).

    In parallel with fewer planes than ``cores`` (a 3-channel image), the padded rows run in
    parallel too: the plane and row loops are fused, and only the columns are split apart.
    """
    stmt = sch.get(block)
    loops = sch.get_loops(block)
    if len(loops) != 4 or len(stmt.iter_vars) != 4 or len(stmt.reads) != 1:
        return False
    rows, cols = padding_interior(sch, block, 2), padding_interior(sch, block, 3)
    extents = [int(iv.dom.extent) for iv in stmt.iter_vars[2:]]
    if (rows[1], cols[1]) == tuple(extents):  # no padding: not this block
        return False
    plane = sch.fuse(*loops[:2])
    if parallel and nominal(sch.get(plane).extent) < cores:
        plane = sch.fuse(plane, loops[2])
        for segment in _partition(sch, sch.get_loops(block)[-1], *cols):
            sch.vectorize(segment)
        sch.parallel(plane)
        return True
    vectorise_interior(sch, block, rows, cols)
    if parallel:
        sch.parallel(plane)
    return True


def vectorise_interior(
    sch: s_tir.Schedule, block: SBlockRV, rows: tuple[int, int], cols: tuple[int, int]
) -> None:
    """Split a padding copy's two innermost loops (rows, columns) at the ``(first, count)``
    ``rows`` and ``cols`` that hold the input, and vectorise each row segment: the interior
    is then a plain vectorised copy, its bounds check simplified away, and only the edges
    keep theirs."""
    (top, height), (left, width) = rows, cols
    for index, row in enumerate(_partition(sch, sch.get_loops(block)[-2], top, height)):
        inner = sch.get_loops(_only_block(sch, row))[-1]
        if index == (1 if top else 0):
            for segment in _partition(sch, inner, left, width):
                sch.vectorize(segment)
        else:
            sch.vectorize(inner)


def _only_block(sch: s_tir.Schedule, loop: LoopRV) -> SBlockRV:
    (block,) = sch.get_child_blocks(loop)
    return block


def _partition(sch: s_tir.Schedule, loop: LoopRV, start: int, length: int) -> list[LoopRV]:
    """Split ``loop`` into ``[0, start)``, ``[start, start + length)`` and the rest (each part
    only when not empty)."""
    extent = int(sch.get(loop).extent)
    bounds = [b for b in (start, start + length) if 0 < b < extent]
    if not bounds:
        return [loop]
    factors = [bounds[0]] + [hi - lo for lo, hi in zip(bounds, bounds[1:])] + [None]
    return sch.loop_partition(loop, factors)


def padding_interior(sch: s_tir.Schedule, pad: SBlockRV, axis: int) -> tuple[int, int]:
    """``(first, count)`` of the padded plane's rows (``axis`` 2) or columns (3) that hold the
    input, from the padding block's read ``D[.., i - first, ..]`` (the whole axis when the
    block is not such a copy)."""
    block = sch.get(pad)
    read = block.reads[0]
    whole = 0, int(block.iter_vars[axis].dom.extent)
    if len(block.reads) != 1 or len(read.region) != len(block.iter_vars):
        return whole  # not a padding copy: nothing to split off
    offset = Analyzer().simplify(block.iter_vars[axis].var - read.region[axis].min)
    if not isinstance(offset, tirx.IntImm):
        return whole
    return int(offset), int(read.source.shape[axis])
