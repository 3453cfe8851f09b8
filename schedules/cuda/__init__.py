"""tvmamp's CUDA schedules: the mma.sync tensor-core rule, its intrinsics and the default rules."""

from .arch import compute_capability
from .default_rules import default_cuda_rules
from .matmul import CUDATensorCoreMatmul
from .wmma_matmul import WmmaFp16Matmul

__all__ = ["CUDATensorCoreMatmul", "WmmaFp16Matmul", "compute_capability", "default_cuda_rules"]
