"""tvmamp's CPU schedules: dlight rules for matmul (fp32, bf16, fp16), conv2d and injective ops.

The bf16 rules tensorize with the ``vdpbf16ps`` and AMX intrinsics of
:mod:`tvmamp.schedules.x86`, the fp16 matmul rule with its F16C intrinsic.
:func:`cpu_schedule_passes` is what the LLVM target entry schedules with.
"""

from .bf16_common import has_amx_bf16, has_avx512bf16
from .bf16_matmul import CPUMatmulBF16
from .bf16_passes import SplitPreproc
from .conv import CPUConv2d
from .default_rules import cpu_schedule_passes, default_cpu_rules
from .elementwise import CPUElementwise
from .fp16_matmul import CPUMatmulFP16, has_f16c
from .matmul import CPUMatmul

__all__ = [
    "CPUConv2d",
    "CPUElementwise",
    "CPUMatmul",
    "CPUMatmulBF16",
    "CPUMatmulFP16",
    "SplitPreproc",
    "cpu_schedule_passes",
    "default_cpu_rules",
    "has_amx_bf16",
    "has_avx512bf16",
    "has_f16c",
]
