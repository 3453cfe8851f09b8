"""The AMX tensor intrinsic: a 32 x 32p fp32 block += tile-packed ``A`` x pair-interleaved ``B``.

On CPUs with AMX (``amx-tile``, ``amx-bf16``), ``tdpbf16ps`` multiplies 16 x 32 bf16 tiles at
about eight times the rate of ``vdpbf16ps``. An LLVM IR micro-kernel walks ``p`` panels of 32
columns with the same 32 rows of ``A``: for each it loads the 2 x 2 fp32 accumulator tiles,
runs a block of ``K`` with them in tile registers and stores them back (LLVM inserts
``ldtilecfg`` and ``tilerelease`` once per call). Linux hands out AMX state only on request, so
the kernel asks once per process (``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``), from
the kernel itself, which keeps exported libraries self-contained.

Both operands are tile-contiguous, so every tile load reads 1 KB in a row (no L1 set conflicts
from a large row stride, hardware prefetch friendly): ``A`` is packed to
``[I / 16, K / 32, 16, 32]`` and ``B`` is the pair-interleaved ``[J / 16, K / 2, 16, 2]``
layout of ``vdpbf16ps``, whose 16 consecutive pairs of one 16-column panel are one AMX tile.
The outer panel strides are arguments, so a block of ``K`` can be a slice of a longer ``K``.
"""

from __future__ import annotations

import re

from tvm.s_tir import TensorIntrin
from tvm.script import tirx as T

ROWS = 32  # rows of the accumulator block (two 16-row tiles)
COLS = 32  # columns of the accumulator block (two 16-column panels)
K_STEP = 32  # bf16 values of K per tile step (64 bytes)
# The names :func:`amx_intrin` registers: columns per call, reduction length, accumulator scope.
NAME_PATTERN = re.compile(r"tvmamp_x86_amx_bf16_32x(\d+)x(\d+)_(local|global)")

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

define linkonce_odr void @tvmamp_amx_bf16_32xn(ptr %c, i64 %ldc, ptr %a, i64 %lda, ptr %b,
    i64 %ldb, i64 %steps, i64 %panels) noinline nounwind #0 {
entry:
  call void @tvmamp_amx_request()
  %c16 = mul i64 %ldc, 16
  %a1 = getelementptr i8, ptr %a, i64 %lda
  %ldb2 = mul i64 %ldb, 2
  br label %panel
panel:
  %p = phi i64 [ 0, %entry ], [ %pn, %store ]
  %pc_off = mul i64 %p, 128
  %pb_off = mul i64 %p, %ldb2
  %c00 = getelementptr i8, ptr %c, i64 %pc_off
  %c01 = getelementptr i8, ptr %c00, i64 64
  %c10 = getelementptr i8, ptr %c00, i64 %c16
  %c11 = getelementptr i8, ptr %c10, i64 64
  %b0 = getelementptr i8, ptr %b, i64 %pb_off
  %b1 = getelementptr i8, ptr %b0, i64 %ldb
  %i00 = call x86_amx @llvm.x86.tileloadd64.internal(i16 16, i16 64, ptr %c00, i64 %ldc)
  %i01 = call x86_amx @llvm.x86.tileloadd64.internal(i16 16, i16 64, ptr %c01, i64 %ldc)
  %i10 = call x86_amx @llvm.x86.tileloadd64.internal(i16 16, i16 64, ptr %c10, i64 %ldc)
  %i11 = call x86_amx @llvm.x86.tileloadd64.internal(i16 16, i16 64, ptr %c11, i64 %ldc)
  br label %loop
loop:
  %k = phi i64 [ 0, %panel ], [ %kn, %loop ]
  %x00 = phi x86_amx [ %i00, %panel ], [ %y00, %loop ]
  %x01 = phi x86_amx [ %i01, %panel ], [ %y01, %loop ]
  %x10 = phi x86_amx [ %i10, %panel ], [ %y10, %loop ]
  %x11 = phi x86_amx [ %i11, %panel ], [ %y11, %loop ]
  %kt = mul i64 %k, 1024
  %pa0 = getelementptr i8, ptr %a, i64 %kt
  %pa1 = getelementptr i8, ptr %a1, i64 %kt
  %pb0 = getelementptr i8, ptr %b0, i64 %kt
  %pb1 = getelementptr i8, ptr %b1, i64 %kt
  %ta0 = call x86_amx @llvm.x86.tileloadd64.internal(i16 16, i16 64, ptr %pa0, i64 64)
  %tb0 = call x86_amx @llvm.x86.tileloadd64.internal(i16 16, i16 64, ptr %pb0, i64 64)
  %y00 = call x86_amx @llvm.x86.tdpbf16ps.internal(i16 16, i16 64, i16 64,
      x86_amx %x00, x86_amx %ta0, x86_amx %tb0)
  %tb1 = call x86_amx @llvm.x86.tileloadd64.internal(i16 16, i16 64, ptr %pb1, i64 64)
  %y01 = call x86_amx @llvm.x86.tdpbf16ps.internal(i16 16, i16 64, i16 64,
      x86_amx %x01, x86_amx %ta0, x86_amx %tb1)
  %ta1 = call x86_amx @llvm.x86.tileloadd64.internal(i16 16, i16 64, ptr %pa1, i64 64)
  %y10 = call x86_amx @llvm.x86.tdpbf16ps.internal(i16 16, i16 64, i16 64,
      x86_amx %x10, x86_amx %ta1, x86_amx %tb0)
  %y11 = call x86_amx @llvm.x86.tdpbf16ps.internal(i16 16, i16 64, i16 64,
      x86_amx %x11, x86_amx %ta1, x86_amx %tb1)
  %kn = add i64 %k, 1
  %more = icmp ult i64 %kn, %steps
  br i1 %more, label %loop, label %store
store:
  call void @llvm.x86.tilestored64.internal(i16 16, i16 64, ptr %c00, i64 %ldc, x86_amx %y00)
  call void @llvm.x86.tilestored64.internal(i16 16, i16 64, ptr %c01, i64 %ldc, x86_amx %y01)
  call void @llvm.x86.tilestored64.internal(i16 16, i16 64, ptr %c10, i64 %ldc, x86_amx %y10)
  call void @llvm.x86.tilestored64.internal(i16 16, i16 64, ptr %c11, i64 %ldc, x86_amx %y11)
  %pn = add i64 %p, 1
  %again = icmp ult i64 %pn, %panels
  br i1 %again, label %panel, label %exit
exit:
  ret void
}

attributes #0 = { "target-features"="+amx-tile,+amx-bf16,+avx512f" }
"""


def _intrin_functions(k: int, scope: str, panels: int) -> tuple:
    """Return the (description, implementation) PrimFuncs for ``k`` values of the reduction and
    ``panels`` blocks of 32 columns."""
    steps, cols = k // K_STEP, COLS * panels

    @T.prim_func(s_tir=True)
    def desc(a: T.handle, b: T.handle, c: T.handle) -> None:
        A = T.match_buffer(
            a, (2, steps, 16, 32), "bfloat16", offset_factor=1, strides=[T.int64(), 512, 32, 1]
        )
        B = T.match_buffer(
            b, (2 * panels, k // 2, 16, 2), "bfloat16", offset_factor=1,
            strides=[T.int64(), 32, 2, 1],
        )  # fmt: skip
        C = T.match_buffer(
            c, (32, cols), "float32", offset_factor=1, scope=scope, strides=[T.int64(), 1]
        )
        with T.sblock("root"):
            T.reads(
                C[0:32, 0:cols],
                A[0:2, 0:steps, 0:16, 0:32],
                B[0 : 2 * panels, 0 : k // 2, 0:16, 0:2],
            )
            T.writes(C[0:32, 0:cols])
            for i, j, r in T.grid(32, cols, k):
                with T.sblock("update"):
                    vi, vj, vr = T.axis.remap("SSR", [i, j, r])
                    C[vi, vj] = C[vi, vj] + T.Cast(
                        "float32", A[vi // 16, vr // 32, vi % 16, vr % 32]
                    ) * T.Cast("float32", B[vj // 16, vr // 2, vj % 16, vr % 2])

    @T.prim_func(s_tir=True)
    def impl(a: T.handle, b: T.handle, c: T.handle) -> None:
        lda = T.int64()
        ldb = T.int64()
        ldc = T.int64()
        A = T.match_buffer(
            a, (2, steps, 16, 32), "bfloat16", offset_factor=1, strides=[lda, 512, 32, 1]
        )
        B = T.match_buffer(
            b, (2 * panels, k // 2, 16, 2), "bfloat16", offset_factor=1, strides=[ldb, 32, 2, 1]
        )
        C = T.match_buffer(c, (32, cols), "float32", offset_factor=1, scope=scope, strides=[ldc, 1])
        with T.sblock("root"):
            T.reads(
                C[0:32, 0:cols],
                A[0:2, 0:steps, 0:16, 0:32],
                B[0 : 2 * panels, 0 : k // 2, 0:16, 0:2],
            )
            T.writes(C[0:32, 0:cols])
            T.evaluate(
                T.call_extern(
                    "void",
                    "tvmamp_amx_bf16_32xn",
                    T.address_of(C[0, 0]),
                    ldc * 4,
                    T.address_of(A[0, 0, 0, 0]),
                    lda * 2,
                    T.address_of(B[0, 0, 0, 0]),
                    ldb * 2,
                    T.int64(steps),
                    T.int64(panels),
                )
            )

    return desc, impl


def amx_intrin(k: int, scope: str = "local", panels: int = 1) -> str:
    """Register (once) and return the name of the AMX intrinsic for a ``k``-long reduction block.

    Parameters
    ----------
    k : int
        Reduction values per call, a multiple of :data:`K_STEP`.
    scope : str
        Storage scope of the fp32 accumulator block: ``"local"`` (the call's ``32 x 32 *
        panels`` block) or ``"global"`` (a slice of a larger buffer that accumulates across
        blocks of ``K``).
    panels : int
        Blocks of 32 columns that one call walks with the same 32 rows of ``A``; the tile
        configuration and the call are paid once for all of them.
    """
    if k % K_STEP:
        raise ValueError(f"tvmamp.schedules: AMX reduction length {k} is not a multiple of 32")
    if scope not in ("local", "global"):
        raise ValueError(f"tvmamp.schedules: AMX accumulator scope {scope!r} is not local/global")
    if panels < 1:
        raise ValueError(f"tvmamp.schedules: AMX column panels per call {panels} is not positive")
    name = f"tvmamp_x86_amx_bf16_32x{COLS * panels}x{k}_{scope}"
    if TensorIntrin.get(name, allow_missing=True) is None:
        TensorIntrin.register(name, *_intrin_functions(k, scope, panels))
    return name
