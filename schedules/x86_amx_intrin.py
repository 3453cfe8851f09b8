"""The AMX tensor intrinsic: a 32 x 32 fp32 tile += bf16 ``[32, K]`` x pair-interleaved ``[K, 32]``.

On CPUs with AMX (``amx-tile``, ``amx-bf16``), ``tdpbf16ps`` multiplies 16 x 32 bf16 tiles at
about eight times the rate of ``vdpbf16ps``. An LLVM IR micro-kernel keeps the 2 x 2 fp32
accumulator tiles in tile registers across the whole ``K`` loop (LLVM inserts ``ldtilecfg`` and
``tilerelease``). Linux hands out AMX state only on request, so the kernel asks once per process
(``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``), from the kernel itself, which keeps
exported libraries self-contained.

The right operand is the same pair-interleaved ``[J / 16, K / 2, 16, 2]`` layout as for
``vdpbf16ps``: 16 consecutive pairs of one 16-column panel are exactly one AMX ``B`` tile.
"""

from __future__ import annotations

from tvm.s_tir import TensorIntrin
from tvm.script import tirx as T

ROWS = 32  # rows of the accumulator block (two 16-row tiles)
COLS = 32  # columns of the accumulator block (two 16-column panels)
K_STEP = 32  # bf16 values of K per tile step (64 bytes)

AMX_LLVM_IR = r"""
declare x86_amx @llvm.x86.tileloadd64.internal(i16, i16, ptr, i64)
declare x86_amx @llvm.x86.tdpbf16ps.internal(i16, i16, i16, x86_amx, x86_amx, x86_amx)
declare void @llvm.x86.tilestored64.internal(i16, i16, ptr, i64, x86_amx)
declare i64 @syscall(i64, ...)

@tvmamp_amx_granted = linkonce_odr global i32 0

define linkonce_odr void @tvmamp_amx_request() noinline nounwind {
entry:
  %granted = load atomic i32, ptr @tvmamp_amx_granted monotonic, align 4
  %ok = icmp ne i32 %granted, 0
  br i1 %ok, label %done, label %ask
ask:
  %r = call i64 (i64, ...) @syscall(i64 158, i64 4131, i64 18)
  store atomic i32 1, ptr @tvmamp_amx_granted monotonic, align 4
  br label %done
done:
  ret void
}

define linkonce_odr void @tvmamp_amx_bf16_32x32(ptr %c, i64 %ldc, ptr %a, i64 %lda, ptr %b,
                                                i64 %ldp, i64 %steps) noinline nounwind #0 {
entry:
  call void @tvmamp_amx_request()
  %c16 = mul i64 %ldc, 16
  %c01 = getelementptr i8, ptr %c, i64 64
  %c10 = getelementptr i8, ptr %c, i64 %c16
  %c11 = getelementptr i8, ptr %c10, i64 64
  %a16 = mul i64 %lda, 16
  %a1 = getelementptr i8, ptr %a, i64 %a16
  %b1 = getelementptr i8, ptr %b, i64 %ldp
  %i00 = call x86_amx @llvm.x86.tileloadd64.internal(i16 16, i16 64, ptr %c, i64 %ldc)
  %i01 = call x86_amx @llvm.x86.tileloadd64.internal(i16 16, i16 64, ptr %c01, i64 %ldc)
  %i10 = call x86_amx @llvm.x86.tileloadd64.internal(i16 16, i16 64, ptr %c10, i64 %ldc)
  %i11 = call x86_amx @llvm.x86.tileloadd64.internal(i16 16, i16 64, ptr %c11, i64 %ldc)
  br label %loop
loop:
  %k = phi i64 [ 0, %entry ], [ %kn, %loop ]
  %x00 = phi x86_amx [ %i00, %entry ], [ %y00, %loop ]
  %x01 = phi x86_amx [ %i01, %entry ], [ %y01, %loop ]
  %x10 = phi x86_amx [ %i10, %entry ], [ %y10, %loop ]
  %x11 = phi x86_amx [ %i11, %entry ], [ %y11, %loop ]
  %ka = mul i64 %k, 64
  %kb = mul i64 %k, 1024
  %pa0 = getelementptr i8, ptr %a, i64 %ka
  %pa1 = getelementptr i8, ptr %a1, i64 %ka
  %pb0 = getelementptr i8, ptr %b, i64 %kb
  %pb1 = getelementptr i8, ptr %b1, i64 %kb
  %ta0 = call x86_amx @llvm.x86.tileloadd64.internal(i16 16, i16 64, ptr %pa0, i64 %lda)
  %ta1 = call x86_amx @llvm.x86.tileloadd64.internal(i16 16, i16 64, ptr %pa1, i64 %lda)
  %tb0 = call x86_amx @llvm.x86.tileloadd64.internal(i16 16, i16 64, ptr %pb0, i64 64)
  %tb1 = call x86_amx @llvm.x86.tileloadd64.internal(i16 16, i16 64, ptr %pb1, i64 64)
  %y00 = call x86_amx @llvm.x86.tdpbf16ps.internal(i16 16, i16 64, i16 64,
      x86_amx %x00, x86_amx %ta0, x86_amx %tb0)
  %y01 = call x86_amx @llvm.x86.tdpbf16ps.internal(i16 16, i16 64, i16 64,
      x86_amx %x01, x86_amx %ta0, x86_amx %tb1)
  %y10 = call x86_amx @llvm.x86.tdpbf16ps.internal(i16 16, i16 64, i16 64,
      x86_amx %x10, x86_amx %ta1, x86_amx %tb0)
  %y11 = call x86_amx @llvm.x86.tdpbf16ps.internal(i16 16, i16 64, i16 64,
      x86_amx %x11, x86_amx %ta1, x86_amx %tb1)
  %kn = add i64 %k, 1
  %more = icmp ult i64 %kn, %steps
  br i1 %more, label %loop, label %exit
exit:
  call void @llvm.x86.tilestored64.internal(i16 16, i16 64, ptr %c, i64 %ldc, x86_amx %y00)
  call void @llvm.x86.tilestored64.internal(i16 16, i16 64, ptr %c01, i64 %ldc, x86_amx %y01)
  call void @llvm.x86.tilestored64.internal(i16 16, i16 64, ptr %c10, i64 %ldc, x86_amx %y10)
  call void @llvm.x86.tilestored64.internal(i16 16, i16 64, ptr %c11, i64 %ldc, x86_amx %y11)
  ret void
}

attributes #0 = { "target-features"="+amx-tile,+amx-bf16,+avx512f" }
"""


def _intrin_functions(k: int) -> tuple:
    """Return the (description, implementation) PrimFuncs for a reduction of ``k`` values."""

    @T.prim_func(s_tir=True)
    def desc(a: T.handle, b: T.handle, c: T.handle) -> None:
        A = T.match_buffer(a, (32, k), "bfloat16", offset_factor=1, strides=[T.int64(), 1])
        B = T.match_buffer(b, (2, k // 2, 16, 2), "bfloat16", offset_factor=1)
        C = T.match_buffer(
            c, (32, 32), "float32", offset_factor=1, scope="local", strides=[T.int64(), 1]
        )
        with T.sblock("root"):
            T.reads(C[0:32, 0:32], A[0:32, 0:k], B[0:2, 0 : k // 2, 0:16, 0:2])
            T.writes(C[0:32, 0:32])
            for i, j, r in T.grid(32, 32, k):
                with T.sblock("update"):
                    vi, vj, vr = T.axis.remap("SSR", [i, j, r])
                    C[vi, vj] = C[vi, vj] + T.Cast("float32", A[vi, vr]) * T.Cast(
                        "float32", B[vj // 16, vr // 2, vj % 16, vr % 2]
                    )

    @T.prim_func(s_tir=True)
    def impl(a: T.handle, b: T.handle, c: T.handle) -> None:
        lda = T.int64()
        ldc = T.int64()
        A = T.match_buffer(a, (32, k), "bfloat16", offset_factor=1, strides=[lda, 1])
        B = T.match_buffer(b, (2, k // 2, 16, 2), "bfloat16", offset_factor=1)
        C = T.match_buffer(c, (32, 32), "float32", offset_factor=1, scope="local", strides=[ldc, 1])
        with T.sblock("root"):
            T.reads(C[0:32, 0:32], A[0:32, 0:k], B[0:2, 0 : k // 2, 0:16, 0:2])
            T.writes(C[0:32, 0:32])
            T.evaluate(
                T.call_extern(
                    "void",
                    "tvmamp_amx_bf16_32x32",
                    T.address_of(C[0, 0]),
                    ldc * 4,
                    T.address_of(A[0, 0]),
                    lda * 2,
                    T.address_of(B[0, 0, 0, 0]),
                    T.int64(k * 32),
                    T.int64(k // 32),
                )
            )

    return desc, impl


def amx_intrin(k: int) -> str:
    """Register (once) and return the name of the AMX intrinsic for a ``k``-long reduction."""
    if k % K_STEP:
        raise ValueError(f"tvmamp.schedules: AMX reduction length {k} is not a multiple of 32")
    name = f"tvmamp_x86_amx_bf16_32x32x{k}"
    if TensorIntrin.get(name, allow_missing=True) is None:
        TensorIntrin.register(name, *_intrin_functions(k))
    return name
