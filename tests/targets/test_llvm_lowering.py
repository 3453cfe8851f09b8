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
from tvmamp.pipeline import legalize_passes
from tvmamp.schedules.cpu import cpu_schedule_passes
from tvmamp.targets import llvm_lowering, resolve_target
from tvmamp.targets.cpu_features import cpuinfo_flags
from tvmamp.targets.llvm_lowering import DISABLE_LOWER_BUILTIN, stack_local_tiles

# A bf16 GEMM kernel forced to the avx512_bf16 path; two cores make its outer loop parallel.
ZNVER4 = "llvm -mcpu=znver4 -mattr=-sse4a -num-cores={cores}"


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


# Math intrinsics TVM could not lower for LLVM: sinh and cosh in every dtype (in a vectorised
# loop), the inverse trigonometric and hyperbolic functions in float16. Each op's input range.
MATH_OPS = {
    "sinh": (relax.op.sinh, np.sinh, (-4.0, 4.0)),
    "cosh": (relax.op.cosh, np.cosh, (-4.0, 4.0)),
    "asin": (relax.op.asin, np.arcsin, (-0.95, 0.95)),
    "acos": (relax.op.acos, np.arccos, (-0.95, 0.95)),
    "atan": (relax.op.atan, np.arctan, (-4.0, 4.0)),
    "asinh": (relax.op.asinh, np.arcsinh, (-4.0, 4.0)),
    "acosh": (relax.op.acosh, np.arccosh, (1.05, 4.0)),
    "atan2": (relax.op.atan2, np.arctan2, (-4.0, 4.0)),
}


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("name", sorted(MATH_OPS))
def test_math_intrinsics_build_and_match_float64(rng, name, dtype):
    import ml_dtypes

    op, ref_fn, (low, high) = MATH_OPS[name]
    arity = 2 if name == "atan2" else 1
    bb = relax.BlockBuilder()
    params = [relax.Var(f"x{i}", relax.TensorType((5, 67), dtype)) for i in range(arity)]
    with bb.function("main", params):
        with bb.dataflow():
            out = bb.emit_output(op(*params))
        bb.emit_func_output(out)
    target = resolve_target("llvm")[0]
    with target:
        mod = tvm.transform.Sequential([*legalize_passes(), *cpu_schedule_passes(target)])(bb.get())
    exe = tvm.compile(mod, target=target, tir_pipeline=llvm_lowering.tir_pipeline(target))
    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype
    xs = [rng.uniform(low, high, (5, 67)).astype(np_dtype) for _ in range(arity)]
    if name == "sinh":  # the series branch near 0, where exp(x) - exp(-x) would cancel
        xs[0][0, :] = rng.uniform(-0.3, 0.3, 67).astype(np_dtype)
    vm = relax.VirtualMachine(exe, tvm.cpu())
    got = vm["main"](*[tvm.runtime.tensor(x) for x in xs]).numpy()
    want = ref_fn(*[x.astype("float64") for x in xs])
    scale = float(np.abs(want).max())
    assert_close(
        got,
        want,
        **tolerance(dtype, scale=scale if dtype != "float32" else 1.0),
        what=f"{name} {dtype}",
    )


def test_power_stays_float32_at_o3_in_bfloat16(rng):
    """tirx's pow rejects bfloat16 ("power only applies to float"): torch.pow at O3 failed."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((8, 32), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(relax.op.abs(x) + relax.const(0.1, "float32"))
            out = bb.emit_output(relax.op.power(y, relax.const(1.7, "float32")))
        bb.emit_func_output(out)
    exe = tvmamp.build(bb.get(), "O3", "llvm", "bfloat16")
    data = rng.standard_normal((8, 32)).astype("float32")
    want = (np.abs(data.astype("float64")) + 0.1) ** 1.7
    assert_close(exe(data), want, **tolerance("bfloat16", scale=float(want.max())))


def _repeated_chain(steps: int) -> tvm.IRModule:
    """``b[i] = s_steps`` with ``s_0 = a[i]``, ``s_k = s_{k-1} * s_{k-1} + s_{k-1}``: an
    expression whose tree (each use of a subexpression counted) has about 3^steps nodes."""
    from tvm import te

    a = te.placeholder((64,), "float32", "a")

    def chain(i):
        value = a[i]
        for _ in range(steps):
            value = value * value + value
        return value

    b = te.compute((64,), chain, "b")
    func = te.create_prim_func([a, b]).with_attr("global_symbol", "main")
    return tvm.IRModule({"main": func.with_attr("target", tvm.target.Target("llvm"))})


def test_kernels_of_very_large_expressions_are_lowered_without_tvms_cse():
    """RWKV's recurrence, unrolled and fused, made kernels whose CommonSubexprElim took 25 s
    of a 93 s build. Past CSE_MAX_NODES a kernel is lowered without it (LLVM's own passes
    still share the subexpressions); smaller kernels keep it."""
    seen = []

    @tvm.ir.instrument.pass_instrument
    class RecordCSE:
        def run_before_pass(self, mod, info):
            if info.name == "tirx.CommonSubexprElim":
                seen.extend(gvar.name_hint for gvar in mod.get_global_vars())

    rng = np.random.default_rng(3)
    for steps, large in ((3, False), (9, True)):
        mod = _repeated_chain(steps)
        nodes = llvm_lowering.largest_store(mod["main"], llvm_lowering.CSE_MAX_NODES)
        assert (nodes > llvm_lowering.CSE_MAX_NODES) == large, nodes
        seen.clear()
        with tvm.transform.PassContext(opt_level=3, instruments=[RecordCSE()]):
            lib = tvm.compile(mod, target="llvm", tir_pipeline=llvm_lowering.register())
        assert ("main" in seen) != large, (steps, seen)
        a = rng.uniform(-0.5, 0.5, 64).astype("float32")
        out = tvm.runtime.empty((64,), "float32")
        lib["main"](tvm.runtime.tensor(a), out)
        ref = a.astype("float64")
        for _ in range(steps):
            ref = ref * ref + ref
        np.testing.assert_allclose(out.numpy(), ref, rtol=1e-5, atol=1e-6)
