"""fp16 matmul on F16C CPUs: numerics, compile-time weight packing, vcvtph2ps, gating, export."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax

import tvmamp
from tvmamp import models
from tvmamp.pipeline import legalize_passes
from tvmamp.schedules.cpu import common, cpu_schedule_passes, default_cpu_rules
from tvmamp.schedules.cpu.fp16_matmul import CPUMatmulFP16, make_plan
from tvmamp.targets.llvm import _host_flags

# AVX-512 (16 fp32 lanes, no avx512_fp16, so fp16 is only converted) and AVX2 (8 lanes).
AVX512 = tvm.target.Target({"kind": "llvm", "mcpu": "znver4", "mattr": ["-sse4a"], "num-cores": 1})
AVX2 = tvm.target.Target({"kind": "llvm", "mcpu": "haswell", "num-cores": 2})
NO_F16C = tvm.target.Target({"kind": "llvm", "mcpu": "x86-64", "num-cores": 1})
TARGETS = [pytest.param(AVX512, "avx512f", id="avx512"), pytest.param(AVX2, "avx2", id="avx2")]
LEGALIZE = legalize_passes()


def _needs_host(flag: str) -> None:
    if flag not in _host_flags() or "f16c" not in _host_flags():
        pytest.skip(f"the host CPU lacks {flag} or f16c")


def _gemm(m: int, k: int, n: int, weight=None, bias=None, transposed: bool = False):
    """``x[m, k] @ w`` (fp16 in, fp32 accumulate); ``w`` is ``[k, n]`` or, transposed, ``[n, k]``.

    With ``weight`` the weight is a constant; with ``bias`` the epilogue is ``relu(fp16(mm) +
    bias)``, as the AMP pass emits it for a Linear + ReLU.
    """
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((m, k), "float16"))
    w = relax.Var("w", relax.TensorType((n, k) if transposed else (k, n), "float16"))
    with bb.function("main", [x, w]):
        with bb.dataflow():
            rhs = bb.emit(relax.op.permute_dims(w)) if transposed else w
            out = bb.emit(relax.op.matmul(x, rhs, out_dtype="float32"))
            if bias is not None:
                out = bb.emit(relax.op.astype(out, "float16"))
                out = bb.emit(relax.op.add(out, relax.const(bias, "float16")))
                out = bb.emit(relax.op.nn.relu(out))
            out = bb.emit_output(out)
        bb.emit_func_output(out)
    mod = bb.get()
    if weight is not None:
        mod["main"] = mod["main"].bind_params({"w": relax.const(weight, "float16")})
    return mod


def _compile(mod: tvm.IRModule, target: tvm.target.Target):
    """The scheduled Relax module and a VM for it."""
    with target:
        mod = tvm.transform.Sequential([*LEGALIZE, *cpu_schedule_passes(target)])(mod)
    return mod, relax.VirtualMachine(tvm.compile(mod, target=target), tvm.cpu())


def _fp16(rng, shape) -> np.ndarray:
    return rng.uniform(-1.0, 1.0, shape).astype("float16")


def _rel_err(out, ref) -> float:
    out = np.asarray(out, dtype="float64")
    return float(np.abs(out - ref).max() / np.abs(ref).max())


def _calls(func: relax.Function) -> list[relax.Call]:
    calls = []

    def visit(expr):
        if isinstance(expr, relax.Call) and getattr(expr.op, "name", "") == "relax.call_tir":
            calls.append(expr)

    relax.analysis.post_order_visit(func.body, visit)
    return calls


@pytest.mark.parametrize(("target", "flag"), TARGETS)
@pytest.mark.parametrize(("m", "k", "n"), [(1, 1000, 37), (3, 999, 64), (20, 72, 48)])
def test_constant_weight_numerics_and_compile_time_packing(rng, target, flag, m, k, n):
    _needs_host(flag)
    a, b = _fp16(rng, (m, k)), _fp16(rng, (k, n))
    mod, vm = _compile(_gemm(m, k, n, weight=b), target)
    (call,) = _calls(mod["main"])  # one kernel: no packing function left to run
    packed = [arg for arg in call.args[1].fields if isinstance(arg, tvm.ir.expr.Constant)]
    assert len(packed) == 1
    weight = packed[0].value.numpy()
    assert weight.dtype == np.float16 and weight.ndim == 4  # [1, J / tile, K, tile] panels
    assert weight.shape[2] == k and weight.shape[1] * weight.shape[3] >= n
    assert weight.shape[3] % (16 if target is AVX512 else 8) == 0
    out = vm["main"](tvm.runtime.tensor(a)).numpy()
    assert _rel_err(out, a.astype("float64") @ b.astype("float64")) <= 1e-2


@pytest.mark.parametrize(("target", "flag"), TARGETS)
def test_a_widened_a_larger_than_the_cache_is_walked_in_blocks_of_row_tiles(
    rng, monkeypatch, target, flag
):
    """A 4.5 KiB limit: blocks of two row tiles of 72 fp32 values, each walking every panel
    (8-row tiles with AVX-512: 10 tiles in 5 blocks; 6-row tiles with AVX2: 14 in 7)."""
    _needs_host(flag)
    monkeypatch.setattr(common, "A_BLOCK_BYTES", 8 * 72 * 4 * 2)
    a, b = _fp16(rng, (80, 72)), _fp16(rng, (72, 48))
    mod, vm = _compile(_gemm(80, 72, 48, weight=b), target)
    kernel = next(f for _, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc))
    blocks = 5 if target is AVX512 else 7
    nest = kernel.script().split("x_reindex_pad[v0, v1, v2] = ")[-1]
    assert f"in range(T.int64({blocks}))" in nest or f"T.grid(T.int64({blocks})," in nest, nest
    out = vm["main"](tvm.runtime.tensor(a)).numpy()
    assert _rel_err(out, a.astype("float64") @ b.astype("float64")) <= 1e-2


def test_fused_bias_relu_epilogue(rng):
    _needs_host("avx512f")
    m, k, n = 2, 256, 96
    a, b, bias = _fp16(rng, (m, k)), _fp16(rng, (k, n)), _fp16(rng, (n,))
    mod, vm = _compile(_gemm(m, k, n, weight=b, bias=bias), AVX512)
    (call,) = _calls(mod["main"])  # matmul, cast, bias and relu are one kernel
    kernel = mod[call.args[0]]
    assert kernel.attrs["tirx.is_scheduled"]
    assert "T.Broadcast" in kernel.script()  # the tensorized F16C update
    out = vm["main"](tvm.runtime.tensor(a)).numpy()
    ref = np.maximum(a.astype("float64") @ b.astype("float64") + bias.astype("float64"), 0.0)
    assert out.dtype == np.float16
    assert _rel_err(out, ref) <= 1e-2


@pytest.mark.parametrize("transposed", [False, True])
def test_run_time_weight_is_packed_by_a_separate_function(rng, transposed):
    _needs_host("avx512f")
    m, k, n = 3, 130, 50
    a = _fp16(rng, (m, k))
    b = _fp16(rng, (n, k) if transposed else (k, n))
    mod, vm = _compile(_gemm(m, k, n, transposed=transposed), AVX512)
    names = [call.args[0].name_hint for call in _calls(mod["main"])]
    # The packing of a run-time weight cannot be folded: it runs before the kernel.
    assert [n for n in names if n.endswith("_prepack")] == ["matmul_weight_prepack"], names
    assert [n for n in names if n.endswith("_prepacked")] == ["matmul_prepacked"], names
    out = vm["main"](tvm.runtime.tensor(a), tvm.runtime.tensor(b)).numpy()
    ref = a.astype("float64") @ (b.T if transposed else b).astype("float64")
    assert _rel_err(out, ref) <= 1e-2


@pytest.fixture(scope="module")
def simple_net_fp16():
    """A small SimpleNet built O2 fp16 for the AVX-512 target, with its inputs and fp32 output."""
    mod, params = models.simple_net(batch=1, hidden=256, layers=3)
    x = np.random.default_rng(7).standard_normal((1, 256)).astype("float32")
    exe = tvmamp.build(
        mod, "O2", "llvm -mcpu=znver4 -mattr=-sse4a -num-cores=1", "float16", params=params
    )
    ref = tvmamp.build(mod, "O0", "llvm -mcpu=znver4 -mattr=-sse4a -num-cores=1", params=params)(x)
    return exe, x, np.asarray(ref)


def test_build_emits_vcvtph2ps_and_matches_fp32(simple_net_fp16):
    _needs_host("avx512f")
    exe, x, ref = simple_net_fp16
    assert "vcvtph2ps" in exe.get_source("asm")
    assert _rel_err(exe(x), ref) <= 1e-2


def test_export_and_reload(simple_net_fp16, tmp_path):
    _needs_host("avx512f")
    exe, x, ref = simple_net_fp16
    path = tmp_path / "simple_net_fp16.so"
    exe.export_library(str(path))
    vm = relax.VirtualMachine(tvm.runtime.load_module(str(path)), tvm.cpu())
    out = vm["main"](tvm.runtime.tensor(x)).numpy()
    np.testing.assert_allclose(out, np.asarray(exe(x)), rtol=0, atol=0)
    assert _rel_err(out, ref) <= 1e-2


def test_rule_is_gated_on_f16c():
    assert any(isinstance(r.rule, CPUMatmulFP16) for r in default_cpu_rules(AVX2))
    assert not any(isinstance(r.rule, CPUMatmulFP16) for r in default_cpu_rules(NO_F16C))
    arm = tvm.target.Target({"kind": "llvm", "mtriple": "aarch64-linux-gnu"})
    assert not CPUMatmulFP16().is_target_available(arm)


def _prim_func(mod: tvm.IRModule) -> tvm.tirx.PrimFunc:
    with AVX512:
        mod = tvm.transform.Sequential(LEGALIZE)(mod)
    return next(f for _, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc))


def _batched_gemm(dtype_out: str, batch: int) -> tvm.IRModule:
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((batch, 4, 32), "float16"))
    w = relax.Var("w", relax.TensorType((batch, 32, 16), "float16"))
    with bb.function("main", [x, w]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.matmul(x, w, out_dtype=dtype_out))
        bb.emit_func_output(out)
    return bb.get()


@pytest.mark.parametrize(
    ("dtype_out", "batch", "applies"),
    [("float32", 1, True), ("float32", 2, False), ("float16", 1, False)],
    ids=["fp16-fp32", "batched-weight", "fp16-accumulate"],
)
def test_rule_takes_only_fp32_accumulating_2d_weights(dtype_out, batch, applies):
    func = _prim_func(_batched_gemm(dtype_out, batch))
    assert (CPUMatmulFP16().apply(func, AVX512, False) is not None) == applies


def test_tile_plan():
    config = CPUMatmulFP16.Config()
    gemv = make_plan([1, 1, 1024, 1024], 16, config)
    assert (gemv.tile_i, gemv.tile_j, gemv.padding) == (1, 128, [1, 1, 128, 1])
    assert make_plan([1, 3, 1024, 1024], 16, config).tile_j == 64  # 3 rows x 4 vectors
    assert make_plan([1, 1, 37, 1000], 16, config).tile_j == 64  # halved while J fits
    tiled = make_plan([1, 20, 64, 64], 8, config)
    assert (tiled.tile_i, tiled.tile_j, tiled.needs_padding) == (8, 16, True)
    assert CPUMatmulFP16().get_config(AVX2).tile_i == 6  # 16 ymm registers: 6 x 2 tile
    assert CPUMatmulFP16().get_config(AVX512) == config
