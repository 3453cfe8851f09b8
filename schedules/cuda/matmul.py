"""A dlight rule: fp16/bf16 matmul, batch matmul and implicit-GEMM conv on mma.sync tensor cores."""

from __future__ import annotations

import dataclasses

from tvm import s_tir, tirx
from tvm.s_tir.dlight.analysis import get_root_block
from tvm.s_tir.dlight.gpu.base import GPUScheduleRule
from tvm.s_tir.dlight.gpu.matmul import (
    auto_inline_consumer_chain,
    auto_inline_producers,
    get_index_map,
    get_reduction_blocks,
)
from tvm.target import Target
from tvm.tirx.analysis import undefined_vars

from .mma_intrin import DTYPES, TILE, fragment_layout, intrin_group

WARP = 32


@dataclasses.dataclass(frozen=True)
class Config:
    """Tile sizes of one kernel, in 16x16x16 tensor-core tiles.

    A thread block computes ``(warps_i * tiles_i * 16) x (warps_j * tiles_j * 16)`` outputs with
    ``warps_i * warps_j`` warps, and steps through K ``k_tiles * 16`` at a time, double-buffered
    in shared memory (cp.async when the build enables ``tirx.use_async_copy``).
    """

    warps_i: int = 2
    warps_j: int = 2
    tiles_i: int = 4
    tiles_j: int = 4
    k_tiles: int = 2
    vector: int = 8  # elements per 16-byte global -> shared copy

    @property
    def block_i(self) -> int:
        """Rows of C per thread block."""
        return self.warps_i * self.tiles_i * TILE

    @property
    def block_j(self) -> int:
        """Columns of C per thread block."""
        return self.warps_j * self.tiles_j * TILE


def config_for(extent_i, extent_j, extent_k) -> Config:
    """Tiles that fit the problem: big ones for big GEMMs, down to one 16x16 tile per warp.

    Parameters
    ----------
    extent_i, extent_j, extent_k : int or None
        M, N and K of the (normalised) GEMM; None when dynamic.
    """

    def fit(extent, warps_max, tiles_max):
        if extent is None:
            return warps_max, tiles_max
        tiles = max(1, -(-extent // TILE))  # 16-row tiles needed
        warps = min(warps_max, tiles)
        return warps, max(1, min(tiles_max, _pow2_floor(-(-tiles // warps))))

    warps_i, tiles_i = fit(extent_i, 2, 4)
    warps_j, tiles_j = fit(extent_j, 2, 4)
    k_tiles = 2 if extent_k is None or extent_k > TILE else 1
    return Config(warps_i, warps_j, tiles_i, tiles_j, k_tiles)


def _pow2_floor(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def _static(extent):
    return int(extent) if isinstance(extent, tirx.IntImm) else None


class CUDATensorCoreMatmul(GPUScheduleRule):
    """mma.sync m16n8k16 + ldmatrix for GEMM-like kernels with fp16/bf16 inputs, fp32 outputs.

    Every reduction kernel whose two inputs are fp16 or bf16 and whose accumulator is fp32 is
    normalised with dlight's index maps to ``C[S, I, J] += A[S, I, K] * B[S, J, K]``: matmul,
    dense (B transposed), batch matmul, and conv2d as an implicit GEMM (``I`` = N*H*W, ``K`` =
    KH*KW*C). Shapes that do not divide the tiles are padded inside the kernel. Casts and
    padding before the GEMM and elementwise epilogues after it are fused into the copies.
    Needs sm_80 or newer; :func:`tvmamp.schedules.cuda.default_cuda_rules` uses TVM's wmma rule
    below that. Returns None for every other kernel.
    """

    def __init__(self, config: Config | None = None):
        self.config = config

    def apply(self, func, target: Target, tunable: bool) -> s_tir.Schedule | None:
        if not isinstance(func, tirx.PrimFunc) or not self.is_target_available(target):
            return None
        if func.attrs is not None and "dlight.do_not_tensorize" in func.attrs:
            return None
        sch = s_tir.Schedule(func)
        reductions = get_reduction_blocks(sch, sch.get_child_blocks(get_root_block(sch)))
        if reductions is None:
            return None
        dtype = gemm_dtype(sch.get(reductions[0]))
        if dtype is None or get_index_map(sch.get(reductions[0])) is None:
            return None
        a_k, b_k = (k_contiguous(sch.get(reductions[0]), index) for index in (0, 1))
        main = _normalise(sch, reductions[0], b_trans=b_k)
        extents = [_static(sch.get(loop).extent) for loop in sch.get_loops(main)[1:]]
        config = self.config or config_for(*extents)
        vectors = (config.vector if a_k else 1, config.vector)
        _schedule(sch, main, config, intrin_group(dtype, b_trans=b_k), vectors)
        return sch


def gemm_dtype(block: tirx.SBlock) -> str | None:
    """The low input dtype of a two-input GEMM block with an fp32 result, else None."""
    if len(block.writes) != 1 or str(block.writes[0].source.dtype) != "float32":
        return None
    out = block.writes[0].source
    inputs = [str(r.source.dtype) for r in block.reads if not r.source.same_as(out)]
    if len(inputs) != 2 or inputs[0] != inputs[1] or inputs[0] not in DTYPES:
        return None
    return inputs[0]


def k_contiguous(block: tirx.SBlock, index: int) -> bool:
    """Whether input ``index`` of a GEMM block is contiguous along the reduction (K) axis."""
    reduce = {iv.var for iv in block.iter_vars if iv.iter_type == tirx.IterVar.CommReduce}
    last = block.reads[index].region[-1].min
    return any(var.same_as(r) for var in undefined_vars(last) for r in reduce)


def _normalise(sch: s_tir.Schedule, main, b_trans: bool):
    """Reindex so the block reads ``A[S, I, K]`` and ``B[S, J, K]`` (``b_trans``) or
    ``B[S, K, J]``, and writes ``C[S, I, J]``: the copies keep the inputs' contiguous axis."""
    reindex_a = sch.reindex(main, ("read", 0))
    reindex_b = sch.reindex(main, ("read", 1))
    reindex_c = sch.reindex(main, ("write", 0))
    block_map, a_map, b_map, c_map = get_index_map(sch.get(main))
    if not b_trans:
        b_map = _swap_last_two(b_map)
    sch.transform_layout(reindex_a, ("write", 0), a_map)
    sch.transform_layout(reindex_b, ("write", 0), b_map)
    sch.transform_layout(reindex_c, ("read", 0), c_map)
    sch.transform_block_layout(main, block_map)
    return main


def _swap_last_two(index_map: tirx.IndexMap) -> tirx.IndexMap:
    *outer, j, k = index_map.final_indices
    return tirx.IndexMap(index_map.initial_indices, [*outer, k, j], None)


def _tile(sch: s_tir.Schedule, main, cfg: Config):
    """Blockize 16x16x16 tensor-core tiles; bind thread blocks and warps. Returns the block of
    tiles, the warp loop and the two K loops (per shared-memory stage, per fragment load)."""
    sch.pad_einsum(main, [1, cfg.block_i, cfg.block_j, cfg.k_tiles * TILE])
    batch, i, j, k = sch.get_loops(main)
    i, i_tc = sch.split(i, [None, TILE])
    j, j_tc = sch.split(j, [None, TILE])
    k, k_tc = sch.split(k, [None, TILE])
    sch.reorder(i, j, k, i_tc, j_tc, k_tc)
    outer = sch.blockize(i_tc)
    i0, i1, i2 = sch.split(i, [None, cfg.warps_i, cfg.tiles_i])
    j0, j1, j2 = sch.split(j, [None, cfg.warps_j, cfg.tiles_j])
    k0, k1 = sch.split(k, [None, cfg.k_tiles])
    sch.reorder(i0, j0, i1, j1, k0, k1, i2, j2)
    sch.bind(batch, "blockIdx.z")
    sch.bind(i0, "blockIdx.y")
    sch.bind(j0, "blockIdx.x")
    warp = sch.fuse(i1, j1)
    sch.bind(warp, "threadIdx.y")
    return outer, warp, k0, k1


def _schedule(sch: s_tir.Schedule, main, cfg: Config, intrins: dict, vectors) -> None:
    """Tile, stage A and B through shared memory and ldmatrix fragments, then tensorize."""
    outer, warp, k0, k1 = _tile(sch, main, cfg)
    shared = [_fetch_to_shared(sch, outer, i, k0, cfg, vectors[i]) for i in (0, 1)]
    for block in shared:
        auto_inline_producers(sch, block)
    frags = [_fetch_to_warp(sch, outer, index, k1) for index in (0, 1)]
    c_shared, c_warp = _accumulators(sch, outer, warp)
    init = sch.decompose_reduction(outer, k0)
    sch.tensorize(frags[0], intrins["load_a"])
    sch.tensorize(frags[1], intrins["load_b"])
    sch.tensorize(sch.get_loops(main)[-3], intrins["compute"])
    sch.tensorize(sch.get_loops(sch.get_child_blocks(init)[0])[-2], intrins["init"])
    sch.tensorize(sch.get_loops(c_warp)[-2], intrins["store"])
    _store_to_global(sch, c_shared, cfg)
    sch.annotate(k0, "software_pipeline_stage", [0, 0, 1])
    sch.annotate(k0, "software_pipeline_order", [0, 1, 2])
    if _async_copy_enabled():
        sch.annotate(k0, "software_pipeline_async_stages", [0])


def _fetch_to_shared(sch: s_tir.Schedule, block, index: int, k0, cfg: Config, vector: int):
    """Copy one operand tile to shared memory (``vector`` elements per thread and step) with
    rows padded against bank conflicts in ldmatrix."""
    copy = sch.cache_read(block, index, "shared.dyn")
    sch.compute_at(copy, k0)
    fused = sch.fuse(*sch.get_loops(copy)[-2:])
    _, ty, tx, vec = sch.split(fused, [None, cfg.warps_i * cfg.warps_j, WARP, vector])
    sch.bind(ty, "threadIdx.y")
    sch.bind(tx, "threadIdx.x")
    sch.vectorize(vec)
    sch.storage_align(copy, 0, axis=-2, factor=32, offset=8)
    return copy


def _fetch_to_warp(sch: s_tir.Schedule, block, index: int, k1):
    """ldmatrix fragments of one operand; returns the loop to tensorize."""
    frag = sch.cache_read(block, index, "warp")
    sch.compute_at(frag, k1)
    i, j = sch.get_loops(frag)[-2:]
    i0, i1 = sch.split(i, [None, TILE])
    j0, j1 = sch.split(j, [None, TILE])
    sch.reorder(i0, j0, i1, j1)
    sch.transform_layout(frag, ("write", 0), _fragment_index_map)
    return i1


def _accumulators(sch: s_tir.Schedule, block, warp):
    """fp32 accumulators in registers (warp scope), staged through shared memory to global."""
    c_shared = sch.cache_write(block, 0, "shared.dyn")
    c_warp = sch.cache_write(block, 0, "warp")
    sch.reverse_compute_at(c_warp, warp)
    sch.reverse_compute_at(c_shared, warp)
    i, j = sch.get_loops(c_warp)[-2:]
    i0, i1 = sch.split(i, [None, TILE])
    j0, j1 = sch.split(j, [None, TILE])
    sch.reorder(i0, j0, i1, j1)
    sch.transform_layout(c_warp, ("read", 0), _fragment_index_map)
    return c_shared, c_warp


def _store_to_global(sch: s_tir.Schedule, c_shared, cfg: Config) -> None:
    """Fuse the epilogue (bias, activation, cast) into the shared -> global store of C."""
    auto_inline_consumer_chain(sch, c_shared)
    fused = sch.fuse(*sch.get_loops(c_shared)[-2:])
    _, tx, vec = sch.split(fused, [None, WARP, 4])
    sch.bind(tx, "threadIdx.x")
    sch.vectorize(vec)


def _fragment_index_map(*indices):
    """[..., i, j] -> [..., i // 16, j // 16, thread, value] for a warp-scope fragment buffer."""
    *outer, i, j = indices
    return (*outer, i // TILE, j // TILE, *fragment_layout(i % TILE, j % TILE))


def _async_copy_enabled() -> bool:
    import tvm

    return bool(tvm.transform.PassContext.current().config.get("tirx.use_async_copy", False))
