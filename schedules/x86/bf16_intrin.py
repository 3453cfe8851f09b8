"""The ``vdpbf16ps`` tensor intrinsic: 16 fp32 lanes += a bf16 pair x a pair-interleaved panel.

LLVM never selects ``vdpbf16ps`` from TVM's widened bf16 arithmetic, and TVM's codegen cannot
call ``llvm.x86.avx512bf16.dpbf16ps.512`` directly (it passes ``<32 x i16>`` where the intrinsic
wants ``<32 x bfloat>``). So a tiny LLVM IR function does the bit casts; it is linked into the
kernel through the ``pragma_import_llvm`` loop annotation and always inlined.

The intrinsic computes ``C[j] += sum_k A[k] * B[j, k]`` for ``j < 16``, ``k < 2``: ``A`` is a
bf16 pair of one row of the left operand, ``B`` 16 columns of the right operand stored as
``[16, 2]`` (pairs of consecutive ``k`` adjacent), ``C`` 16 fp32 accumulators in ``local`` scope.
"""

from __future__ import annotations

from tvm.s_tir import Schedule, TensorIntrin
from tvm.s_tir.schedule import LoopRV
from tvm.script import tirx as T

DPBF16PS_INTRIN = "tvmamp_x86_dpbf16ps_16x2"
LANES = 16  # fp32 accumulators per zmm register
PAIR = 2  # bf16 values per 32-bit lane

_HELPER = "tvmamp_dpbf16ps_16x2"

# <16 x float> acc, ptr to a bf16 pair, ptr to 32 bf16 (16 pairs) -> acc + dot products.
DPBF16PS_LLVM_IR = r"""
declare <16 x float> @llvm.x86.avx512bf16.dpbf16ps.512(<16 x float>, <32 x bfloat>, <32 x bfloat>)

define linkonce_odr <16 x float> @tvmamp_dpbf16ps_16x2(<16 x float> %acc, ptr %a, ptr %b) #0 {
  %pair = load i32, ptr %a, align 2
  %one = insertelement <16 x i32> poison, i32 %pair, i64 0
  %all = shufflevector <16 x i32> %one, <16 x i32> poison, <16 x i32> zeroinitializer
  %abf = bitcast <16 x i32> %all to <32 x bfloat>
  %bbf = load <32 x bfloat>, ptr %b, align 2
  %r = call <16 x float> @llvm.x86.avx512bf16.dpbf16ps.512(
      <16 x float> %acc, <32 x bfloat> %abf, <32 x bfloat> %bbf)
  ret <16 x float> %r
}

attributes #0 = { alwaysinline nounwind "target-features"="+avx512f,+avx512bf16" }
"""


@T.prim_func(s_tir=True)
def _dpbf16ps_desc(a: T.handle, b: T.handle, c: T.handle) -> None:
    A = T.match_buffer(a, (2,), "bfloat16", offset_factor=1)
    B = T.match_buffer(b, (16, 2), "bfloat16", offset_factor=1)
    C = T.match_buffer(c, (16,), "float32", offset_factor=1, scope="local")
    with T.sblock("root"):
        T.reads(C[0:16], A[0:2], B[0:16, 0:2])
        T.writes(C[0:16])
        for j, k in T.grid(16, 2):
            with T.sblock("update"):
                vj, vk = T.axis.remap("SR", [j, k])
                C[vj] = C[vj] + T.Cast("float32", A[vk]) * T.Cast("float32", B[vj, vk])


@T.prim_func(s_tir=True)
def _dpbf16ps_impl(a: T.handle, b: T.handle, c: T.handle) -> None:
    A = T.match_buffer(a, (2,), "bfloat16", offset_factor=1)
    B = T.match_buffer(b, (16, 2), "bfloat16", offset_factor=1)
    C = T.match_buffer(c, (16,), "float32", offset_factor=1, scope="local")
    with T.sblock("root"):
        T.reads(C[0:16], A[0:2], B[0:16, 0:2])
        T.writes(C[0:16])
        C[T.ramp(0, 1, 16)] = T.call_pure_extern(
            "float32x16",
            "tvmamp_dpbf16ps_16x2",
            C[T.ramp(0, 1, 16)],
            T.address_of(A[0]),
            T.address_of(B[0, 0]),
        )


def register() -> str:
    """Register the intrinsic with TVM once; return its name (usable by meta_schedule)."""
    if TensorIntrin.get(DPBF16PS_INTRIN, allow_missing=True) is None:
        TensorIntrin.register(DPBF16PS_INTRIN, _dpbf16ps_desc, _dpbf16ps_impl)
    return DPBF16PS_INTRIN


def import_helpers(sch: Schedule, loop: LoopRV, llvm_ir: str = DPBF16PS_LLVM_IR) -> None:
    """Link ``llvm_ir`` into the kernel that contains ``loop`` (LLVM targets only)."""
    sch.annotate(loop, "pragma_import_llvm", llvm_ir)


register()
