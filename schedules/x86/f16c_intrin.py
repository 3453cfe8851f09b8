"""The F16C multiply-add tensor intrinsic: fp32 lanes += an fp32 scalar x widened fp16 lanes.

The fp16 matmul rule widens its left operand once into an fp32 copy with
``unsafe_set_dtype``, which makes every read of that copy ``f32(f16(a))``. That round trip is
the identity here (every value of the copy came from fp16), but LLVM must keep it, and per
``k`` step and row it costs a scalar conversion, a 16-bit broadcast and a full-width
``vcvtph2ps``. This intrinsic matches that update and replaces it with
``C[0:L] += broadcast(a) * f32(B[0:L])``: one ``vcvtph2ps`` per weight vector (shared by the
unrolled rows) and FMAs that broadcast the fp32 value from memory.
"""

from __future__ import annotations

from tvm.s_tir import TensorIntrin
from tvm.script import tirx as T


def intrin_name(lanes: int) -> str:
    """The registered name of the ``lanes``-wide intrinsic."""
    return f"tvmamp_x86_f16c_fma_{lanes}"


def _make(lanes: int):
    """Return the (description, implementation) PrimFuncs for ``lanes`` fp32 accumulators."""
    vector = f"float32x{lanes}"

    @T.prim_func(s_tir=True)
    def desc(a: T.handle, b: T.handle, c: T.handle) -> None:
        A = T.match_buffer(a, (1,), "float32", offset_factor=1)
        B = T.match_buffer(b, (lanes,), "float16", offset_factor=1)
        C = T.match_buffer(c, (lanes,), "float32", offset_factor=1, scope="local")
        with T.sblock("root"):
            T.reads(C[0:lanes], A[0:1], B[0:lanes])
            T.writes(C[0:lanes])
            for j in range(lanes):
                with T.sblock("update"):
                    vj = T.axis.remap("S", [j])
                    C[vj] = C[vj] + T.Cast("float32", T.Cast("float16", A[0])) * T.Cast(
                        "float32", B[vj]
                    )

    @T.prim_func(s_tir=True)
    def impl(a: T.handle, b: T.handle, c: T.handle) -> None:
        A = T.match_buffer(a, (1,), "float32", offset_factor=1)
        B = T.match_buffer(b, (lanes,), "float16", offset_factor=1)
        C = T.match_buffer(c, (lanes,), "float32", offset_factor=1, scope="local")
        with T.sblock("root"):
            T.reads(C[0:lanes], A[0:1], B[0:lanes])
            T.writes(C[0:lanes])
            C[T.ramp(0, 1, lanes)] = C[T.ramp(0, 1, lanes)] + T.broadcast(A[0], lanes) * T.Cast(
                vector, B[T.ramp(0, 1, lanes)]
            )

    return desc, impl


def register(lanes: int) -> str:
    """Register (once) the ``lanes``-wide intrinsic and return its name.

    Parameters
    ----------
    lanes : int
        fp32 values per SIMD register of the target: 16 (AVX-512) or 8 (AVX2).

    Raises
    ------
    ValueError
        When ``lanes`` is not 8 or 16.
    """
    if lanes not in (8, 16):
        raise ValueError(f"tvmamp.schedules.x86.f16c_intrin: lanes {lanes} is not one of 8, 16")
    name = intrin_name(lanes)
    if TensorIntrin.get(name, allow_missing=True) is None:
        TensorIntrin.register(name, *_make(lanes))
    return name
