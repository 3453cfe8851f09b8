"""Tiling of a prepared bf16 gemm block onto the AMX micro-kernel (:mod:`.x86_amx_intrin`)."""

from __future__ import annotations

import math

from tvm import s_tir
from tvm.s_tir.schedule import SBlockRV
from tvm.target import Target

from . import x86_amx_intrin as amx_intrin
from .cpu_common import inline_epilogue, use_parallel


def padding() -> list[int]:
    """Return the ``pad_einsum`` factors of ``[S, I, J, K]`` for the AMX kernel."""
    return [1, amx_intrin.ROWS, amx_intrin.COLS, amx_intrin.K_STEP]


def schedule(sch: s_tir.Schedule, main: SBlockRV, target: Target, extents: list[int]) -> None:
    """Tile ``main`` (padded ``[S, I, J, K]``) by 32 x 32 x K and tensorize it with AMX.

    The loops are ``(S * J / 32, I / 32)`` outside the micro-kernel, which runs the whole
    reduction with its accumulators in tile registers; the fp32 block lives in a ``local``
    buffer that the fused epilogue reads.
    """
    s, i, j, k = sch.get_loops(main)
    i_outer, i_inner = sch.split(i, [None, amx_intrin.ROWS])
    j_outer, j_inner = sch.split(j, [None, amx_intrin.COLS])
    sch.reorder(s, j_outer, i_outer, i_inner, j_inner, k)
    outer = sch.fuse(s, j_outer)
    acc = sch.cache_write(main, 0, "local")
    sch.reverse_compute_at(acc, i_outer, preserve_unit_loops=True)
    inline_epilogue(sch, acc)
    _vectorize_tile(sch, acc)
    if use_parallel(target, math.prod(extents)):
        sch.parallel(outer)
    init = sch.decompose_reduction(main, i_inner)
    _vectorize_tile(sch, init)
    sch.tensorize(i_inner, amx_intrin.amx_intrin(extents[3]))
    sch.annotate(outer, "pragma_import_llvm", amx_intrin.AMX_LLVM_IR)


def _vectorize_tile(sch: s_tir.Schedule, block: SBlockRV) -> None:
    """Vectorise the column loop of a 32 x 32 tile block."""
    sch.vectorize(sch.get_loops(block)[-1])
