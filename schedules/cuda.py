"""The default (untuned) tvmamp schedule rules for CUDA targets: tensor cores first."""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.s_tir import dlight as dl
from tvm.s_tir.dlight.analysis import get_root_block
from tvm.s_tir.dlight.gpu.base import GPUScheduleRule
from tvm.s_tir.dlight.gpu.matmul import MatmulTensorization, get_reduction_blocks
from tvm.target import Target

from tvmamp.targets.cuda import compute_capability

from .cuda_matmul import CUDATensorCoreMatmul, gemm_dtype
from .guard import Guarded

__all__ = ["CUDATensorCoreMatmul", "WmmaFp16Matmul", "compute_capability", "default_cuda_rules"]


class WmmaFp16Matmul(GPUScheduleRule):
    """TVM's wmma m16n16k16 rule for fp16 GEMMs with fp32 results, whatever their size.

    ``dlight.gpu.Matmul`` hands only GEMMs larger than 64 in every dimension to its tensor-core
    rule, and not for "sm_90a"-style arch names; this rule calls that tensor-core rule directly.
    It is tvmamp's path below sm_80, where ``mma.sync.m16n8k16`` does not exist. Importing TVM's
    CUDA intrinsics costs seconds the first time (only the CUDA family is imported).
    """

    def apply(self, func, target: Target, tunable: bool) -> s_tir.Schedule | None:
        if not isinstance(func, tirx.PrimFunc) or not self.is_target_available(target):
            return None
        sch = s_tir.Schedule(func)
        reductions = get_reduction_blocks(sch, sch.get_child_blocks(get_root_block(sch)))
        if reductions is None or gemm_dtype(sch.get(reductions[0])) != "float16":
            return None
        from tvmamp.tuning.intrinsics import only_target_intrinsics

        with only_target_intrinsics(("cuda",)):  # not every vendor's intrinsics
            return MatmulTensorization().apply(func, target, tunable)


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
            f"tvmamp.schedules.default_cuda_rules: target kind {target.kind.name!r} is not 'cuda'"
        )
    cc = compute_capability(target)
    tensor_core = [CUDATensorCoreMatmul()] if cc >= 80 else [WmmaFp16Matmul()] if cc >= 70 else []
    generic = [dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Reduction(), dl.gpu.GeneralReduction()]
    return [*(Guarded(rule) for rule in [*tensor_core, *generic]), dl.gpu.Fallback()]
