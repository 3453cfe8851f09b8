"""Grouped and depthwise conv2d schedules, and the NHWC-rows kernels that come with them.

* NCHW convs whose groups are narrower than a vector: vectorised over groups, on data laid out
  groups-innermost (:func:`schedule_groups`);
* NCHW depthwise convs with wide rows: vectorised over the columns of a padded plane
  (:func:`schedule_columns`);
* on NHWC rows (``tvmamp.relay_passes.conv2d_to_gemm``): depthwise convs and pooling as window
  kernels vectorised over the channels (:func:`schedule_window`), and the channel shuffle's
  transpose of each pixel's channels (:func:`schedule_permute`).
"""

from __future__ import annotations

import functools
import math

from tvm import s_tir
from tvm.s_tir.dlight.analysis import get_root_block
from tvm.s_tir.schedule import SBlockRV
from tvm.target import Target

from tvmamp.relay_passes.conv2d_im2col import WINDOW_ATTR
from tvmamp.relay_passes.grouped_conv_gemm import PERMUTE_ATTR

from . import conv_staging, transpose_intrin
from .common import (
    divisible,
    inline_epilogue,
    largest_divisor,
    logger,
    nominal,
    num_cores,
    row_chunks,
    use_parallel,
    vector_lanes,
)
from .conv_common import (
    ConvShape,
    TilePlan,
    accumulate_dtype,
    finish,
    pack_weight,
    padding_interior,
    stage_data,
    tile_pixels,
    vector_width,
    vectorise_interior,
)

# The most channels a permutation unrolls at once.
_MAX_UNROLL = 512
# Accumulator registers of a window kernel's tile, and at most this many vectors per pixel.
_WINDOW_REGISTERS = 16
_WINDOW_VECTORS = 4


def schedule_groups(
    sch: s_tir.Schedule, conv: SBlockRV, shape: ConvShape, plan: TilePlan, target: Target
) -> None:
    """Schedule a conv whose groups are narrower than a vector (depthwise: one channel each).

    One vector holds ``tile_g = plan.tile_v`` groups; each of the ``Fg`` output channels of
    those groups has its own accumulator vector per output pixel of the tile. The padded input
    is copied once to ``[N, C / (Cg * tile_g), H, W, Cg, tile_g]`` (and widened to fp32), so
    every tap of every input channel of a group is one contiguous vector load, at any stride
    or dilation; the weight is packed to ``[G / tile_g, Cg, KH, KW, Fg, tile_g]``.

    Depthwise convs with 16 channels a vector stage their input and write their output with
    16 x 16 register transposes, one group of channels at a time (:mod:`.conv_staging`); the
    copies are gathers otherwise, or when that schedule does not apply (tried on a copy of
    ``sch`` first).
    """
    dtype = accumulate_dtype(sch, conv)
    if conv_staging.fits(shape, plan.tile_v, dtype):
        trial = sch.copy()
        try:
            _schedule_groups(trial, trial.get_sblock(sch.get(conv).name_hint), shape, plan, target)
        except (RuntimeError, ValueError, KeyError) as err:  # ScheduleError, TVM's checks
            logger.info("depthwise conv staged by gathers: %s", err)
        else:
            _schedule_groups(sch, conv, shape, plan, target)
            return
    _schedule_groups(sch, conv, shape, plan, target, transposed=False)


def _schedule_groups(
    sch: s_tir.Schedule,
    conv: SBlockRV,
    shape: ConvShape,
    plan: TilePlan,
    target: Target,
    transposed: bool = True,
) -> None:
    """:func:`schedule_groups`, with the transposing copies when ``transposed``."""
    dtype = accumulate_dtype(sch, conv)
    tile_g, fg, cg = plan.tile_v, shape.fg, shape.cg
    data = stage_data(sch, conv, dtype, always=True)
    staging = conv_staging.stage_input(sch, conv, data) if transposed else None
    if staging is None:
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
    # Transposed, one outer iteration is one group of channels: its input is staged and its
    # output written right there, while in cache. With fewer groups than cores, it is a chunk
    # of a group's output rows instead, written there; the input is staged whole before.
    chunks = _row_chunks(sch, conv, plan, target) if transposed else 1
    head, tail = [n, g_outer], [f_inner, g_inner]
    outer, x_outer = tile_pixels(sch, conv, plan, head, tail, not transposed, chunks)
    sch.unroll(f_inner)
    sch.vectorize(g_inner)
    if staging is not None and chunks > 1:
        _place_input_whole(sch, staging, parallel=True)  # chunks: it runs in parallel
    elif staging is not None:
        conv_staging.place_input(sch, staging, outer)
    write_back = None
    if chunks > 1:
        write_back = functools.partial(
            conv_staging.stage_output, outer=outer, rows=shape.oh // chunks
        )
    elif transposed:
        write_back = functools.partial(conv_staging.stage_output, outer=outer)
    # Groups innermost in the accumulator tile: one vector per (pixel, channel of the group).
    layout = lambda n, f, y, x: (n, y, x, f % fg, f // fg)  # noqa: E731
    finish(sch, conv, outer, x_outer, layout, target, write_back)


def _row_chunks(sch: s_tir.Schedule, conv: SBlockRV, plan: TilePlan, target: Target) -> int:
    """How many chunks of output rows each group of a transposed depthwise conv is cut into:
    1 unless it runs in parallel with fewer images x groups than cores (:func:`.row_chunks`).

    Staged and written a whole group at a time, mobilenet_v2's 96-channel depthwise conv had 6
    parallel tasks for 16 cores; in chunks of 8 of its 56 output rows it has 42.
    """
    extents = [nominal(iv.dom.extent) for iv in sch.get(conv).iter_vars]  # a symbolic batch
    tasks = extents[0] * extents[1] // plan.tile_v
    cores = num_cores(target)
    if not use_parallel(target, math.prod(extents)) or tasks >= cores:
        return 1
    return row_chunks(cores, tasks, extents[2] // plan.tile_y)


def _place_input_whole(sch: s_tir.Schedule, staging, parallel: bool) -> None:
    """Stage the whole input before the conv, for a conv whose groups are cut into chunks of
    rows: pad its planes (planes in parallel), then transpose each group's planes (groups in
    parallel), with the 16 x 16 transposes of :func:`.conv_staging.place_input`.

    Staged inside each chunk, the chunks' input rows overlap (the kernel's halo), so their
    flat pixel ranges do not tile the planes and the transposes do not apply: the staging by
    gathers took 345 us for mobilenet_v2's 96 x 112 x 112 stride-2 depthwise conv on one Zen5
    thread, 287 us staged whole, 278 us staged a group at a time (one task per group).
    """
    pad = staging.pad
    plane = sch.fuse(*sch.get_loops(pad)[:2])
    vectorise_interior(sch, pad, padding_interior(sch, pad, 2), padding_interior(sch, pad, 3))
    n, group, pixels, _ = sch.get_loops(staging.staged)
    intrin, llvm_ir = transpose_intrin.rows_intrin(staging.dtype, int(sch.get(pixels).extent))
    sch.tensorize(sch.blockize(pixels), intrin)
    groups = sch.fuse(n, group)
    sch.annotate(groups, "pragma_import_llvm", llvm_ir)
    if parallel:
        sch.parallel(plane)
        sch.parallel(groups)


def schedule_columns(sch: s_tir.Schedule, conv: SBlockRV, plan: TilePlan, target: Target):
    """Schedule a depthwise conv vectorised over output columns (the ``columns`` tiling).

    Each channel plane's padded input is copied (and widened to fp32) right before its use,
    so it stays in cache; the register tile is ``tile_y`` rows of ``tile_x`` vectors of
    ``tile_v`` columns, and each tap is one unaligned vector load per vector of the tile,
    multiplied by the tap's weight, broadcast.
    """
    dtype = accumulate_dtype(sch, conv)
    data = stage_data(sch, conv, dtype, always=False)
    pack_weight(sch, conv, dtype, lambda f, c, ky, kx: (f, c, ky, kx))
    n, f, y, x, c, ky, kx = sch.get_loops(conv)
    y_outer, y_inner = sch.split(y, [None, plan.tile_y])
    x_outer, x_vector, x_lane = sch.split(x, [None, plan.tile_x, plan.tile_v])
    sch.reorder(n, f, y_outer, x_outer, c, ky, kx, y_inner, x_vector, x_lane)
    plane = sch.fuse(n, f)
    if data is not None:
        sch.compute_at(data, plane, preserve_unit_loops=True)
        sch.vectorize(sch.get_loops(data)[-1])
    sch.unroll(y_inner)
    sch.unroll(x_vector)
    sch.vectorize(x_lane)
    finish(sch, conv, plane, x_outer, lambda n, f, y, x: (n, f, y, x), target)


def _order_copy(sch: s_tir.Schedule, copy: SBlockRV, cg: int, tile_g: int, target: Target):
    """Loop the data copy as ``(n, C / (Cg * tile_g), h, w, Cg, tile_g)``, groups vectorised."""
    n, ch, h, w = sch.get_loops(copy)
    block, group, channel = sch.split(ch, [None, tile_g, cg])
    sch.reorder(n, block, h, w, channel, group)
    sch.vectorize(group)
    outer = sch.fuse(n, block, h)
    work = math.prod(nominal(iv.dom.extent) for iv in sch.get(copy).iter_vars)
    if use_parallel(target, work):
        sch.parallel(outer)


def find_window(sch: s_tir.Schedule) -> SBlockRV | None:
    """Return the reduction block of a window kernel on NHWC rows (depthwise conv, pooling).

    Those are the blocks :mod:`tvmamp.relay_passes.conv2d_im2col` annotates with
    :data:`~tvmamp.relay_passes.conv2d_im2col.WINDOW_ATTR`: ``out[r, c]`` reduced over the
    window iterators ``ky, kx``.
    """
    return _annotated(sch, WINDOW_ATTR)


def find_permute(sch: s_tir.Schedule) -> SBlockRV | None:
    """Return the block of a channel permutation of rows (``PERMUTE_ATTR``), the only block."""
    blocks = sch.get_child_blocks(get_root_block(sch))
    return _annotated(sch, PERMUTE_ATTR) if len(blocks) == 1 else None


def _annotated(sch: s_tir.Schedule, key: str) -> SBlockRV | None:
    blocks = sch.get_child_blocks(get_root_block(sch))
    found = [b for b in blocks if key in sch.get(b).annotations]
    return found[0] if len(found) == 1 else None


def schedule_permute(sch: s_tir.Schedule, block: SBlockRV, target: Target) -> None:
    """Unroll the channel loops of each pixel; run the pixels in parallel when worth it.

    Measured on Zen5 (one thread, bf16 ``[784, 3, 20] -> [784, 20, 3]``): 1.9 us unrolled,
    LLVM turning the moves into register shuffles, against 8 us vectorised (a gather) and
    23 us for the generic transpose tiles.
    """
    pixel, *channels = sch.get_loops(block)
    inner = sch.fuse(*channels) if len(channels) > 1 else channels[0]
    extent = int(sch.get(inner).extent)
    if extent > _MAX_UNROLL:
        inner = sch.split(inner, [None, largest_divisor(extent, _MAX_UNROLL)])[-1]
    sch.unroll(inner)
    if use_parallel(target, nominal(sch.get(pixel).extent) * extent):
        sch.parallel(pixel)


def schedule_window(sch: s_tir.Schedule, window: SBlockRV, target: Target) -> None:
    """Vectorise a window kernel over its channels, ``tile_r`` pixels x ``tile_c`` channels.

    The loops are ``(r / tile_r, c / tile_c, ky, kx, tile_r, tile_c)``: each tap loads one
    vector of channels per pixel of the tile (the padding test and the address are computed
    once per pixel and tap, shared by the tile's vectors) and the tap's weights once for the
    tile. The accumulator tile is a ``local`` buffer; the epilogue (casts, the average's
    division, bias, activation) runs on it.
    """
    pixels, channels = (iv.dom.extent for iv in sch.get(window).iter_vars[:2])
    channels = int(channels)
    lanes = vector_lanes(target, "float32")
    width = vector_width(channels, lanes)
    vectors = largest_divisor(channels // width, _WINDOW_VECTORS)
    # symbolic pixels (a dynamic batch) are padded to whole GEMM row tiles
    tile_r = next(t for t in range(_WINDOW_REGISTERS // vectors, 0, -1) if divisible(pixels, t))
    r, c, ky, kx = sch.get_loops(window)
    r_outer, r_inner = sch.split(r, [None, tile_r])
    c_outer, c_vector, c_lane = sch.split(c, [None, vectors, width])
    sch.reorder(r_outer, c_outer, ky, kx, r_inner, c_vector, c_lane)
    acc = sch.cache_write(window, 0, "local")
    sch.reverse_compute_at(acc, c_outer, preserve_unit_loops=True)
    inline_epilogue(sch, acc)
    acc_loops = sch.get_loops(acc)[-2:]
    acc_vector, acc_lane = sch.split(acc_loops[-1], [None, width])
    sch.unroll(acc_loops[0])
    sch.unroll(acc_vector)
    sch.vectorize(acc_lane)
    sch.unroll(r_inner)
    sch.unroll(c_vector)
    sch.vectorize(c_lane)
    outer = sch.fuse(r_outer, c_outer)
    work = math.prod(nominal(iv.dom.extent) for iv in sch.get(window).iter_vars)
    if use_parallel(target, work):
        sch.parallel(outer)
    init = sch.decompose_reduction(window, ky)
    sch.vectorize(sch.get_loops(init)[-1])
