"""The software prefetch of a GEMM's next weight strip (schedules/cpu/prefetch.py)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import tirx as T

from tvmamp.pipeline import legalize_passes
from tvmamp.schedules.cpu import cpu_schedule_passes
from tvmamp.schedules.cpu.prefetch import KEY, inject_prefetch
from tvmamp.targets.llvm import _host_flags
from tvmamp.targets.llvm_lowering import tir_pipeline

TARGET = tvm.target.Target({"kind": "llvm", "mcpu": "znver4", "mattr": ["-sse4a"], "num-cores": 1})


# Strips j, passes i over each strip, steps k along it, rows r of the register tile.
@T.prim_func(s_tir=True)
def _marked(
    a: T.Buffer((16, 8), "float32"), b: T.Buffer((4, 8), "float32"), c: T.Buffer((16, 4), "float32")
):
    for j, i, k, r in T.grid(4, 4, 8, 4):
        with T.sblock("c"):
            vi = T.axis.spatial(16, i * 4 + r)
            vj, vk = T.axis.remap("SR", [j, k])
            T.reads(a[vi, vk], b[vj, vk])
            T.writes(c[vi, vj])
            T.sblock_attr({KEY: [1, 0, 1]})
            with T.init():
                c[vi, vj] = T.float32(0)
            c[vi, vj] = c[vi, vj] + a[vi, vk] * b[vj, vk]


@T.prim_func(s_tir=True)
def _prefetched(
    a: T.Buffer((16, 8), "float32"), b: T.Buffer((4, 8), "float32"), c: T.Buffer((16, 4), "float32")
):
    for j, i, k, r in T.grid(4, 4, 8, 4):
        if k % 4 == i and r == 0:
            T.call_llvm_intrin(
                "void", "llvm.prefetch.p0", T.address_of(b[T.min(j + 1, 3), k]), 0, 2, 1
            )
        with T.sblock("c"):
            vi = T.axis.spatial(16, i * 4 + r)
            vj, vk = T.axis.remap("SR", [j, k])
            T.reads(a[vi, vk], b[vj, vk])
            T.writes(c[vi, vj])
            T.sblock_attr({KEY: [1, 0, 1]})
            with T.init():
                c[vi, vj] = T.float32(0)
            c[vi, vj] = c[vi, vj] + a[vi, vk] * b[vj, vk]


def _inject(func: tvm.tirx.PrimFunc) -> tvm.tirx.PrimFunc:
    return inject_prefetch(tvm.IRModule({"main": func}))["main"]


def test_each_pass_fetches_its_share_of_the_next_strip_once_per_tile():
    """Pass i fetches the steps k with k % 4 == i, in the first row of the tile only; the strip
    index stays inside the buffer."""
    expected = _prefetched.with_attr("global_symbol", "_marked")
    tvm.ir.assert_structural_equal(_inject(_marked), expected)


def test_a_symbolic_number_of_passes_fetches_runs_of_the_strip():
    """Under a dynamic batch the passes are symbolic: pass i fetches the i-th of n runs of the
    strip, with no division in the innermost loop (it had no prefetch at all)."""

    @T.prim_func(s_tir=True)
    def marked(a: T.handle, b: T.Buffer((4, 8), "float32"), c: T.handle):
        n = T.int64()
        A = T.match_buffer(a, (n * 4, 8))
        C = T.match_buffer(c, (n * 4, 4))
        for j, i, k, r in T.grid(T.int64(4), n, T.int64(8), T.int64(4)):
            with T.sblock("c"):
                vi = T.axis.spatial(n * 4, i * 4 + r)
                vj, vk = T.axis.remap("SR", [j, k])
                T.reads(A[vi, vk], b[vj, vk])
                T.writes(C[vi, vj])
                T.sblock_attr({KEY: [1, 0, 1]})
                with T.init():
                    C[vi, vj] = T.float32(0)
                C[vi, vj] = C[vi, vj] + A[vi, vk] * b[vj, vk]

    lowered = _inject(marked).script()
    assert "i * T.int64(8) <= k * n and k * n < (i + T.int64(1)) * T.int64(8) and r" in lowered
    assert "%" not in lowered and "//" not in lowered


def test_a_strip_walked_once_gets_no_prefetch():
    """With one pass over each strip (a GEMV) there is no later walk to hide the fetch behind."""

    @T.prim_func(s_tir=True)
    def once(
        a: T.Buffer((4, 8), "float32"),
        b: T.Buffer((4, 8), "float32"),
        c: T.Buffer((4, 4), "float32"),
    ):
        for j, k, r in T.grid(4, 8, 4):
            with T.sblock("c"):
                vi, vj, vk = T.axis.remap("SSR", [r, j, k])
                T.reads(a[vi, vk], b[vj, vk])
                T.writes(c[vi, vj])
                T.sblock_attr({KEY: [1, 0, 1]})
                with T.init():
                    c[vi, vj] = T.float32(0)
                c[vi, vj] = c[vi, vj] + a[vi, vk] * b[vj, vk]

    tvm.ir.assert_structural_equal(_inject(once), once)


def _gemm(rows: int, dtype: str = "bfloat16", target=TARGET):
    """``a @ b`` scheduled for ``target``; an fp16 ``b`` is a constant (the F16C rule)."""
    bb = relax.BlockBuilder()
    a = relax.Var("a", relax.TensorType((rows, 96), dtype))
    params = [a]
    if dtype == "float16":
        b = relax.const(np.random.default_rng(0).standard_normal((96, 128)).astype(dtype))
    else:
        b = relax.Var("b", relax.TensorType((96, 128), dtype))
        params.append(b)
    with bb.function("main", params):
        with bb.dataflow():
            out = bb.emit_output(relax.op.matmul(a, b, out_dtype="float32"))
        bb.emit_func_output(out)
    with target:
        passes = [*legalize_passes(), *cpu_schedule_passes(target)]
        return tvm.transform.Sequential(passes)(bb.get())


def _gemm_kernel(mod: tvm.IRModule) -> tvm.tirx.PrimFunc:
    (kernel,) = [f for g, f in mod.functions_items() if g.name_hint.endswith("prepacked")]
    return kernel


@pytest.mark.parametrize(("rows", "fetches"), [(40, True), (3, False)])
def test_the_bf16_gemm_asks_for_the_prefetch_where_strips_are_walked_again(rows, fetches):
    lowered = _inject(_gemm_kernel(_gemm(rows))).script()
    assert KEY in lowered
    assert ("llvm.prefetch" in lowered) == fetches


def test_the_fp16_gemm_fetches_its_next_panel_too():
    """The F16C kernel (a CPU without avx512_bf16) splits its reduction in two loops: the
    step along the strip is their combined index."""
    target = tvm.target.Target({"kind": "llvm", "mcpu": "skylake-avx512", "num-cores": 1})
    lowered = _inject(_gemm_kernel(_gemm(40, "float16", target))).script()
    assert "llvm.prefetch" in lowered
    assert "(ax3_0 * T.int64(4) + ax3_1) % T.int64(5) == ax1_0" in lowered


def test_a_prefetching_gemm_matches_numpy(rng):
    """Built with the CPU pipeline that places the prefetch (40 rows: five passes per strip)."""
    mod = _gemm(40)
    kernel = _gemm_kernel(mod).with_attr("global_symbol", "main")
    asm = tvm.compile(kernel, target=TARGET, tir_pipeline=tir_pipeline(TARGET))
    assert "prefetcht1" in asm.mod.inspect_source("s")
    if "avx512_bf16" not in _host_flags():
        pytest.skip("the host CPU lacks avx512_bf16")
    a = rng.standard_normal((40, 96)).astype(ml_dtypes.bfloat16)
    b = rng.standard_normal((96, 128)).astype(ml_dtypes.bfloat16)
    exe = tvm.compile(mod, target=TARGET, tir_pipeline=tir_pipeline(TARGET))
    out = relax.VirtualMachine(exe, tvm.cpu())["main"](tvm.runtime.tensor(a), tvm.runtime.tensor(b))
    ref = a.astype("float64") @ b.astype("float64")
    np.testing.assert_allclose(out.numpy(), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
