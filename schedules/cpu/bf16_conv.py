"""The conv-to-GEMM im2col gather: found inside conv GEMM kernels, or scheduled on its own."""

from __future__ import annotations

import math

from tvm import s_tir, tirx
from tvm.s_tir.dlight.gpu.matmul import get_reduction_blocks
from tvm.s_tir.schedule import SBlockRV
from tvm.target import Target

from tvmamp.relay_passes.conv2d_im2col import GATHER_ATTR, IM2COL_ATTR
from tvmamp.relay_passes.grouped_conv_gemm import GROUP_COLUMNS

from .bf16_common import root_blocks
from .common import largest_divisor, nominal, use_parallel, vector_lanes
from .matmul_analysis import iter_kinds


def has_gather(sch: s_tir.Schedule) -> bool:
    """Return whether the function holds an im2col gather block (a conv GEMM kernel)."""
    return any(GATHER_ATTR in sch.get(b).annotations for b in root_blocks(sch))


def find_conv_gemm(sch: s_tir.Schedule) -> SBlockRV | None:
    """Return the GEMM block of a conv GEMM kernel.

    The kernel is one that :func:`tvmamp.relay_passes.conv2d_im2col.emit_conv_gemm` emits.

    Unlike :func:`.matmul_analysis.find_matmul_block`, the gather is not inlined into the
    GEMM (its reads would no longer be an einsum's): the GEMM rule inlines it into its copy
    of the left operand. Returns ``None`` unless the GEMM reads the gather and one other buffer.
    """
    reductions = get_reduction_blocks(sch, root_blocks(sch))
    if reductions is None:
        return None
    main = reductions[0]
    producers = sch.get_producers(main)
    gathers = [p for p in producers if GATHER_ATTR in sch.get(p).annotations]
    if len(producers) != 1 or len(gathers) != 1 or iter_kinds(sch.get(main)) is None:
        return None
    return main


def im2col_channels(func: tirx.PrimFunc) -> int | None:
    """Return the channel count of an im2col gather made by ``Conv2dToGemm``, else ``None``."""
    channels = func.attrs.get(IM2COL_ATTR) if func.attrs is not None else None
    return None if channels is None else int(channels)


def schedule_im2col(sch: s_tir.Schedule, block: SBlockRV, channels: int, target: Target) -> None:
    """Split the column loop of ``col[rows, taps * channels]`` (or a grouped conv's
    ``col[G, rows, taps * channels]`` over a symbolic batch) into taps and channels.

    The channels are innermost and contiguous in both the NHWC rows read and the columns
    written, so each (row, tap) copies ``channels`` values with vector loads and stores; the
    padding test and the source row are computed once per (row, tap). The row loop runs in
    parallel when the target has several cores and the copy is large enough.
    """
    loops = sch.get_loops(block)
    grouped = sch.get(block).name_hint == GROUP_COLUMNS  # ``col[G, rows, taps * channels]``
    if len(loops) == 3 and not grouped:  # ``col[rows, KH, run]`` (emit_run_im2col)
        sch.vectorize(loops[-1])
        if use_parallel(
            target, math.prod(nominal(iv.dom.extent) for iv in sch.get(block).iter_vars)
        ):
            sch.parallel(loops[0])
        return
    *outer, row, col = loops
    tap, channel = sch.split(col, [None, channels])
    lanes = vector_lanes(target, str(sch.get(block).writes[0].source.dtype))
    width = channels if channels <= lanes else largest_divisor(channels, lanes)
    if width < channels:
        channel, vec = sch.split(channel, [None, width])
    else:
        vec = channel
    sch.vectorize(vec)
    work = math.prod(nominal(iv.dom.extent) for iv in sch.get(block).iter_vars)
    if use_parallel(target, work):
        sch.parallel(sch.fuse(*outer, row) if outer else row)
