"""bf16 matmul, dense and batch-matmul on ``vdpbf16ps`` with pair-interleaved packed weights."""

from __future__ import annotations

import math
from dataclasses import dataclass

import tvm
from tvm import s_tir, tirx
from tvm.s_tir.dlight.analysis import get_root_block
from tvm.s_tir.dlight.gpu.matmul import auto_inline_producers
from tvm.s_tir.schedule import SBlockRV, ScheduleError
from tvm.target import Target
from tvm.tirx.analysis import undefined_vars

from tvmamp.relay_passes.conv2d_im2col import GATHER_ATTR

from ..guard import Guarded
from ..x86 import bf16_intrin as intrin
from . import bf16_amx as amx
from . import prefetch
from .bf16_common import (
    PACK_PAIRS,
    PACK_PAIRS_T,
    PREPROC,
    bf16_dot_at_half_rate,
    has_amx_bf16,
    has_avx512bf16,
    is_bf16_matmul,
    k_is_innermost,
    mark_preproc,
    reads_only_params,
)
from .bf16_conv import find_conv_gemm, has_gather
from .common import (
    CPURule,
    NotApplicable,
    divisible,
    inline_epilogue,
    is_reduction,
    nominal,
    parallel_with_rows,
    param_buffers,
    row_block_tiles,
    static_extent,
    use_parallel,
    vectorize_tile,
    vectorize_whole_or_leave,
)
from .matmul import CPUMatmul
from .matmul_analysis import find_matmul_block, iter_kinds, normalize
from .parallel import num_cores


class CPUMatmulBF16(CPURule):
    """``C[S, I, J] += A[S, I, K] * B[S, J, K]`` with bf16 ``A``, ``B`` and fp32 ``C``.

    ``B`` is packed to ``[S, J / 16, K / 2, 16, 2]`` (the pair-interleaved layout of
    ``vdpbf16ps``) by a separate pre-processing function: ``SplitLayoutRewritePreproc`` splits
    it out and ``FoldConstant`` runs it at compile time when ``B`` is a weight. ``I`` is padded
    to whole row tiles, ``J`` to whole vectors and ``K`` to pairs; a padded (or transposed)
    ``A`` is copied by another pre-processing function. Each ``tile_i x 16 * vectors_j``
    accumulator tile is a ``local`` buffer held in zmm registers and the fused epilogue runs on
    it. Only targets with avx512_bf16. ``S`` and ``I`` may be symbolic (a dynamic batch, the
    rows of one expert of a MoE layer) where ``I`` is provably whole row tiles
    (:mod:`tvmamp.relay_passes.symbolic_rows` pads it so): TVM keeps no bf16 buffer in a kernel
    (docs/CPU_BF16.md), so ``A`` must be read in place. Such a kernel runs on ``vdpbf16ps``, not
    AMX; ``J`` and ``K`` are static.
    """

    @dataclass
    class Config:
        """Tile sizes (the knobs meta_schedule may tune, see :mod:`.bf16_tuning`).

        Attributes
        ----------
        tile_i : int
            Rows of the register tile (unrolled); ``tile_i * vectors_j`` accumulators. One
            fewer where that pads fewer rows (:func:`make_plan`).
        vectors_j : int
            Columns of the register tile, in 16-lane fp32 vectors.
        gemv_rows : int
            At most this many rows (batch 1, GEMV) are not padded: the tile takes all rows
            and ``gemv_vectors_j`` vectors, streaming the weight once.
        gemv_vectors_j : int
            Columns of the register tile for GEMV-like shapes, in vectors.
        amx : bool
            Use the AMX kernel (:mod:`tvmamp.schedules.x86.amx_intrin`) where the target has
            AMX-BF16.
        amx_min_rows : int
            Fewest rows for which the AMX kernel is used (it pads rows to 32). On Emerald
            Rapids AMX ran 8 to 24 rows 1.9-6x faster than ``vdpbf16ps``, and 4 rows equally.
        amx_n_block : int or None
            AMX: columns (a multiple of 32) whose packed weight slice stays in cache while
            every 32-row block of the activation walks it. None: at most 512 with K blocks
            of at most 1024 where their fp32 accumulator fits 512 KiB, else K blocks up to
            ``amx_k_block`` and a 1 MiB weight slice (:func:`.bf16_amx.make_plan`).
        amx_k_block : int
            AMX: reduction values (a multiple of 32) per kernel call; a longer ``K`` is cut
            into blocks that accumulate in memory.
        wide_tile : (int, int) or None
            ``(rows, vectors)`` of a register tile of fewer rows and more columns, taken where
            ``tile_i`` does not divide the rows and this one pads no more rows or columns than
            the one :func:`make_plan` would take (measured beside
            :data:`MIN_SHORTER_ACCUMULATORS`); None: never.
        fma_min_rows : int
            On a CPU whose ``vdpbf16ps`` does half the FLOPs of its fp32 FMAs
            (:func:`.bf16_common.bf16_dot_at_half_rate`: Intel's), a GEMM of at least this
            many static rows that does not go to AMX is left to the generic rule, which widens
            bf16 to fp32 and multiplies with FMAs (:meth:`CPUMatmulBF16.leaves_to_fma`).
        """

        tile_i: int = 8
        vectors_j: int = 2
        gemv_rows: int = 4
        gemv_vectors_j: int = 4
        amx: bool = True
        amx_min_rows: int = 8
        amx_n_block: int | None = None
        amx_k_block: int = 4096
        wide_tile: tuple[int, int] | None = (6, 4)
        fma_min_rows: int = 8

    # The generic rule (widen + FMA) schedules what this rule gives up on.
    DOES_NOT_FIT = (ScheduleError, tvm.error.InternalError)

    def __init__(self, config: Config | None = None):
        self.config = config or self.Config()

    def is_target_available(self, target: Target) -> bool:
        """Return whether ``target`` is an LLVM target with avx512_bf16."""
        return super().is_target_available(target) and has_avx512bf16(target)

    def takes_shapes(self, sch: s_tir.Schedule) -> bool:
        """Any shapes: :func:`gemm_extents` and :func:`make_plan` refuse what cannot be
        scheduled."""
        return True

    def apply(  # pylint: disable=missing-function-docstring
        self, func: tirx.PrimFunc, target: Target, _: bool
    ) -> s_tir.Schedule | None:
        if self.leaves_to_fma(func, target):
            return None
        return self.schedule_block(
            func,
            target,
            _bf16_gemm,
            lambda sch, main: schedule_matmul(sch, main, target, self.config),
        )

    def leaves_to_fma(self, func: tirx.PrimFunc, target: Target) -> bool:
        """Whether ``func``'s GEMM is left to the generic rule's fp32 FMAs: on a target whose
        ``vdpbf16ps`` runs at half rate (:func:`.bf16_common.bf16_dot_at_half_rate`), a GEMM
        that does not go to AMX, with at least ``fma_min_rows`` static rows (fewer: a GEMV,
        bound by reading the weight, not by the multiplies), that is no conv's im2col GEMM
        (the generic rule does not gather), and that the generic rule schedules.

        Zen5 runs both paths at full rate; there (one thread, paired, BENCHMARKS.md "Intel
        without AMX") the generic rule ran bf16 GEMMs of 128-1024 rows at 85-93 % of the fp32
        FMA peak and of 8-16 rows at 53-62 %, this rule at 82-98 % and 35-86 % of the
        ``vdpbf16ps`` peak. At Intel's peaks (FMA twice ``vdpbf16ps``) that makes the FMAs
        1.3-2.1x faster from 8 rows; at 4 rows and fewer this rule stays ahead.
        """
        if not bf16_dot_at_half_rate(target):
            return False
        sch = s_tir.Schedule(func)
        main = _bf16_gemm(sch)
        if main is None or has_gather(sch):
            return False
        shared = shared_operands(sch, main)
        try:
            normalize(sch, main)
            extents = gemm_extents(sch.get(main))
        except (NotApplicable, *self.DOES_NOT_FIT):
            return False
        rows = extents[1]
        if not isinstance(rows, int) or rows < self.config.fma_min_rows:
            return False
        if use_amx(target, extents, self.config) and 0 not in shared:
            return False
        # as the rule list runs it: a failure or an ill-formed result is "does not apply"
        return Guarded(CPUMatmul()).apply(func, target, False) is not None


def _bf16_gemm(sch: s_tir.Schedule) -> SBlockRV | None:
    """The bf16 x bf16 -> fp32 gemm block of ``sch``, or None."""
    main = find_gemm(sch)
    return main if main is not None and is_bf16_matmul(sch.get(main)) else None


def shared_operands(sch: s_tir.Schedule, main: SBlockRV) -> frozenset[int]:
    """The operands of ``main`` (0: ``A``, 1: ``B``) that another block also reads.

    An operand whose packing or padded copy is split out of the kernel is replaced by it among
    the kernel's parameters, so another reader (``x + x @ w``, torch's ``baddbmm(x, x, ...)``)
    would be left without it ("Buffer lv is used before its definition" when lowered):
    :func:`prepare` refuses to split such an operand.
    """
    operands = [r.source for r in sch.get(main).reads]
    shared = set()
    for block in sch.get_child_blocks(get_root_block(sch)):
        if sch.get(block).same_as(sch.get(main)):
            continue
        for read in sch.get(block).reads:
            shared.update(i for i, buf in enumerate(operands) if buf.same_as(read.source))
    return frozenset(shared)


def find_gemm(sch: s_tir.Schedule) -> SBlockRV | None:
    """Return the gemm block this rule schedules: that of a matmul or of a conv GEMM kernel.

    A conv GEMM's im2col gather stays a producer (:func:`.bf16_conv.find_conv_gemm`), to be
    inlined into the copy of ``A`` by :func:`prepare`, and so does the fp32 -> bf16 rounding of
    a run-time weight (:mod:`tvmamp.relay_passes.weight_transpose`), to be inlined into the
    packing of ``B``; other producers are inlined into the gemm.
    """
    if has_gather(sch):
        return find_conv_gemm(sch)
    return _gemm_of_rounded_weight(sch) or find_matmul_block(sch, keep_gathers=True)


def _gemm_of_rounded_weight(sch: s_tir.Schedule) -> SBlockRV | None:
    """The gemm block of a kernel that rounds one of its fp32 operands to bf16 itself."""
    blocks = sch.get_child_blocks(get_root_block(sch))
    reductions = [b for b in blocks if is_reduction(sch.get(b))]
    if len(reductions) != 1:
        return None
    (main,) = reductions
    producers = sch.get_producers(main)
    casts = [p for p in producers if _rounds_to_bf16(sch.get(p))]
    if len(casts) != 1 or len(producers) != 1:
        return None
    return main if iter_kinds(sch.get(main)) is not None else None


def _rounds_to_bf16(block: s_tir.SBlock) -> bool:
    """A spatial block writing bf16 from one fp32 read (``weight.astype("bfloat16")``)."""
    spatial = all(iv.iter_type == tirx.IterVar.DataPar for iv in block.iter_vars)
    reads = [str(r.source.dtype) for r in block.reads]
    return spatial and reads == ["float32"] and str(block.writes[0].source.dtype) == "bfloat16"


@dataclass
class Plan:
    """Tile sizes of one normalised bf16 matmul ``[S, I, J, K]``."""

    extents: list[int]
    tile_i: int
    tile_j: int
    rows_outside: bool = False

    @property
    def padding(self) -> list[int]:
        """The ``pad_einsum`` factors: whole row tiles, whole column tiles, ``K`` pairs."""
        return [1, self.tile_i, self.tile_j, intrin.PAIR]

    @property
    def needs_padding(self) -> bool:
        return not all(divisible(e, p) for e, p in zip(self.extents, self.padding, strict=True))


# Rows of a row-major ``B[K, J]`` that its packing reads before moving down: it walks them
# across all 32-column blocks, then the next rows. Against one column block down all of K, a
# run-time 4096 x 1024 weight packed in 0.35 instead of 0.52 ms and 1024 x 4096 in 0.30
# instead of 0.49 (Zen5, paired; 4 and 32 rows were slower, 1024 x 512 unchanged).
PACK_BLOCK_ROWS = 16
# Fewest accumulators of a register tile one row shorter than the configured one: 7 x 2 hides
# the vdpbf16ps latency, 6 x 2 did not (a 49-row GEMM ran 6 % slower than padded to 8 rows).
MIN_SHORTER_ACCUMULATORS = 14
# The wide tile (``Config.wide_tile``, 6 rows x 4 vectors: 24 accumulators, 4 weight vectors and a
# broadcast, 29 of the 32 zmm registers) against the 8 x 2 and 7 x 2 ones where 8 does not divide
# the rows. Zen5, one thread, paired in one process, GFLOP/s with W constant / at run time:
# 257 x 4096 x 1024: 8 x 2 489 / 448, 7 x 2 487 / 445, 6 x 4 509 / 458; 257 x 2048 x 1024:
# 503 / 473, 502 / 463, 522 / 490; 197 x 384 x 1152: 521 / 494, 496 / 471, 529 / 500. Where 8
# divides the rows, 8 x 2 reads A in place and 6 x 4 was 1-5 % slower (128 x 768 x 3072,
# 512^3, 1024^3, 3136 x 64 x 256); 49 rows keep 7 x 2 (none padded).
# Row tiles outside the column tiles (:func:`tile`: each row tile walks the whole packed
# weight, instead of each weight strip walking all row tiles) for a GEMM whose epilogue reads an
# fp32 operand the size of its output, at least ROWS_OUTSIDE_OUTPUT_BYTES of it, with a packed
# weight (``K x J`` bf16, per batch) of at most ROWS_OUTSIDE_WEIGHT_BYTES. Both orders read one
# operand from L2 at the same rate per vdpbf16ps, but walking rows reads the epilogue's operand
# and writes the result row after row, where a weight strip reads a 64-byte column of every row
# of them, each a cache miss the prefetchers do not foresee. That is training's weight-gradient
# GEMM, fused with the SGD update of the fp32 weight. Zen5, one thread, paired, the O2 step of
# 9 x Linear(512), batch 128 (K = 128): 4.96 -> 4.72, 5.06 -> 4.81, 4.77 -> 4.59 ms; batch 256:
# 8.97 -> 8.56; Linear(1024): 21.88 -> 20.34; two threads: 3.70 -> 3.33. With every GEMM of a
# small weight walking rows, whole inference models at O2 ran 1.5-14 % slower (ResNet-50,
# MobileNetV2, DenseNet-121, ShuffleNet, BERT, ViT-S): their 1x1 convs and attention GEMMs,
# which have no such operand, keep the strips.
ROWS_OUTSIDE_WEIGHT_BYTES = 512 << 10
ROWS_OUTSIDE_OUTPUT_BYTES = 512 << 10


def make_plan(
    extents: list[int],
    config: CPUMatmulBF16.Config,
    output_operand: bool = False,
    cores: int = 1,
) -> Plan:
    """Choose the register tile for ``extents = [S, I, J, K]``, and the loop order.

    The tile has ``config.tile_i`` rows, or one fewer where that pads fewer rows and keeps
    :data:`MIN_SHORTER_ACCUMULATORS`: the 49 rows of a 7 x 7 feature map take 7 tiles of 7
    rows, not 56 padded rows (10 % faster), and with no padding ``A`` is read in place. Where
    that tile still pads the rows, ``config.wide_tile`` takes its place if it pads no more rows
    or columns (257 x 4096 x 1024: 43 tiles of 6 x 64, 4 % faster than 37 of 7 x 32), and, for a
    GEMM that runs on ``cores`` > 1 (:func:`plan_cores`), leaves at least that many column
    tiles, the parallel tasks. Row tiles go outside the column tiles for an epilogue that reads
    an ``output_operand`` (an fp32 tensor the size of the output) where the sizes fit
    (:data:`ROWS_OUTSIDE_WEIGHT_BYTES`).
    """
    rows = extents[1]
    symbolic = not isinstance(rows, int)
    gemv = not symbolic and rows <= config.gemv_rows
    vectors = config.gemv_vectors_j if gemv else config.vectors_j
    while vectors > 1 and intrin.LANES * (vectors // 2) >= extents[2]:
        vectors //= 2
    if symbolic:
        return Plan(
            extents=extents, tile_i=_symbolic_tile(rows, config), tile_j=intrin.LANES * vectors
        )
    tile_i = rows if gemv else min(config.tile_i, rows)
    shorter = tile_i - 1
    if shorter * vectors >= MIN_SHORTER_ACCUMULATORS and _padded(rows, shorter) < _padded(
        rows, tile_i
    ):
        tile_i = shorter
    if not gemv and config.wide_tile is not None:
        tile_i, vectors = _wide(rows, extents[2], tile_i, vectors, config.wide_tile, cores)
    tile_j = intrin.LANES * vectors
    rows_outside = output_operand and not gemv and _walks_rows(extents, tile_i, tile_j)
    return Plan(extents, tile_i, tile_j, rows_outside)


def _wide(
    rows: int, cols: int, tile_i: int, vectors: int, wide: tuple[int, int], cores: int
) -> tuple:
    """``wide`` (rows, vectors) in place of the tile ``tile_i x vectors`` where that one pads
    the rows and ``wide`` pads no more rows and no more columns, and has a column tile for
    each of ``cores``; else the tile as it is."""
    wide_i, wide_vectors = wide
    wide_cols = intrin.LANES * wide_vectors
    if rows % tile_i == 0 or rows <= wide_i or _padded(rows, wide_i) > _padded(rows, tile_i):
        return tile_i, vectors
    if _padded(cols, wide_cols) > _padded(cols, intrin.LANES * vectors):
        return tile_i, vectors
    if cores > 1 and _padded(cols, wide_cols) // wide_cols < cores:
        return tile_i, vectors  # the row tiles would be split among the cores instead
    return wide_i, wide_vectors


def plan_cores(target: Target, extents: list) -> int:
    """The cores a GEMM of ``extents`` runs on (:func:`.common.use_parallel`), for
    :func:`make_plan`."""
    work = math.prod(nominal(e) for e in extents)
    return num_cores(target) if use_parallel(target, work) else 1


def _walks_rows(extents: list, tile_i: int, tile_j: int) -> bool:
    """Whether each row tile of a GEMM with an output-sized epilogue operand walks the whole
    packed weight: static ``J`` and ``K``, more than one row tile, and the sizes of
    :data:`ROWS_OUTSIDE_WEIGHT_BYTES`."""
    _, rows, cols, k = extents
    if not all(isinstance(e, int) for e in (cols, k)) or rows <= tile_i:
        return False
    weight = _padded(k, intrin.PAIR) * _padded(cols, tile_j) * 2
    output = rows * cols * 4
    return weight <= ROWS_OUTSIDE_WEIGHT_BYTES and output >= ROWS_OUTSIDE_OUTPUT_BYTES


def reads_output_sized(sch: s_tir.Schedule, main: SBlockRV) -> bool:
    """Whether a block other than ``main`` reads an fp32 parameter with as many values as
    ``main``'s output: an epilogue operand such as the weight an SGD update subtracts from."""
    size = math.prod(nominal(e) for e in sch.get(main).writes[0].source.shape)
    params = [
        buf
        for buf in param_buffers(sch)
        if str(buf.dtype) == "float32" and math.prod(nominal(e) for e in buf.shape) == size
    ]
    for block in sch.get_child_blocks(get_root_block(sch)):
        if sch.get(block).same_as(sch.get(main)):
            continue
        reads = [read.source for read in sch.get(block).reads]
        if any(read.same_as(buf) for read in reads for buf in params):
            return True
    return False


def _symbolic_tile(rows, config: CPUMatmulBF16.Config) -> int:
    """The row tile for symbolic ``rows``: the configured one, or the largest shorter even one
    that provably divides them (``A`` is read in place; a padded copy would be promoted to fp32
    inside the kernel). Raises NotApplicable when none does."""
    for tile_i in range(config.tile_i, 0, -1):
        if divisible(rows, tile_i) and (tile_i == config.tile_i or tile_i % 2 == 0):
            return tile_i
    raise NotApplicable(f"the symbolic rows {rows} are not provably whole row tiles")


def _padded(rows: int, tile: int) -> int:
    return -(-rows // tile) * tile


def schedule_matmul(
    sch: s_tir.Schedule, main: SBlockRV, target: Target, config: CPUMatmulBF16.Config
) -> None:
    """Pack, pad, tile and tensorize the bf16 gemm block ``main`` in place."""
    a_contiguous = k_is_innermost(sch.get(main), 0)
    shared = shared_operands(sch, main)
    normalize(sch, main)
    extents = gemm_extents(sch.get(main))
    # The AMX kernel reads A tile-packed: an A that the epilogue also reads (``x + x @ w``)
    # cannot be replaced by its packed copy, but vdpbf16ps can read it in place.
    if use_amx(target, extents, config) and 0 not in shared:
        plan = amx.plan_for(target, extents, config.amx_n_block, config.amx_k_block)
        prepare(
            sch, main, target, amx.padding(plan), a_contiguous, pack_a=amx.pack_tiles, shared=shared
        )
        amx.schedule(sch, main, target, plan)
        return
    plan = make_plan(extents, config, reads_output_sized(sch, main), plan_cores(target, extents))
    prepare(sch, main, target, plan.padding, a_contiguous, shared=shared)
    outer, row_tile, k_outer, lanes = tile(sch, main, plan, plan.rows_outside)
    acc = sch.cache_write(main, 0, "local")
    sch.reverse_compute_at(acc, row_tile, preserve_unit_loops=True)
    inline_epilogue(sch, acc)
    vectorize_tile(sch, acc)
    work = math.prod(nominal(e) for e in plan.extents)
    parallel = parallel_with_rows(sch, target, outer, row_tile, work)
    if parallel is not None:
        sch.parallel(parallel)
        outer = parallel
    tensorize_tile(sch, main, plan, outer, k_outer, lanes)


def tensorize_tile(sch: s_tir.Schedule, main: SBlockRV, plan: Plan, outer, k_outer, lanes) -> None:
    """Finish the tiled ``main`` (loops from :func:`tile`; after ``sch.parallel``): its
    vectorised initialisation, its update on ``vdpbf16ps`` with the prefetch of the next
    packed-weight strip, and the intrinsic's LLVM helpers imported at ``outer``."""
    packed = sch.get(main).reads[1].source
    init = sch.decompose_reduction(main, k_outer)
    vectorize_tile(sch, init)
    sch.tensorize(lanes, intrin.DPBF16PS_INTRIN)
    (update,) = sch.get_child_blocks(k_outer)
    prefetch.mark(sch, update, packed, axis=1, ahead=plan.tile_j // intrin.LANES)
    intrin.import_helpers(sch, outer)


def use_amx(target: Target, extents: list[int], config: CPUMatmulBF16.Config) -> bool:
    """Return whether to use the AMX kernel: the target has it and there are enough rows."""
    return (
        config.amx
        and has_amx_bf16(target)
        and all(isinstance(e, int) for e in extents)
        and extents[1] >= config.amx_min_rows
    )


def gemm_extents(block: s_tir.SBlock) -> list:
    """The normalised ``[S, I, J, K]`` extents of ``block``: ints, where ``S`` and ``I`` may
    be PrimExprs (symbolic). Raises NotApplicable for a symbolic ``J`` or ``K``."""
    extents = [static_extent(iv.dom.extent) for iv in block.iter_vars]
    if extents[2] is None or extents[3] is None:
        raise NotApplicable("the columns or the reduction of the GEMM are symbolic")
    return [e if e is not None else iv.dom.extent for e, iv in zip(extents, block.iter_vars)]


def prepare(
    sch: s_tir.Schedule,
    main: SBlockRV,
    target: Target,
    padding: list[int],
    a_contiguous: bool,
    pack_a=None,
    shared: frozenset[int] = frozenset(),
) -> list[int]:
    """Pad the normalised block ``main`` by ``padding`` and pack ``B`` into pairs.

    ``A`` is read in place when it is K-contiguous and needs no padding; otherwise a padded
    copy is made by an activation pre-processing block. ``pack_a(sch, block)``, if given,
    always packs ``A`` in that block instead (the AMX tile layout). A producer of ``A`` (the
    im2col gather of a conv) is inlined into that copy, which then is the only one. An operand
    in ``shared`` (:func:`shared_operands`) that would be copied or packed raises
    NotApplicable. Returns the padded extents.
    """
    if 1 in shared:
        raise NotApplicable("another block reads B, whose packing would replace it")
    extents = gemm_extents(sch.get(main))
    if not all(divisible(e, p) for e, p in zip(extents, padding, strict=True)):
        sch.pad_einsum(main, padding)
    reindex_a, reindex_b = sch.get_producers(main)
    gathered = bool(sch.get_producers(reindex_a))
    channels = _gather_channels(sch, reindex_a)
    for block in (reindex_a, reindex_b):
        auto_inline_producers(sch, block)
        if not reads_only_params(sch, block):
            raise NotApplicable("a packed operand is computed inside the kernel")
    if any(static_extent(sch.get(loop).extent) is None for loop in sch.get_loops(reindex_b)):
        # a run-time B over a symbolic batch (attention under a dynamic batch): its packing
        # must be split out of the kernel, which SplitLayoutRewritePreproc does for static
        # shapes only
        raise NotApplicable("the packing of B has symbolic extents")
    in_place = (
        pack_a is None
        and a_contiguous
        and not gathered
        and divisible(extents[1], padding[1])
        and divisible(extents[3], padding[3])
    )
    if not in_place and pack_a is None and not all(isinstance(e, int) for e in extents[:2]):
        # TVM promotes a bf16 buffer allocated in a kernel to fp32 (BF16ComputeLegalize), and
        # Relax's SplitLayoutRewritePreproc splits out static shapes only.
        raise NotApplicable("A with symbolic rows must be read in place, not copied")
    if 0 in shared and not in_place:
        raise NotApplicable("another block reads A, whose padded copy would replace it")
    if pack_a is not None:
        pack_a(sch, reindex_a)
        _parallel_outer(sch, reindex_a, target)
        mark_preproc(sch, reindex_a, weight=False)
    elif in_place:
        sch.compute_inline(reindex_a)
    else:
        _copy_rows(sch, reindex_a, target, channels)
    _pack_pairs(sch, reindex_b, target)
    return gemm_extents(sch.get(main))


def _pack_pairs(sch: s_tir.Schedule, pack: SBlockRV, target: Target) -> None:
    """Lay ``B[S, J, K]`` out as ``[S, J / 16, K / 2, 16, 2]`` in a pre-processing block.

    With whole 32-column blocks the loops are ``(J / 32, K / 2, 32, 2)``, or ``(K / 16, J / 32,
    8, 32, 2)`` where ``K`` is whole blocks of :data:`PACK_BLOCK_ROWS`, and the block is marked
    :data:`.bf16_common.PACK_PAIRS`: :func:`.bf16_passes.tensorize_packs` interleaves
    every two rows of 32 columns with wide loads and shuffles once the packing is split out.
    A ``B`` read as ``[J, K]`` (K innermost) in whole 16 x 32 tiles is marked
    :data:`.bf16_common.PACK_PAIRS_T` instead, loops ``(J / 16, K / 32, 16, 32)``: each tile
    is a 16 x 16 register transpose of 32-bit pairs. Otherwise the copy loops follow the packed
    layout, one gathered vector per pair row.
    """
    lanes, pair = intrin.LANES, intrin.PAIR
    sch.transform_layout(
        pack, ("write", 0), lambda s, j, k: (s, j // lanes, k // pair, j % lanes, k % pair)
    )
    j, k = sch.get_loops(pack)[-2:]  # a unit S loop may be absent
    j_extent, k_extent = int(sch.get(j).extent), int(sch.get(k).extent)
    if _reads_k_innermost(sch.get(pack)) and j_extent % lanes == 0 and k_extent % 32 == 0:
        # B is [J, K] (``x @ W.T`` on a run-time weight): each 16 x 32 tile is a 16 x 16
        # transpose of 32-bit pairs, tensorized by bf16_passes once split out.
        j_outer, j_lane = sch.split(j, [None, lanes])
        k_outer, k_tile = sch.split(k, [None, 32])
        sch.reorder(j_outer, k_outer, j_lane, k_tile)
        sch.annotate(pack, PACK_PAIRS_T, True)
    elif j_extent % 32 == 0 and k_extent % pair == 0:
        # Tensorized by bf16_passes.SplitPreproc once split out of the kernel.
        j_outer, j_inner = sch.split(j, [None, 32])
        k_outer, k_pair = sch.split(k, [None, pair])
        block = PACK_BLOCK_ROWS // pair
        if k_extent // pair > block and k_extent // pair % block == 0:
            # 16 rows of B at a time, each walked across all its 32-column blocks
            k_block, k_outer = sch.split(k_outer, [None, block])
            sch.reorder(k_block, j_outer, k_outer, j_inner, k_pair)
        else:
            sch.reorder(j_outer, k_outer, j_inner, k_pair)  # write the packed panels in order
        sch.annotate(pack, PACK_PAIRS, True)
    else:
        j_outer, j_lane = sch.split(j, [None, lanes])
        k_outer, k_pair = sch.split(k, [None, pair])
        sch.reorder(j_outer, k_outer, j_lane, k_pair)
        sch.vectorize(sch.fuse(j_lane, k_pair))
    _parallel_outer(sch, pack, target)
    mark_preproc(sch, pack)


def _reads_k_innermost(block: s_tir.SBlock) -> bool:
    """Whether the packing ``block`` reads ``B`` with its last iterator (K) innermost."""
    k = block.iter_vars[-1].var
    last = block.reads[0].region[-1].min if block.reads else None
    return last is not None and any(v.same_as(k) for v in undefined_vars(last))


def _gather_channels(sch: s_tir.Schedule, copy: SBlockRV) -> int | None:
    """The channels of each tap of the im2col gather that produces ``copy``'s ``A``, or None
    (the gather's :data:`GATHER_ATTR` annotation: a conv GEMM, grouped or not)."""
    frontier = list(sch.get_producers(copy))
    for _ in range(4):  # the gather sits behind the reindex copies of normalize / pad_einsum
        for producer in frontier:
            value = sch.get(producer).annotations.get(GATHER_ATTR)
            if value is not None:
                return int(value)
        frontier = [p for block in frontier for p in sch.get_producers(block)]
    return None


def _copy_rows(
    sch: s_tir.Schedule, copy: SBlockRV, target: Target, channels: int | None = None
) -> None:
    """Vectorise the padded copy of ``A[S, I, K]`` along ``K`` (an activation pre-process).

    The vectors are 64 bytes (32 bf16) where ``K`` allows, else 32 bytes: a conv's gather
    (inlined here) then copies whole channel vectors of a tap. Where that width would cross
    from one tap to the next (``channels`` per tap, no multiple of it: wav2vec 2.0's
    positional conv has 24 channels a group), each tap's channels are one vector instead: a
    vector across taps gathered its lanes. A ``K`` of neither is one vector up to
    :data:`.common.MAX_WHOLE_VECTOR` registers, else LLVM's loop.
    """
    inner = sch.get_loops(copy)[-1]
    extent = int(sch.get(inner).extent)
    width = next((w for w in (2 * intrin.LANES, intrin.LANES) if extent % w == 0), None)
    per_tap = channels is not None and extent % channels == 0 and channels < extent
    if per_tap and (width is None or channels % width) and channels % 8 == 0:
        vectorize_whole_or_leave(sch, sch.split(inner, [None, channels])[-1], intrin.LANES)
    elif width is None:
        vectorize_whole_or_leave(sch, inner, intrin.LANES)
    else:
        if width < extent:
            inner = sch.split(inner, [None, width])[-1]
        sch.vectorize(inner)
    _parallel_outer(sch, copy, target)
    mark_preproc(sch, copy, weight=False)


def _parallel_outer(sch: s_tir.Schedule, block: SBlockRV, target: Target) -> None:
    """Run the two outermost loops of a copy block in parallel when it is large enough."""
    loops = sch.get_loops(block)
    work = math.prod(nominal(sch.get(loop).extent) for loop in loops)
    if use_parallel(target, work):
        sch.parallel(sch.fuse(*loops[:2]))


def tile(sch: s_tir.Schedule, main: SBlockRV, plan: Plan, rows_outside: bool = False) -> tuple:
    """Order the loops ``(S * J / tj, I / ti, K / 2, ti, tj / 16, 16, 2)``; with
    ``rows_outside``, ``(S * I / ti, J / tj, ...)`` (a row block walks all its column tiles, as
    the merged scores and softmax of :mod:`.bf16_softmax` need, and as :func:`make_plan` asks
    for an epilogue that reads an output-sized operand). An ``A`` larger than
    :data:`.common.A_BLOCK_BYTES` adds a serial loop over blocks of row tiles outermost
    (:func:`.common.row_block_tiles`).

    Returns the fused outer loop, the loop inside it, the pair loop and the 16-lane loop that
    the intrinsic replaces.
    """
    s, i, j, k = sch.get_loops(main)
    i_outer, i_inner = sch.split(i, [None, plan.tile_i])
    j_outer, j_vec, j_lane = sch.split(j, [None, plan.tile_j // intrin.LANES, intrin.LANES])
    k_outer, k_pair = sch.split(k, [None, intrin.PAIR])
    first, second = (i_outer, j_outer) if rows_outside else (j_outer, i_outer)
    static = all(isinstance(e, int) for e in plan.extents)
    tiles = None if rows_outside or not static else row_block_tiles(plan.extents, plan.tile_i, 2)
    if tiles is None:
        sch.reorder(s, first, second, k_outer, i_inner, j_vec, j_lane, k_pair)
    else:  # blocks of A's rows that stay in the last-level cache while the weight streams past
        i_block, second = sch.split(i_outer, [None, tiles])
        sch.reorder(i_block, s, first, second, k_outer, i_inner, j_vec, j_lane, k_pair)
    sch.unroll(i_inner)
    sch.unroll(j_vec)
    return sch.fuse(s, first), second, k_outer, j_lane


__all__ = [
    "PREPROC",
    "CPUMatmulBF16",
    "find_gemm",
    "make_plan",
    "plan_cores",
    "prepare",
    "schedule_matmul",
    "tensorize_tile",
    "tile",
]
