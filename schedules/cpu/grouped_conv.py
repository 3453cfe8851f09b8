"""Grouped and depthwise NCHW conv2d vectorised over groups, on data laid out groups-innermost."""

from __future__ import annotations

import math

from tvm import s_tir
from tvm.s_tir.schedule import SBlockRV
from tvm.target import Target

from .common import use_parallel
from .conv_common import (
    ConvShape,
    TilePlan,
    accumulate_dtype,
    finish,
    pack_weight,
    stage_data,
    tile_pixels,
)


def schedule_groups(
    sch: s_tir.Schedule, conv: SBlockRV, shape: ConvShape, plan: TilePlan, target: Target
) -> None:
    """Schedule a conv whose groups are narrower than a vector (depthwise: one channel each).

    One vector holds ``tile_g = plan.tile_v`` groups; each of the ``Fg`` output channels of
    those groups has its own accumulator vector per output pixel of the tile. The padded input
    is copied once to ``[N, C / (Cg * tile_g), H, W, Cg, tile_g]`` (and widened to fp32), so
    every tap of every input channel of a group is one contiguous vector load, at any stride
    or dilation; the weight is packed to ``[G / tile_g, Cg, KH, KW, Fg, tile_g]``.
    """
    dtype = accumulate_dtype(sch, conv)
    tile_g, fg, cg = plan.tile_v, shape.fg, shape.cg
    data = stage_data(sch, conv, dtype, always=True)
    sch.transform_layout(
        data,
        ("write", 0),
        lambda n, ch, h, w: (n, ch // (cg * tile_g), h, w, ch % cg, ch // cg % tile_g),
    )
    _order_copy(sch, data, cg, tile_g, target)
    pack_weight(
        sch,
        conv,
        dtype,
        lambda f, c, ky, kx: (f // fg // tile_g, c, ky, kx, f % fg, f // fg % tile_g),
    )
    n, f = sch.get_loops(conv)[:2]
    g_outer, g_inner, f_inner = sch.split(f, [None, tile_g, fg])
    outer, x_outer = tile_pixels(sch, conv, plan, [n, g_outer], [f_inner, g_inner])
    sch.unroll(f_inner)
    sch.vectorize(g_inner)
    # Groups innermost in the accumulator tile: one vector per (pixel, channel of the group).
    finish(sch, conv, outer, x_outer, lambda n, f, y, x: (n, y, x, f % fg, f // fg), target)


def _order_copy(sch: s_tir.Schedule, copy: SBlockRV, cg: int, tile_g: int, target: Target):
    """Loop the data copy as ``(n, C / (Cg * tile_g), h, w, Cg, tile_g)``, groups vectorised."""
    n, ch, h, w = sch.get_loops(copy)
    block, group, channel = sch.split(ch, [None, tile_g, cg])
    sch.reorder(n, block, h, w, channel, group)
    sch.vectorize(group)
    outer = sch.fuse(n, block, h)
    work = math.prod(int(iv.dom.extent) for iv in sch.get(copy).iter_vars)
    if use_parallel(target, work):
        sch.parallel(outer)
