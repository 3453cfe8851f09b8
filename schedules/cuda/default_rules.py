"""The default (untuned) tvmamp schedule rules for CUDA targets: tensor cores first."""

from __future__ import annotations

from tvm.s_tir import dlight as dl
from tvm.target import Target

from ..guard import Guarded
from .arch import compute_capability
from .matmul import CUDATensorCoreMatmul
from .wmma_matmul import WmmaFp16Matmul


def default_cuda_rules(target: Target) -> list[dl.ScheduleRule]:
    """Return the default schedule rules for a CUDA ``target``, most specific first.

    Parameters
    ----------
    target : Target
        A ``cuda`` target; its ``arch`` picks the tensor-core rule: mma.sync m16n8k16 with
        ldmatrix for fp16 and bf16 from sm_80, TVM's wmma m16n16k16 for fp16 on sm_70 to sm_7x.

    Returns
    -------
    rules : list[tvm.s_tir.dlight.ScheduleRule]
        The tensor-core rule, then TVM's ``dlight.gpu`` Matmul, GEMV, Reduction,
        GeneralReduction and Fallback rules; use them as ``dl.ApplyDefaultSchedule(*rules)``
        under ``with target:``.

    Raises
    ------
    ValueError
        When ``target`` is not a ``cuda`` target.
    """
    if target.kind.name != "cuda":
        raise ValueError(
            f"tvmamp.schedules.cuda.default_cuda_rules: target kind {target.kind.name!r} is not "
            "'cuda'"
        )
    cc = compute_capability(target)
    tensor_core = [CUDATensorCoreMatmul()] if cc >= 80 else [WmmaFp16Matmul()] if cc >= 70 else []
    generic = [dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Reduction(), dl.gpu.GeneralReduction()]
    return [*(Guarded(rule) for rule in [*tensor_core, *generic]), dl.gpu.Fallback()]


__all__ = ["default_cuda_rules"]
