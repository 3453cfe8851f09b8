"""TVM's wmma m16n16k16 tensor-core rule for fp16 GEMMs, the CUDA path below sm_80."""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.s_tir.dlight.analysis import get_root_block
from tvm.s_tir.dlight.gpu.base import GPUScheduleRule
from tvm.s_tir.dlight.gpu.matmul import MatmulTensorization, get_reduction_blocks
from tvm.target import Target

from ..intrin_loader import only_target_intrinsics
from .matmul import gemm_dtype


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
        with only_target_intrinsics(("cuda",)):  # not every vendor's intrinsics
            return MatmulTensorization().apply(func, target, tunable)


__all__ = ["WmmaFp16Matmul"]
