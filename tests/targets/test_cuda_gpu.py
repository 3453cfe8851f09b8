"""On a CUDA GPU: the tensor-core kernels match fp32 and keep up with torch/cuBLAS.

Every test here is marked ``gpu`` and skipped on machines without a CUDA device (the
development and CI machines have none); run them with ``pytest -m gpu`` where one exists.
"""

import numpy as np
import pytest
import tvm
from tolerances import assert_close, tolerance
from tvm import relax

import tvmamp
from tvmamp import models
from tvmamp.relay_passes.auto_mixed_precision import np_dtype
from tvmamp.targets import cuda as cuda_target
from tvmamp.targets import resolve_target

pytestmark = pytest.mark.gpu
# Elementwise tolerances of the model outputs (order 1): bf16 as on the CPU; fp16 twice the
# CPU's (tests/tolerances.py), for CUDA's fast transcendental intrinsics. All passed on an
# H200 (2026-11-26); the development and CI machines have no GPU.
MODEL_TOL = {"float16": dict(rtol=1e-2, atol=1e-2), "bfloat16": tolerance("bfloat16")}


def local_cc() -> int:
    return cuda_target.compute_capability(resolve_target("cuda")[0])


def skip_unsupported(dtype):
    if local_cc() < 70 or (dtype == "bfloat16" and local_cc() < 80):
        pytest.skip(f"this GPU (sm_{local_cc()}) has no {dtype} tensor cores")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("name", ["simplenet", "convnet", "transformer"])
def test_models_match_fp32(name, dtype):
    skip_unsupported(dtype)
    mod, params = models.get_model(name)
    inputs = models.example_inputs(mod)
    ref = tvmamp.build(mod, "O0", "cuda", params=params)(*inputs)
    out = tvmamp.build(mod, "O2", "cuda", dtype, params=params)(*inputs)
    assert_close(out, ref, **MODEL_TOL[dtype], what=f"{name} {dtype}")


def gemm_module(m, n, k, dtype, batch=None):
    lead = () if batch is None else (batch,)
    bb = relax.BlockBuilder()
    a = relax.Var("a", relax.TensorType((*lead, m, k), dtype))
    b = relax.Var("b", relax.TensorType((*lead, k, n), dtype))
    with bb.function("main", [a, b]):
        with bb.dataflow():
            y = bb.emit(relax.op.matmul(a, b, out_dtype="float32"))
            out = bb.emit_output(relax.op.astype(y, dtype))
        bb.emit_func_output(out)
    return bb.get()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("shape", [(100, 70, 30, None), (16, 16, 16, 8), (512, 384, 256, None)])
def test_gemm_shapes_match_float64(shape, dtype, rng):
    skip_unsupported(dtype)
    m, n, k, batch = shape
    exe = tvmamp.build(gemm_module(m, n, k, dtype, batch), "O0", "cuda")
    lead = () if batch is None else (batch,)
    a = rng.standard_normal((*lead, m, k)).astype("float32")
    b = rng.standard_normal((*lead, k, n)).astype("float32")
    low = np_dtype(dtype)
    a, b = a.astype(low), b.astype(low)
    want = np.matmul(a.astype("float64"), b.astype("float64"))
    # sums of k unit terms are ~sqrt(k): atol scales with it (one low rounding of the result)
    assert_close(exe(a, b), want, **tolerance(dtype, scale=np.sqrt(k)), what=f"gemm {shape}")


def test_large_matmul_is_within_5x_of_torch():
    """A sanity bound (a kernel off the tensor cores is ~10x slower); BENCHMARKS has ratios."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here")
    skip_unsupported("float16")
    size = 4096
    exe = tvmamp.build(gemm_module(size, size, size, "float16"), "O0", "cuda")
    a = torch.randn(size, size, device="cuda", dtype=torch.float16)
    b = torch.randn(size, size, device="cuda", dtype=torch.float16)
    args = [tvm.runtime.tensor(t.cpu().numpy(), exe.device) for t in (a, b)]
    timer = exe.vm.time_evaluator("main", exe.device, number=10, repeat=5)
    tvm_ms = float(np.median(timer(*args).results)) * 1e3
    torch_ms = torch_time_ms(torch, lambda: torch.matmul(a, b))
    assert tvm_ms <= 5 * torch_ms, (tvm_ms, torch_ms)


def torch_time_ms(torch, fn, number=10, repeat=5):
    fn()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(number):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / number)
    return float(np.median(times))


def test_exported_library_loads_and_runs(tmp_path):
    skip_unsupported("float16")
    mod, params = models.simple_net(batch=64, hidden=256, layers=3)
    inputs = models.example_inputs(mod)
    exe = tvmamp.build(mod, "O2", "cuda", "float16", params=params)
    lib = tvm.runtime.load_module(exe.export_library(str(tmp_path / "model.so")))
    vm = relax.VirtualMachine(lib, tvm.cuda(0))
    out = vm["main"](tvm.runtime.tensor(inputs[0], tvm.cuda(0))).numpy()
    np.testing.assert_array_equal(out, exe(*inputs))


def test_cp_async_kernels_match_fp32():
    skip_unsupported("float16")
    mod, params = models.conv_net()
    inputs = models.example_inputs(mod)
    ref = tvmamp.build(mod, "O0", "cuda", params=params)(*inputs)
    with tvm.transform.PassContext(opt_level=3, config={"tirx.use_async_copy": True}):
        out = tvmamp.build(mod, "O2", "cuda", "float16", params=params)(*inputs)
    assert_close(out, ref, **MODEL_TOL["float16"], what="conv_net with cp.async")
