"""x86 tensor intrinsics of tvmamp's CPU rules, each with its LLVM IR micro-kernel.

- :mod:`.bf16_intrin`: ``vdpbf16ps`` (avx512_bf16), 16 fp32 lanes += a bf16 pair x a panel;
- :mod:`.amx_intrin`: AMX ``tdpbf16ps``, a 32 x 32 fp32 block over a block of ``K``;
- :mod:`.f16c_intrin`: F16C ``vcvtph2ps`` + fp32 FMA for fp16 weights.
"""

from . import amx_intrin, bf16_intrin, f16c_intrin

__all__ = ["amx_intrin", "bf16_intrin", "f16c_intrin"]
