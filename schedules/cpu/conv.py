"""Default CPU schedule for NCHW conv2d with a padding producer and fused epilogues."""

from __future__ import annotations

import math
from dataclasses import dataclass

from tvm import s_tir, tirx
from tvm.s_tir.dlight.analysis import get_root_block
from tvm.s_tir.dlight.gpu.matmul import get_reduction_blocks
from tvm.s_tir.schedule import LoopRV, SBlockRV
from tvm.target import Target

from .common import (
    CPURule,
    inline_epilogue,
    largest_divisor,
    schedule_injective,
    use_parallel,
    vector_lanes,
)


class CPUConv2d(CPURule):
    """Direct NCHW conv2d, vectorised over output channels, register-tiled over output width.

    The weight is packed to ``[F / tile_f, C, KH, KW, tile_f]``; each ``tile_f x tile_x``
    accumulator (output channels x output columns) is a ``local`` buffer; the padding block
    is materialised once; bias, batch-norm and activation epilogues run on the finished
    tile. Any stride, dilation and padding; static shapes; ``groups == 1`` only.
    """

    @dataclass
    class Config:
        """Per-target tile sizes.

        Attributes
        ----------
        vectors_f : int
            Output channels per tile, in SIMD vectors of the accumulator dtype.
        tile_x : int
            Upper bound of the output columns per tile (a divisor of the width is used).
        """

        vectors_f: int = 2
        tile_x: int = 8

    # Keyed by SIMD width in bits (see CPUMatmul.CONFIGS).
    CONFIGS = {512: Config(), 256: Config(tile_x=6), 128: Config()}

    def apply(  # pylint: disable=missing-function-docstring
        self, func: tirx.PrimFunc, target: Target, _: bool
    ) -> s_tir.Schedule | None:
        return self.schedule_block(
            func,
            target,
            _find_conv_block,
            lambda sch, conv: _schedule(sch, conv, target, self.CONFIGS[vector_lanes(target) * 32]),
        )


def _index_vars(region) -> list[tirx.Var | None]:
    """Return each index of ``region`` when it is a bare variable, else ``None``."""
    return [rng.min if isinstance(rng.min, tirx.Var) else None for rng in region]


def _is_conv2d_nchw(block: s_tir.SBlock) -> bool:
    """Match ``O[n, f, y, x] += D[n, c, f(y, ky), f(x, kx)] * W[f, c, ky, kx]``."""
    if len(block.reads) != 2 or len(block.writes) != 1 or len(block.iter_vars) != 7:
        return False
    kinds = "".join("S" if iv.iter_type == tirx.IterVar.DataPar else "R" for iv in block.iter_vars)
    if kinds != "SSSSRRR":
        return False
    n, f, y, x, c, ky, kx = (iv.var for iv in block.iter_vars)
    data, weight = block.reads
    out = _index_vars(block.writes[0].region)
    wgt = _index_vars(weight.region)
    dat = _index_vars(data.region)
    return out == [n, f, y, x] and wgt == [f, c, ky, kx] and len(dat) == 4 and dat[:2] == [n, c]


def _find_conv_block(sch: s_tir.Schedule) -> SBlockRV | None:
    """Return the conv2d block of ``sch`` when the function is a conv2d plus spatial blocks."""
    blocks = sch.get_child_blocks(get_root_block(sch))
    reductions = get_reduction_blocks(sch, blocks)
    if reductions is None or not _is_conv2d_nchw(sch.get(reductions[0])):
        return None
    return reductions[0]


def _pick_tiles(block: s_tir.SBlock, lanes: int, config: CPUConv2d.Config) -> tuple[int, int]:
    """Return ``(tile_f, tile_x)``: divisors of the output channels and output width."""
    _, ext_f, _, ext_x = (int(iv.dom.extent) for iv in block.iter_vars[:4])
    tile_f = largest_divisor(ext_f, lanes * config.vectors_f)
    if tile_f % lanes and ext_f % lanes == 0:
        tile_f = lanes
    return tile_f, largest_divisor(ext_x, config.tile_x)


def _schedule(sch: s_tir.Schedule, conv: SBlockRV, target: Target, config: CPUConv2d.Config):
    """Tile, pack, vectorise and parallelise the conv2d block ``conv`` in place."""
    acc_dtype = str(sch.get(conv).writes[0].source.dtype)
    tile_f, tile_x = _pick_tiles(sch.get(conv), vector_lanes(target, acc_dtype), config)
    producers = sch.get_producers(conv)
    pack = sch.reindex(conv, ("read", 1))
    outer, x_outer, c_loop = _tile(sch, conv, tile_f, tile_x)
    acc = sch.cache_write(conv, 0, "local")
    # Channels innermost in the accumulator tile, so that each row of it is one vector.
    sch.transform_layout(conv, ("write", 0), lambda n, f, y, x: (n, y, x, f))
    sch.reverse_compute_at(acc, x_outer, preserve_unit_loops=True)
    inline_epilogue(sch, acc)
    _vectorize_columns(sch, acc)
    _pack_weight(sch, pack, tile_f)
    parallel = use_parallel(target, math.prod(int(iv.dom.extent) for iv in sch.get(conv).iter_vars))
    for producer in producers:
        schedule_injective(sch, producer, vector_lanes(target), parallel)
    if parallel:
        sch.parallel(outer)  # before decompose_reduction, which breaks the check
    init = sch.decompose_reduction(conv, c_loop)
    _vectorize_columns(sch, init)


def _tile(sch: s_tir.Schedule, conv: SBlockRV, tile_f: int, tile_x: int) -> list[LoopRV]:
    """Order the loops ``(n*F/tf*y, x/tx, c, ky, kx, tx, tf)``, unrolled and vectorised inside.

    Returns the fused outer loop, the column-tile loop and the channel reduction loop.
    """
    n, f, y, x, c, ky, kx = sch.get_loops(conv)
    f_outer, f_inner = sch.split(f, [None, tile_f])
    x_outer, x_inner = sch.split(x, [None, tile_x])
    sch.reorder(n, f_outer, y, x_outer, c, ky, kx, x_inner, f_inner)
    sch.unroll(x_inner)
    sch.vectorize(f_inner)
    return [sch.fuse(n, f_outer, y), x_outer, c]


def _pack_weight(sch: s_tir.Schedule, pack: SBlockRV, tile_f: int) -> None:
    """Lay the weight ``[F, C, KH, KW]`` out as ``[F / tile_f, C, KH, KW, tile_f]``."""
    sch.transform_layout(
        pack, ("write", 0), lambda f, c, ky, kx: (f // tile_f, c, ky, kx, f % tile_f)
    )
    f, c, ky, kx = sch.get_loops(pack)
    f_outer, f_inner = sch.split(f, [None, tile_f])
    sch.reorder(f_outer, c, ky, kx, f_inner)
    sch.vectorize(f_inner)


def _vectorize_columns(sch: s_tir.Schedule, block: SBlockRV) -> None:
    """Vectorise the innermost (column) loop of an ``[n, f, y, x]`` tile block."""
    sch.vectorize(sch.get_loops(block)[-1])
