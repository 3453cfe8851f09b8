"""fp32 GEMV and small-batch GEMM: numerics, compile-time panel packing, forced CPU kinds."""

from __future__ import annotations

import re

import numpy as np
import pytest
import tvm
from tvm import relax, te

import tvmamp
from tvmamp.pipeline import _pass_context, legalize_passes, run_front_phases
from tvmamp.schedules.cpu import CPUMatmul, cpu_schedule_passes
from tvmamp.schedules.cpu.gemv import GemvConfig, gemv_config, make_gemv_plan
from tvmamp.targets.llvm import _host_flags

LEGALIZE = legalize_passes()
# Forced kinds: AVX-512 (16 fp32 lanes, 2 cores: parallel), AVX2 (8 lanes), AVX-512 on Intel.
ZNVER4 = tvm.target.Target({"kind": "llvm", "mcpu": "znver4", "mattr": ["-sse4a"], "num-cores": 2})
AVX2 = tvm.target.Target({"kind": "llvm", "mcpu": "x86-64-v3", "num-cores": 1})
SKYLAKE = tvm.target.Target({"kind": "llvm", "mcpu": "skylake-avx512", "num-cores": 2})
TARGETS = [
    pytest.param(ZNVER4, "avx512f", 16, id="znver4"),
    pytest.param(AVX2, "avx2", 8, id="x86-64-v3"),
    pytest.param(SKYLAKE, "avx512f", 16, id="skylake-avx512"),
]


def _needs_host(flag: str) -> None:
    if flag not in _host_flags() or "fma" not in _host_flags():
        pytest.skip(f"the host CPU lacks {flag} or fma")


def _linear(m: int, k: int, n: int, layout: str, weight=None, bias=None) -> tvm.IRModule:
    """``relu(x @ W + b)`` with the weight as ``permute_dims(W[n, k])`` ("nk", a torch Linear)
    or ``W[k, n]`` ("kn"); a constant when ``weight`` is given, else the input ``w``."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((m, k), "float32"))
    w = relax.Var("w", relax.TensorType((n, k) if layout == "nk" else (k, n), "float32"))
    with bb.function("main", [x, w]):
        with bb.dataflow():
            rhs = bb.emit(relax.op.permute_dims(w)) if layout == "nk" else w
            out = bb.emit(relax.op.matmul(x, rhs))
            if bias is not None:
                out = bb.emit(relax.op.nn.relu(relax.op.add(out, relax.const(bias))))
            out = bb.emit_output(out)
        bb.emit_func_output(out)
    mod = bb.get()
    if weight is not None:
        mod["main"] = mod["main"].bind_params({"w": relax.const(weight)})
    return mod


def _compile(mod: tvm.IRModule, target: tvm.target.Target):
    """The scheduled Relax module and its executable."""
    with target:
        mod = tvm.transform.Sequential([*LEGALIZE, *cpu_schedule_passes(target)])(mod)
    return mod, tvm.compile(mod, target=target)


def _calls(func: relax.Function) -> list[relax.Call]:
    calls = []

    def visit(expr):
        if isinstance(expr, relax.Call) and getattr(expr.op, "name", "") == "relax.call_tir":
            calls.append(expr)

    relax.analysis.post_order_visit(func.body, visit)
    return calls


def _randn(rng, shape) -> np.ndarray:
    return (rng.standard_normal(shape) + 0.1).astype("float32")


def _reference(x, w, bias, layout) -> np.ndarray:
    ref = x.astype("float64") @ (w.T if layout == "nk" else w).astype("float64")
    return np.maximum(ref + bias, 0.0)


def _packed_weight(mod: tvm.IRModule) -> np.ndarray:
    """The constant weight of the single kernel of ``mod`` (no packing left to run)."""
    (call,) = _calls(mod["main"])
    consts = [a for a in call.args[1].fields if isinstance(a, tvm.ir.expr.Constant)]
    return max((c.value.numpy() for c in consts), key=lambda a: a.ndim)


@pytest.mark.parametrize(("target", "flag", "lanes"), TARGETS)
@pytest.mark.parametrize("layout", ["nk", "kn"])
@pytest.mark.parametrize(("m", "k", "n"), [(1, 333, 77), (2, 45, 29), (3, 129, 250), (5, 70, 19)])
def test_constant_weight_numerics_and_packing(rng, target, flag, lanes, layout, m, k, n):
    x, bias = _randn(rng, (m, k)), _randn(rng, (n,))
    w = _randn(rng, (n, k) if layout == "nk" else (k, n))
    mod, exe = _compile(_linear(m, k, n, layout, weight=w, bias=bias), target)
    packed = _packed_weight(mod)  # matmul, bias and relu in one kernel, weight folded
    # [1, N / tile, K, tile] panels, folded at compile time: a contiguous stream per panel.
    assert packed.ndim == 4 and packed.shape[0] == 1 and packed.shape[2] == k
    assert packed.shape[3] % lanes == 0 and packed.shape[1] * packed.shape[3] >= n
    panels = packed.transpose(0, 2, 1, 3).reshape(k, -1)[:, :n]
    np.testing.assert_array_equal(panels, w.T if layout == "nk" else w)
    _needs_host(flag)
    vm = relax.VirtualMachine(exe, tvm.cpu())
    out = vm["main"](tvm.runtime.tensor(x)).numpy()
    np.testing.assert_allclose(out, _reference(x, w, bias, layout), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("layout", ["nk", "kn"])
def test_run_time_weight_is_packed_by_a_separate_function(rng, layout):
    _needs_host("avx512f")
    m, k, n = 4, 99, 41
    x, bias = _randn(rng, (m, k)), _randn(rng, (n,))
    w = _randn(rng, (n, k) if layout == "nk" else (k, n))
    mod, exe = _compile(_linear(m, k, n, layout, bias=bias), ZNVER4)
    names = [call.args[0].name_hint for call in _calls(mod["main"])]
    assert len([n for n in names if n.endswith("_prepack")]) == 1, names
    assert len([n for n in names if n.endswith("_prepacked")]) == 1, names
    vm = relax.VirtualMachine(exe, tvm.cpu())
    out = vm["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(w)).numpy()
    np.testing.assert_allclose(out, _reference(x, w, bias, layout), rtol=1e-5, atol=1e-4)


def test_dense_kernel_reading_nk_weight_in_place(rng):
    """A kernel that reads ``W[n, k]`` itself (no transpose op): its packing copies K blocks."""
    _needs_host("avx512f")
    m, k, n = 2, 100, 37

    def dense(x, w):
        r = te.reduce_axis((0, k), "r")
        return te.compute((m, n), lambda i, j: te.sum(x[i, r] * w[j, r], axis=r), name="dense")

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((m, k), "float32"))
    w = relax.Var("w", relax.TensorType((n, k), "float32"))
    with bb.function("main", [x, w]):
        with bb.dataflow():
            out = bb.emit_output(bb.call_te(dense, x, w))
        bb.emit_func_output(out)
    mod, exe = _compile(bb.get(), ZNVER4)
    (pack,) = [c.args[0] for c in _calls(mod["main"]) if c.args[0].name_hint.endswith("prepack")]
    assert "T.unroll(T.int64(10))" in mod[pack].script()  # K blocks: largest_divisor(100, 16)
    a, b = _randn(rng, (m, k)), _randn(rng, (n, k))
    out = relax.VirtualMachine(exe, tvm.cpu())["main"](*map(tvm.runtime.tensor, (a, b)))
    np.testing.assert_allclose(out.numpy(), a.astype("float64") @ b.T, rtol=1e-5, atol=1e-4)


def _kernel_script(mod: tvm.IRModule) -> str:
    (call,) = _calls(mod["main"])
    return mod[call.args[0]].script()


def test_large_gemv_runs_in_parallel_over_column_panels(rng):
    k, n = 512, 1000
    w, bias = _randn(rng, (n, k)), _randn(rng, (n,))
    mod, _ = _compile(_linear(1, k, n, "nk", weight=w, bias=bias), ZNVER4)
    script = _kernel_script(mod)
    assert "T.parallel" in script and "T.vectorized" in script
    single = tvm.target.Target(
        {"kind": "llvm", "mcpu": "znver4", "mattr": ["-sse4a"], "num-cores": 1}
    )
    mod, _ = _compile(_linear(1, k, n, "nk", weight=w, bias=bias), single)
    assert "T.parallel" not in _kernel_script(mod)


@pytest.mark.parametrize(
    ("a_shape", "w_shape"),
    [((12, 40), (40, 24)), ((2, 3, 40), (2, 40, 24))],
    ids=["rows-above-max", "batched-weight"],
)
def test_other_shapes_keep_the_generic_matmul(rng, a_shape, w_shape):
    _needs_host("avx512f")
    a, w = _randn(rng, a_shape), _randn(rng, w_shape)
    bb = relax.BlockBuilder()
    with bb.function("main", []):
        with bb.dataflow():
            out = bb.emit_output(relax.op.matmul(relax.const(a), relax.const(w)))
        bb.emit_func_output(out)
    mod, exe = _compile(bb.get(), ZNVER4)
    assert not any(c.args[0].name_hint.endswith("prepacked") for c in _calls(mod["main"]))
    out = relax.VirtualMachine(exe, tvm.cpu())["main"]().numpy()
    np.testing.assert_allclose(out, np.matmul(a.astype("float64"), w), rtol=1e-5, atol=1e-4)


def test_gemv_can_be_turned_off(rng):
    w = _randn(rng, (100, 64))
    mod = _linear(1, 100, 64, "kn", weight=w)
    with ZNVER4:
        func = next(
            f
            for _, f in tvm.transform.Sequential(LEGALIZE)(mod).functions_items()
            if isinstance(f, tvm.tirx.PrimFunc)
        )
    on = CPUMatmul().apply(func, ZNVER4, False).mod["main"].script()
    off = CPUMatmul(gemv=False).apply(func, ZNVER4, False).mod["main"].script()
    assert "meta_schedule.layout_rewrite_preproc" in on
    assert "meta_schedule.layout_rewrite_preproc" not in off


def test_tile_plan():
    config = GemvConfig()
    assert make_gemv_plan([1, 1, 4096, 9216], 16, config).tile_j == 128  # 8 accumulators
    assert make_gemv_plan([1, 3, 4096, 9216], 16, config).tile_j == 128  # 24 accumulators
    assert make_gemv_plan([1, 4, 4096, 9216], 16, config).tile_j == 64  # 4 x 4 (power of 2)
    assert make_gemv_plan([1, 8, 4096, 9216], 16, config).tile_j == 32
    assert make_gemv_plan([1, 1, 1000, 4096], 16, config).tile_j == 128  # 1024: 1.6 % padding
    assert make_gemv_plan([1, 1, 70, 100], 16, config).tile_j == 16  # 80, not 128 columns
    plan = make_gemv_plan([1, 1, 77, 333], 16, config)
    assert (plan.unroll_k, plan.padding) == (3, [1, 1, 16, 1])
    assert gemv_config(AVX2).accumulators == 12  # 16 ymm registers
    assert make_gemv_plan([1, 2, 4096, 4096], 8, gemv_config(AVX2)).tile_j == 32


@pytest.mark.parametrize(
    ("cols", "cores", "tile_j"),
    [(1000, 1, 128), (1000, 2, 128), (1000, 16, 64), (4096, 16, 128), (256, 16, 16), (64, 16, 16)],
)
def test_tile_plan_gives_the_cores_a_panel_each(cols, cores, tile_j):
    """A 1000-class head had 8 panels of 128 columns, the parallel tasks, for 16 cores."""
    assert make_gemv_plan([1, 1, cols, 2048], 16, GemvConfig(), cores).tile_j == tile_j


@pytest.mark.parametrize("kind", ["x86-64-v3", "skylake-avx512"])
def test_forced_kind_asm_streams_panels_with_fma(rng, kind):
    k, n = 256, 96
    w, bias = _randn(rng, (n, k)), _randn(rng, (n,))
    mod, params = _linear(1, k, n, "nk", bias=bias), {"w": w}
    exe = tvmamp.build(mod, "O0", f"llvm -mcpu={kind} -num-cores=1", params=params)
    reg = "zmm" if kind == "skylake-avx512" else "ymm"
    asm = exe.get_source("asm")
    assert re.search(rf"vfmadd231ps\s+[^\n]*%{reg}", asm)  # vector FMA of the kind's width
    assert kind == "skylake-avx512" or "%zmm" not in asm
    _needs_host("avx512f" if reg == "zmm" else "avx2")
    x = _randn(rng, (1, k))
    np.testing.assert_allclose(exe(x), _reference(x, w, bias, "nk"), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("m", [1, 3])
def test_low_precision_linear_at_small_batch(rng, dtype, m):
    """The O2 Linear at batch 1-3 (bf16: vdpbf16ps or widened; fp16: F16C) against float64."""
    k, n = 203, 45
    w, bias = _randn(rng, (n, k)), _randn(rng, (n,))
    exe = tvmamp.build(_linear(m, k, n, "nk", bias=bias), "O2", dtype=dtype, params={"w": w})
    x = _randn(rng, (m, k))
    ref = _reference(x, w, bias, "nk")
    err = np.abs(np.asarray(exe(x), dtype="float64") - ref).max() / np.abs(ref).max()
    assert err <= 1e-2


def test_gemv_epilogue_over_a_feature_map_is_vectorised_and_parallel(rng):
    """A squeeze-and-excitation gate at O0: TVM's GEMV rule scheduled the 1x1 conv on the
    pooled vector and left ``x * sigmoid(gate)`` over the whole 160 x 40 x 40 map a serial,
    scalar loop nest (0.17 ms; now 0.055 ms on one Zen5 core)."""
    torch = pytest.importorskip("torch")

    class SqueezeExcite(torch.nn.Module):
        def __init__(self, c=160):
            super().__init__()
            self.a, self.b = torch.nn.Conv2d(c, c // 4, 1), torch.nn.Conv2d(c // 4, c, 1)

        def forward(self, x):
            pooled = x.mean((2, 3), keepdim=True)
            return x * torch.sigmoid(self.b(torch.relu(self.a(pooled))))

    torch.manual_seed(0)
    model = SqueezeExcite().eval()
    x = rng.standard_normal((1, 160, 40, 40)).astype("float32")
    mod, params = tvmamp.from_torch(model, (torch.from_numpy(x),))
    converted = tvmamp.convert(mod, "O0", "llvm -num-cores=4", params=params)
    with _pass_context(converted), converted.target:
        front = run_front_phases(converted)
        scheduled = tvm.transform.Sequential(converted.entry.schedule_passes(converted.target))(
            front
        )
    (gate,) = [f.script() for gv, f in scheduled.functions_items() if "multiply" in gv.name_hint]
    lines = gate.splitlines()
    at = next(i for i, line in enumerate(lines) if 'T.sblock("T_multiply' in line)
    loops = "\n".join(lines[max(0, at - 4) : at])  # the loops around the multiply
    assert "T.parallel" in loops and "T.vectorized" in loops, loops
    out = tvmamp.build(mod, "O0", "llvm", params=params)(x)
    with torch.no_grad():
        ref = model(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)
