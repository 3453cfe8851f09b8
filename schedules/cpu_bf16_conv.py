"""Schedule of the conv-to-GEMM im2col gather: one vector copy per (pixel, tap, channel block)."""

from __future__ import annotations

import math

from tvm import s_tir, tirx
from tvm.s_tir.schedule import SBlockRV
from tvm.target import Target

from tvmamp.relay_passes.conv2d_im2col import IM2COL_ATTR

from .cpu_common import largest_divisor, use_parallel, vector_lanes


def im2col_channels(func: tirx.PrimFunc) -> int | None:
    """Return the channel count of an im2col gather made by ``Conv2dToGemm``, else ``None``."""
    channels = func.attrs.get(IM2COL_ATTR) if func.attrs is not None else None
    return None if channels is None else int(channels)


def schedule_im2col(sch: s_tir.Schedule, block: SBlockRV, channels: int, target: Target) -> None:
    """Split the column loop of ``col[rows, taps * channels]`` into taps and channels.

    The channels are innermost and contiguous in both the NHWC rows read and the columns
    written, so each (row, tap) copies ``channels`` values with vector loads and stores; the
    padding test and the source row are computed once per (row, tap). The row loop runs in
    parallel when the target has several cores and the copy is large enough.
    """
    row, col = sch.get_loops(block)
    tap, channel = sch.split(col, [None, channels])
    lanes = vector_lanes(target, str(sch.get(block).writes[0].source.dtype))
    width = channels if channels <= lanes else largest_divisor(channels, lanes)
    if width < channels:
        channel, vec = sch.split(channel, [None, width])
    else:
        vec = channel
    sch.vectorize(vec)
    work = math.prod(int(iv.dom.extent) for iv in sch.get(block).iter_vars)
    if use_parallel(target, work):
        sch.parallel(row)
