"""tvmamp's TIR lowering for CPUs: register tiles stay on the stack, in parallel kernels too."""

from __future__ import annotations

import re

import numpy as np
import pytest
import tvm
import tvm_ffi
from tolerances import assert_close, tolerance
from tvm import relax
from tvm.script import tirx as T

import tvmamp
from tvmamp.targets import llvm_lowering
from tvmamp.targets.cpu_features import cpuinfo_flags
from tvmamp.targets.llvm_lowering import DISABLE_LOWER_BUILTIN, stack_local_tiles

# A bf16 GEMM kernel forced to the avx512_bf16 path; two cores make its outer loop parallel.
ZNVER4 = "llvm -mcpu=znver4 -num-cores={cores}"


def _alloc_annotations(func: tvm.tirx.PrimFunc) -> dict[str, dict]:
    """Buffer name -> annotations of each AllocBuffer in ``func``."""
    found = {}

    def record(node):
        found[node.buffer.name] = dict(node.annotations or {})
        return node

    tvm_ffi.structural_map(func.body, [(tvm.tirx.AllocBuffer, record)])
    return found


@T.prim_func(private=True, s_tir=True)
def _with_allocs(a: T.Buffer((64,), "float32"), b: T.Buffer((64,), "float32")):
    tile = T.alloc_buffer((16,), "float32", scope="local")
    big = T.alloc_buffer((2048,), "float32", scope="local")
    shared = T.alloc_buffer((16,), "float32")
    for i in range(16):
        tile[i] = a[i]
        big[i] = a[i + 16]
        shared[i] = a[i + 32]
    for i in range(16):
        b[i] = tile[i] + big[i] + shared[i]


def test_only_small_static_local_buffers_are_marked():
    """The 64-byte local tile is marked; an 8 KB local buffer and a global one are left alone."""
    mod = tvm.IRModule({"main": _with_allocs})
    mod = tvm.s_tir.transform.LowerOpaqueBlock()(tvm.s_tir.transform.LowerInitBlock()(mod))
    before = _alloc_annotations(mod["main"])
    assert set(before) == {"tile", "big", "shared"}, before
    assert not any(DISABLE_LOWER_BUILTIN in a for a in before.values())
    after = _alloc_annotations(stack_local_tiles(mod)["main"])
    assert bool(after["tile"][DISABLE_LOWER_BUILTIN])
    assert DISABLE_LOWER_BUILTIN not in after["big"]
    assert DISABLE_LOWER_BUILTIN not in after["shared"]


def _gemm(m: int, k: int, n: int, rng) -> tuple[tvm.IRModule, np.ndarray]:
    weight = (rng.standard_normal((k, n)) * 0.05).astype("float32")
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((m, k), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(relax.op.matmul(x, relax.const(weight)))
            out = bb.emit_output(relax.op.nn.relu(y))
        bb.emit_func_output(out)
    return bb.get(), weight


def _parallel_lambdas(ll: str) -> list[str]:
    """The bodies of the parallel closures in LLVM IR ``ll``."""
    return re.findall(r"define [^\n]*@__tvm_parallel_lambda[^\n]*\{\n(.*?)\n\}", ll, re.S)


def test_parallel_bf16_gemm_keeps_its_register_tile_off_the_heap(rng):
    """Inside the parallel loop the 8x32 fp32 tile is an alloca, not TVMBackendAllocWorkspace.

    With the workspace call LLVM stored all 16 accumulators after every ``vdpbf16ps`` (2.6x
    slower on one thread, BENCHMARKS.md); an alloca is promoted to zmm registers.
    """
    mod, _ = _gemm(128, 256, 128, rng)
    exe = tvmamp.build(mod, level="O2", dtype="bfloat16", target=ZNVER4.format(cores=2))
    ll = exe.get_source("ll")
    lambdas = [body for body in _parallel_lambdas(ll) if "dpbf16ps" in body]
    assert lambdas, "the bf16 GEMM has no parallel loop at num-cores=2"
    for body in lambdas:
        assert "TVMBackendAllocWorkspace" not in body


@pytest.mark.parametrize("cores", [1, 2])
def test_parallel_and_serial_bf16_gemm_agree_with_numpy(cores, rng):
    """Odd sizes (a partial row tile, K not a multiple of 32) on one and two cores."""
    if "avx512_bf16" not in (cpuinfo_flags() or set()):
        pytest.skip("the host cannot run avx512_bf16 code")
    mod, weight = _gemm(37, 100, 72, rng)
    exe = tvmamp.build(mod, level="O2", dtype="bfloat16", target=ZNVER4.format(cores=cores))
    x = rng.standard_normal((37, 100)).astype("float32")
    out = exe(x)
    assert_close(out, np.maximum(x @ weight, 0), **tolerance("bfloat16"))


def test_llvm_entry_names_the_pipeline():
    entry = tvmamp.targets.registry.REGISTRY["llvm"]
    target = tvm.target.Target({"kind": "llvm"})
    assert entry.tir_pipeline(target) == llvm_lowering.PIPELINE
    assert entry.meta_schedule_build == "tvmamp.meta_schedule.llvm_build"
    assert tvm.get_global_func(entry.meta_schedule_build) is not None
