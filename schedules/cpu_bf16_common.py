"""Helpers shared by the bf16 CPU rules: feature gating, dtype checks and pre-processing blocks.

TVM promotes every bf16 buffer allocated inside a kernel to fp32 (``BF16ComputeLegalize``),
so the packed and padded bf16 operands that ``vdpbf16ps`` reads cannot live inside the kernel.
The rules mark the blocks that produce them with :data:`PREPROC`; the pass
``relax.transform.SplitLayoutRewritePreproc`` moves each into its own function whose output is
a bf16 tensor of the Relax program, and ``FoldConstant`` then evaluates the ones that only read
weights at compile time. :func:`tvmamp.schedules.cpu.cpu_schedule_passes` runs both.
"""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.s_tir.dlight.analysis import get_root_block
from tvm.s_tir.schedule import SBlockRV
from tvm.target import Target
from tvm.target.codegen import llvm_cpu_has_features

from .cpu_matmul_analysis import iter_kinds

# The annotation SplitLayoutRewritePreproc looks for.
PREPROC = "meta_schedule.layout_rewrite_preproc"
# Pre-processing of activations, split out only after the weight packing has been folded:
# SplitLayoutRewritePreproc puts all marked blocks of a kernel into one function, which
# FoldConstant could not evaluate if it also read an activation.
PREPROC_ACTIVATION = "tvmamp.preproc_activation"


def has_avx512bf16(target: Target) -> bool:
    """Return whether the LLVM ``target`` executes ``vdpbf16ps`` (avx512_bf16)."""
    try:
        return bool(llvm_cpu_has_features(["avx512bf16"], target))
    except (RuntimeError, ValueError):  # targets without x86 features
        return False


def has_amx_bf16(target: Target) -> bool:
    """Return whether the LLVM ``target`` has AMX tiles with bf16 (``tdpbf16ps``)."""
    try:
        return bool(llvm_cpu_has_features(["amx-tile", "amx-bf16"], target))
    except (RuntimeError, ValueError):
        return False


def is_bf16_matmul(block: s_tir.SBlock) -> bool:
    """Return whether ``block`` reads two bf16 buffers and accumulates into fp32."""
    reads = [str(r.source.dtype) for r in block.reads]
    return reads == ["bfloat16", "bfloat16"] and str(block.writes[0].source.dtype) == "float32"


def k_is_innermost(block: s_tir.SBlock, read: int) -> bool:
    """Return whether the last index of ``block.reads[read]`` is a reduction iterator."""
    kinds = iter_kinds(block)
    last = block.reads[read].region[-1].min
    return (
        isinstance(last, tirx.Var)
        and kinds.get(last) is not None
        and last in {iv.var for iv in block.iter_vars if iv.iter_type == tirx.IterVar.CommReduce}
    )


def mark_preproc(sch: s_tir.Schedule, block: SBlockRV, weight: bool = True) -> None:
    """Mark ``block`` to be split into its own pre-processing function.

    ``weight=False`` marks a block that reads activations; it is split out in a second round,
    after the weight packing has been folded (see :func:`.cpu_bf16_passes.SplitPreproc`).
    """
    sch.annotate(block, PREPROC if weight else PREPROC_ACTIVATION, True)


def reads_only_params(sch: s_tir.Schedule, block: SBlockRV) -> bool:
    """Return whether every buffer ``block`` reads is a parameter of the function."""
    params = [p for p in sch.mod["main"].params if isinstance(p, tirx.Buffer)]
    return all(any(r.source.same_as(p) for p in params) for r in sch.get(block).reads)


def root_blocks(sch: s_tir.Schedule) -> list[SBlockRV]:
    """Return the blocks directly under the function's root block."""
    return list(sch.get_child_blocks(get_root_block(sch)))
