"""The default (untuned) tvmamp schedule rules for CPU (``llvm``) targets."""

from __future__ import annotations

from tvm.s_tir import dlight as dl
from tvm.target import Target

from ..guard import Guarded
from .bf16_common import has_avx512bf16
from .bf16_matmul import CPUMatmulBF16
from .bf16_passes import SplitPreproc
from .bf16_softmax import CPUGemmSoftmaxBF16
from .column_reduction import CPUColumnReduction
from .conv import CPUConv2d
from .depthwise_planes import CPUDepthwisePlanes
from .elementwise import CPUElementwise
from .fp16_matmul import CPUMatmulFP16, has_f16c
from .full_reduction import CPUFullReduction
from .gemv import TVMGemvWithEpilogue
from .matmul import CPUMatmul
from .pooling import CPUPooling
from .reduction import CPURowReduction


def default_cpu_rules(target: Target) -> list[dl.ScheduleRule]:
    """Return the default schedule rules for ``target``, most specific first.

    Parameters
    ----------
    target : Target
        An ``llvm`` target; its ``mcpu``/``mattr`` pick the SIMD width and its
        ``num-cores`` whether loops run in parallel.

    Returns
    -------
    rules : list[tvm.s_tir.dlight.ScheduleRule]
        With avx512_bf16, the ``vdpbf16ps`` bf16 rules first; with F16C, the fp16 matmul rule
        (fp16 weights packed at compile time, fp32 FMA); then matmul, conv2d, injective,
        pooling, column, row and full reductions, and TVM's ``dlight.cpu`` GEMV (its
        leftover epilogue blocks vectorised) and Reduction. Use them through
        :func:`cpu_schedule_passes`, which also splits out the bf16 rules' weight packing.

    Raises
    ------
    ValueError
        When ``target`` is not an ``llvm`` target.
    """
    if target.kind.name != "llvm":
        raise ValueError(
            f"tvmamp.schedules.cpu.default_cpu_rules: target kind {target.kind.name!r} is not "
            "'llvm'"
        )
    rules = [CPUMatmul(), CPUDepthwisePlanes(), CPUConv2d(), CPUElementwise(), CPUPooling()]
    rules += [CPUColumnReduction(), CPURowReduction(), CPUFullReduction()]
    rules += [TVMGemvWithEpilogue(), dl.cpu.Reduction()]
    if has_f16c(target):
        rules = [CPUMatmulFP16(), *rules]
    if has_avx512bf16(target):
        rules = [CPUGemmSoftmaxBF16(), CPUMatmulBF16(), *rules]
    return [Guarded(rule) for rule in rules]


def cpu_schedule_passes(target: Target) -> list:
    """Return the scheduling passes for ``target``: the default rules, then :class:`SplitPreproc`.

    The bf16 rules leave their packing in blocks marked for splitting; ``SplitPreproc`` must
    run before the module is built (it folds constant weights into their packed layout).
    """
    return [dl.ApplyDefaultSchedule(*default_cpu_rules(target)), SplitPreproc()]


__all__ = ["cpu_schedule_passes", "default_cpu_rules"]
