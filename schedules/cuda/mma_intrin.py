"""Tensor-core intrinsics for fp16 and bf16 (ldmatrix + mma.sync m16n8k16, fp32 accumulation).

TVM 0.27 registers ldmatrix and mma intrinsics for fp16 only, and importing
``tvm.s_tir.tensor_intrin`` registers every intrinsic of every target (about 14 s once, far more
on a loaded machine). This module registers just the five intrinsics the tvmamp CUDA matmul rule
uses, for fp16 and bf16, under ``tvmamp_`` names, the first time :func:`intrin_group` is called.

Layout: a 16x16 tile in shared memory is held by a warp as ``[32 threads, 8 values]`` in the
ldmatrix fragment layout (:func:`fragment_layout`). A is ``[i, k]``; B is ``[j, k]`` ("NT") or
``[k, j]`` ("NN", transposed by ``ldmatrix.trans``); C is ``[i, j]`` in fp32.
"""

from __future__ import annotations

from tvm.s_tir import TensorIntrin
from tvm.script import tirx as T
from tvm.tirx import Cast

WARP = 32
TILE = 16
LOCAL = TILE * TILE // WARP  # 8 values per thread for each 16x16 fragment
DTYPES = {"float16": "fp16", "bfloat16": "bf16"}
LOAD_SCOPE = "shared.dyn"


def fragment_layout(i, j):
    """(row, col) of a 16x16 tile -> (thread, value) in the ldmatrix/mma fragment layout."""
    return 4 * (i % 8) + (j % 8) // 2, 4 * (j // 8) + (i // 8) * 2 + j % 2


def _fragment_to_tile(thread, value):
    """The inverse of :func:`fragment_layout`."""
    row = 8 * (value % 4 // 2) + thread // 4
    col = 8 * (value // 4) + (thread % 4) * 2 + value % 2
    return row, col


def _ldmatrix_offset(operand: str):
    """Shared-memory offset of the row each thread hands to ``ldmatrix.x4``."""
    if operand == "b_trans":  # B as [j, k]: the 8x8 matrices in the order the mma pair reads
        return lambda tx, stride: stride * 8 * (tx // 16) + stride * (tx % 8) + 8 * ((tx % 16) // 8)
    # A as [i, k], or B as [k, j] (transposed by ldmatrix.trans): rows 0-15, then columns 8-15
    return lambda tx, stride: stride * (tx % 16) + 8 * (tx // 16)


def _ldmatrix(dtype: str, operand: str):
    offset = _ldmatrix_offset(operand)
    transpose = operand == "b"

    @T.prim_func(s_tir=True)
    def desc(warp_handle: T.handle, shared_handle: T.handle) -> None:
        shared = T.match_buffer(
            shared_handle, (TILE, TILE), dtype, align=64, offset_factor=TILE, scope=LOAD_SCOPE
        )
        warp = T.match_buffer(
            warp_handle, (WARP, LOCAL), dtype, align=64, offset_factor=TILE, scope="warp"
        )
        with T.sblock("root"):
            T.reads(shared[0:TILE, 0:TILE])
            T.writes(warp[0:WARP, 0:LOCAL])
            for ax0, ax1 in T.grid(TILE, TILE):
                with T.sblock("shared_warp"):
                    v0, v1 = T.axis.remap("SS", [ax0, ax1])
                    thread, value = T.meta_var(fragment_layout(v0, v1))
                    T.reads(shared[v0, v1])
                    T.writes(warp[thread, value])
                    warp[thread, value] = shared[v0, v1]

    @T.prim_func(s_tir=True)
    def impl(warp_handle: T.handle, shared_handle: T.handle) -> None:
        s0 = T.int32()
        s1 = T.int32()
        shared = T.match_buffer(
            shared_handle,
            (TILE, TILE),
            dtype,
            align=64,
            offset_factor=TILE,
            scope=LOAD_SCOPE,
            strides=[s0, s1],
        )
        warp = T.match_buffer(
            warp_handle, (WARP, LOCAL), dtype, align=64, offset_factor=TILE, scope="warp"
        )
        with T.sblock("root"):
            T.reads(shared[0:TILE, 0:TILE])
            T.writes(warp[0:WARP, 0:LOCAL])
            for tx in T.thread_binding(0, WARP, "threadIdx.x"):
                T.evaluate(
                    T.ptx_legacy.ldmatrix(
                        transpose,
                        4,
                        ".b16",
                        warp.data,
                        warp.elem_offset + LOCAL * tx,
                        shared.access_ptr("r"),
                        offset(tx, s0),
                        dtype=dtype,
                    )
                )

    return desc, impl


def _mma(dtype: str, b_trans: bool):
    abbrev = DTYPES[dtype]

    def b_index(vj, vk):
        return fragment_layout(vj, vk) if b_trans else fragment_layout(vk, vj)

    @T.prim_func(s_tir=True)
    def desc(a: T.handle, b: T.handle, c: T.handle) -> None:
        A = T.match_buffer(a, (WARP, LOCAL), dtype, align=64, offset_factor=TILE, scope="warp")
        B = T.match_buffer(b, (WARP, LOCAL), dtype, align=64, offset_factor=TILE, scope="warp")
        C = T.match_buffer(c, (WARP, LOCAL), "float32", align=64, offset_factor=TILE, scope="warp")
        with T.sblock("root"):
            T.reads(C[0:WARP, 0:LOCAL], A[0:WARP, 0:LOCAL], B[0:WARP, 0:LOCAL])
            T.writes(C[0:WARP, 0:LOCAL])
            for i, j, k in T.grid(TILE, TILE, TILE):
                with T.sblock("C"):
                    vi, vj, vk = T.axis.remap("SSR", [i, j, k])
                    tc, lc = T.meta_var(fragment_layout(vi, vj))
                    ta, la = T.meta_var(fragment_layout(vi, vk))
                    tb, lb = T.meta_var(b_index(vj, vk))
                    T.reads(C[tc, lc], A[ta, la], B[tb, lb])
                    T.writes(C[tc, lc])
                    C[tc, lc] += Cast("float32", A[ta, la]) * Cast("float32", B[tb, lb])

    @T.prim_func(s_tir=True)
    def impl(a: T.handle, b: T.handle, c: T.handle) -> None:
        A = T.match_buffer(a, (WARP, LOCAL), dtype, align=64, offset_factor=TILE, scope="warp")
        B = T.match_buffer(b, (WARP, LOCAL), dtype, align=64, offset_factor=TILE, scope="warp")
        C = T.match_buffer(c, (WARP, LOCAL), "float32", align=64, offset_factor=TILE, scope="warp")
        with T.sblock("root"):
            T.reads(C[0:WARP, 0:LOCAL], A[0:WARP, 0:LOCAL], B[0:WARP, 0:LOCAL])
            T.writes(C[0:WARP, 0:LOCAL])
            for tx in T.thread_binding(0, WARP, "threadIdx.x"):
                for half in T.unroll(2):  # two m16n8k16 ops cover the 16x16 output tile
                    T.evaluate(
                        T.ptx_legacy.mma(
                            "m16n8k16",
                            "row",
                            "col",
                            abbrev,
                            abbrev,
                            "fp32",
                            A.data,
                            A.elem_offset + tx * LOCAL,
                            B.data,
                            B.elem_offset + tx * LOCAL + half * (LOCAL // 2),
                            C.data,
                            C.elem_offset + tx * LOCAL + half * (LOCAL // 2),
                            False,
                            dtype="float32",
                        )
                    )

    return desc, impl


def _fill():
    @T.prim_func(s_tir=True)
    def desc(a: T.handle) -> None:
        C = T.match_buffer(a, (WARP, LOCAL), "float32", scope="warp")
        with T.sblock("root"):
            T.reads()
            T.writes(C[0:WARP, 0:LOCAL])
            for i0, i1 in T.grid(TILE, TILE):
                with T.sblock("C_warp"):
                    i, j = T.axis.remap("SS", [i0, i1])
                    thread, value = T.meta_var(fragment_layout(i, j))
                    T.reads()
                    T.writes(C[thread, value])
                    C[thread, value] = T.float32(0)

    @T.prim_func(s_tir=True)
    def impl(a: T.handle) -> None:
        C = T.match_buffer(a, (WARP, LOCAL), "float32", scope="warp", offset_factor=1)
        with T.sblock("root"):
            T.reads()
            T.writes(C[0:WARP, 0:LOCAL])
            for tx in T.thread_binding(0, WARP, "threadIdx.x"):  # noqa: B007
                T.evaluate(T.cuda.mma_fill_legacy(LOCAL, C.data, C.elem_offset, dtype="float32"))

    return desc, impl


def _store(scope: str):
    @T.prim_func(s_tir=True)
    def desc(a: T.handle, c: T.handle) -> None:
        C_warp = T.match_buffer(a, (WARP, LOCAL), "float32", scope="warp")
        C = T.match_buffer(c, (TILE, TILE), "float32", scope=scope)
        with T.sblock("root"):
            T.reads(C_warp[0:WARP, 0:LOCAL])
            T.writes(C[0:TILE, 0:TILE])
            for i0, i1 in T.grid(TILE, TILE):
                with T.sblock("C_warp"):
                    v0, v1 = T.axis.remap("SS", [i0, i1])
                    thread, value = T.meta_var(fragment_layout(v0, v1))
                    T.reads(C_warp[thread, value])
                    T.writes(C[v0, v1])
                    C[v0, v1] = C_warp[thread, value]

    @T.prim_func(s_tir=True)
    def impl(a: T.handle, c: T.handle) -> None:
        s0 = T.int32()
        s1 = T.int32()
        C_warp = T.match_buffer(a, (WARP, LOCAL), "float32", scope="warp", offset_factor=1)
        C = T.match_buffer(
            c, (TILE, TILE), "float32", scope=scope, offset_factor=1, strides=[s0, s1]
        )
        with T.sblock("root"):
            T.reads(C_warp[0:WARP, 0:LOCAL])
            T.writes(C[0:TILE, 0:TILE])
            for tx in T.thread_binding(0, WARP, "threadIdx.x"):
                for value in T.serial(LOCAL):
                    row, col = T.meta_var(_fragment_to_tile(tx, value))
                    C[row, col] = C_warp[tx, value]

    return desc, impl


def _register(name: str, make) -> str:
    if TensorIntrin.get(name, allow_missing=True) is None:
        TensorIntrin.register(name, *make())
    return name


def intrin_group(dtype: str, b_trans: bool, store_scope: str = "shared.dyn") -> dict[str, str]:
    """Register (once) and name the tensor intrinsics for one input dtype and B layout.

    Parameters
    ----------
    dtype : str
        "float16" or "bfloat16"; the accumulator is always float32.
    b_trans : bool
        True when B is held as ``[j, k]`` (K contiguous), False for ``[k, j]`` (N contiguous,
        transposed on the fly by ``ldmatrix.trans``).
    store_scope : str
        Where the accumulator tiles are stored: "shared.dyn" or "global".

    Returns
    -------
    dict
        Intrinsic names under "load_a", "load_b", "compute", "init" and "store".
    """
    if dtype not in DTYPES:
        raise ValueError(
            f"tvmamp.schedules.cuda.mma_intrin: dtype {dtype!r} is not one of {', '.join(DTYPES)}"
        )
    short = DTYPES[dtype]
    b = "b_trans" if b_trans else "b"
    suffix = "_trans_b" if b_trans else ""
    scope = store_scope.replace(".", "_")
    return {
        "load_a": _register(f"tvmamp_ldmatrix_{short}_a", lambda: _ldmatrix(dtype, "a")),
        "load_b": _register(f"tvmamp_ldmatrix_{short}_{b}", lambda: _ldmatrix(dtype, b)),
        "compute": _register(f"tvmamp_mma_{short}{short}f32{suffix}", lambda: _mma(dtype, b_trans)),
        "init": _register("tvmamp_mma_fill_16x16_f32", _fill),
        "store": _register(f"tvmamp_mma_store_16x16_f32_{scope}", lambda: _store(store_scope)),
    }
