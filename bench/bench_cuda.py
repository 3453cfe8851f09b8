"""CUDA tensor cores: tvmamp's kernels against torch/cuBLAS on the same GPU (needs a GPU).

Two tables, each from one run with TVM and torch timed alternately:
1. SimpleNet (Paddle's AMP guide: 9 x Linear(1024), batch 256) at O2 in fp16 and bf16 against
   torch autocast on the same GPU, and the error of each against torch fp32.
2. Single matmuls (M = N = K) in fp16 and bf16 with fp32 accumulation against torch.matmul
   (cuBLAS), in TFLOP/s. The goal is >= 0.8x cuBLAS for the large ones.

Without a CUDA GPU (or without a CUDA build of torch) it says so and exits 0. ``--census``
needs no GPU: it compiles the built-in models at O2 for sm_80 and sm_90 and counts, from the
PTX, the matmul/conv kernels on tensor cores.

Run: python bench/bench_cuda.py [--sizes 1024,4096] [--dtypes float16,bfloat16] [--no-async]
     python bench/bench_cuda.py --census
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
import tvm
from tvm import relax

import tvmamp
from tvmamp import models
from tvmamp.benchmark import max_rel_error
from tvmamp.relay_passes.auto_mixed_precision import np_dtype


def gpu_or_reason(torch) -> str | None:
    """None when both TVM and torch see a CUDA GPU, else why not."""
    if not tvm.cuda(0).exist:
        return "TVM sees no CUDA GPU on this machine"
    if torch is None or not torch.cuda.is_available():
        return "torch has no CUDA here (install a CUDA build of torch)"
    return None


def cuda_time_ms(torch, fn, number=20, repeat=7) -> float:
    """Median milliseconds per call of ``fn``, timed with CUDA events after one warm-up."""
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


def tvm_runner(exe, arrays):
    """A no-argument function running ``main`` on device-resident inputs (async, like torch)."""
    args = [tvm.runtime.tensor(a, exe.device) for a in arrays]
    main = exe.vm["main"]
    return lambda: main(*args)


def simplenet_rows(torch, dtypes, build) -> list[str]:
    """Latency of SimpleNet at O2 per dtype against torch autocast, and errors vs fp32."""
    mod, params = models.simple_net()
    x = models.example_inputs(mod)[0]
    net = torch_simplenet(torch, params).cuda().eval()
    tx = torch.from_numpy(x).cuda()
    with torch.no_grad():
        ref = net(tx).cpu().numpy()
        rows = []
        for dtype in dtypes:
            exe = build(mod, "O2", dtype, params)
            low = getattr(torch, dtype)
            tvm_ms, torch_ms = paired(
                torch, tvm_runner(exe, [x]), lambda low=low: autocast(net, tx, low)
            )
            err = max_rel_error(exe(x), ref)
            torch_err = max_rel_error(autocast(net, tx, low).float().cpu().numpy(), ref)
            rows.append(
                f"| SimpleNet O2 {dtype} | {tvm_ms:.3f} | {torch_ms:.3f} | "
                f"{torch_ms / tvm_ms:.2f}x | {err:.1e} | {torch_err:.1e} |"
            )
    return rows


def autocast(net, tx, low):
    """``net(tx)`` under torch autocast to ``low`` on the GPU."""
    import torch

    with torch.autocast("cuda", dtype=low):
        return net(tx)


def torch_simplenet(torch, params, layers=9):
    """The same network in torch with tvmamp's weights."""
    mods = []
    for i in range(layers):
        w = params[f"linear{i}.weight"]
        lin = torch.nn.Linear(w.shape[1], w.shape[0])
        lin.weight.data = torch.from_numpy(w)
        lin.bias.data = torch.from_numpy(params[f"linear{i}.bias"])
        mods += [lin] + ([torch.nn.ReLU()] if i < layers - 1 else [])
    return torch.nn.Sequential(*mods)


def paired(torch, tvm_fn, torch_fn, rounds=5) -> tuple[float, float]:
    """Alternate the two timings ``rounds`` times; the median of each."""
    pairs = [(cuda_time_ms(torch, tvm_fn), cuda_time_ms(torch, torch_fn)) for _ in range(rounds)]
    return tuple(float(np.median(v)) for v in zip(*pairs))


def matmul_module(size, dtype):
    bb = relax.BlockBuilder()
    a = relax.Var("a", relax.TensorType((size, size), dtype))
    b = relax.Var("b", relax.TensorType((size, size), dtype))
    with bb.function("main", [a, b]):
        with bb.dataflow():
            y = bb.emit(relax.op.matmul(a, b, out_dtype="float32"))
            out = bb.emit_output(relax.op.astype(y, dtype))
        bb.emit_func_output(out)
    return bb.get()


def matmul_rows(torch, sizes, dtypes, build) -> list[str]:
    """TFLOP/s of one matmul per size and dtype, tvmamp against torch.matmul (cuBLAS)."""
    rows = []
    for dtype in dtypes:
        for size in sizes:
            exe = build(matmul_module(size, dtype), "O0", dtype, None)
            low = getattr(torch, dtype)
            a, b = (torch.randn(size, size, device="cuda", dtype=low) for _ in range(2))
            arrays = [t.float().cpu().numpy().astype(np_dtype(dtype)) for t in (a, b)]
            tvm_ms, torch_ms = paired(
                torch, tvm_runner(exe, arrays), lambda a=a, b=b: torch.matmul(a, b)
            )
            tflops = 2 * size**3 / 1e9
            rows.append(
                f"| matmul {size}^3 {dtype} | {tflops / tvm_ms:.1f} | {tflops / torch_ms:.1f} | "
                f"{torch_ms / tvm_ms:.2f}x |"
            )
    return rows


def census_rows(dtypes, archs=("sm_80", "sm_90")) -> list[str]:
    """Per model, dtype and arch: GEMM kernels on tensor cores, from nvcc's PTX (no GPU)."""
    from tvmamp.targets.ptx import gemm_kernels_without_tensor_cores, kernel_reports

    rows = []
    for name in ("simplenet", "convnet", "transformer"):
        mod, params = models.get_model(name)
        for dtype in dtypes:
            for arch in archs:
                print(f"[census] {name} {dtype} {arch} ...", file=sys.stderr, flush=True)
                with tvm.transform.PassContext(config={"tirx.use_async_copy": True}):
                    exe = tvmamp.build(mod, "O2", f"cuda -arch={arch}", dtype, params=params)
                ptx = exe.get_source("ptx")
                reports = kernel_reports(ptx)
                gemms = [r for r in reports if r.is_gemm]
                on_tc = len(gemms) - len(gemm_kernels_without_tensor_cores(ptx, dtype))
                ops = sorted({op.instruction for r in gemms for op in r.tensor_core_ops})
                copies = sum(r.cp_async for r in gemms)
                rows.append(
                    f"| {name} | {dtype} | {arch} | {len(reports)} | {on_tc} of {len(gemms)} | "
                    f"{copies} | {', '.join(ops)} |"
                )
    return rows


def main() -> int:
    """Print the two markdown tables, or why nothing was measured."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", default="1024,4096")
    parser.add_argument("--dtypes", default="float16,bfloat16")
    parser.add_argument("--no-async", action="store_true", help="build without cp.async")
    parser.add_argument("--census", action="store_true", help="PTX census only (no GPU needed)")
    args = parser.parse_args()
    if args.census:
        print(
            "| model | dtype | arch | kernels | GEMM kernels on tensor cores | with cp.async | "
            "instructions |\n|---|---|---|---|---|---|---|"
        )
        print("\n".join(census_rows(args.dtypes.split(","))))
        return 0
    try:
        import torch
    except ImportError:
        torch = None
    reason = gpu_or_reason(torch)
    if reason is not None:
        print(f"bench_cuda: {reason}; nothing measured.")
        return 0
    config = {"tirx.use_async_copy": not args.no_async}

    def build(mod, level, dtype, params):
        with tvm.transform.PassContext(opt_level=3, config=config):
            return tvmamp.build(mod, level, "cuda", dtype, params=params)

    dtypes = args.dtypes.split(",")
    print(f"GPU: {tvm.cuda(0).device_name} (arch from the local device), cp.async: {config}")
    print("| model | tvmamp ms | torch autocast ms | speed-up | error vs fp32 | torch error |")
    print("|---|---|---|---|---|---|")
    print("\n".join(simplenet_rows(torch, dtypes, build)))
    print("\n| kernel | tvmamp TFLOP/s | cuBLAS TFLOP/s | tvmamp / cuBLAS |\n|---|---|---|---|")
    print("\n".join(matmul_rows(torch, [int(s) for s in args.sizes.split(",")], dtypes, build)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
