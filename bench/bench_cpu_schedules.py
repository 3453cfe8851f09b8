"""Benchmark the default tvmamp CPU schedules against torch fp32, one thread, same run.

Run with ``TVM_NUM_THREADS=1 python bench/bench_cpu_schedules.py``.
"""

from __future__ import annotations

import argparse
import os

import ml_dtypes
import numpy as np
import torch
import tvm
from tvm import relax
from tvm.relax.frontend.torch import from_exported_program

from tvmamp.benchmark import paired_medians
from tvmamp.pipeline import legalize_passes
from tvmamp.schedules.cpu import cpu_schedule_passes
from tvmamp.targets.llvm_lowering import tir_pipeline

LEGALIZE = legalize_passes()


def _target(cores: int) -> tvm.target.Target:
    # without AMD's sse4a (insertq), which Intel hosts lack: the kernels run on both
    return tvm.target.Target(
        {"kind": "llvm", "mcpu": "znver4", "mattr": ["-sse4a"], "num-cores": cores}
    )


def build(mod: tvm.IRModule, target: tvm.target.Target) -> relax.VirtualMachine:
    """Legalise, schedule with the default CPU rules and build ``mod`` for ``target``."""
    with target:
        passes = [*LEGALIZE, *cpu_schedule_passes(target)]
        mod = tvm.transform.Sequential(passes)(mod)
    exe = tvm.compile(mod, target=target, tir_pipeline=tir_pipeline(target))  # as tvmamp.build
    return relax.VirtualMachine(exe, tvm.cpu())


def matmul_module(m: int, k: int, n: int, dtype: str) -> tvm.IRModule:
    """``x[m, k] @ w[k, n]`` with float32 accumulation and output."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((m, k), dtype))
    w = relax.Var("w", relax.TensorType((k, n), dtype))
    with bb.function("main", [x, w]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.matmul(x, w, out_dtype="float32"))
        bb.emit_func_output(out)
    return bb.get()


def bench_matmul(size: int, target, repeat: int) -> list[tuple[str, float, float]]:
    """Rows for fp32 and bf16-input matmul of ``size``^3 against torch fp32 (GFLOP/s)."""
    rng = np.random.default_rng(0)
    flops = 2.0 * size**3
    rows = []
    x, w = rng.standard_normal((2, size, size), dtype="float32")
    tx, tw = torch.from_numpy(x), torch.from_numpy(w)
    for dtype, np_dtype in (("float32", "float32"), ("bfloat16", ml_dtypes.bfloat16)):
        vm = build(matmul_module(size, size, size, dtype), target)
        args = [tvm.runtime.tensor(a.astype(np_dtype)) for a in (x, w)]
        fns = [lambda args=args, vm=vm: vm["main"](*args), lambda: torch.mm(tx, tw)]
        ours, ref = paired_medians(fns, repeat, 3)
        rows.append((f"matmul {size}^3 {dtype}-in fp32-acc", flops / ours / 1e9, flops / ref / 1e9))
    return rows


class SimpleNet(torch.nn.Module):
    """9 x Linear(width) with ReLU between layers (the Paddle AMP benchmark model, scaled)."""

    def __init__(self, width: int, depth: int = 9):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(depth))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i + 1 < len(self.layers):
                x = torch.relu(x)
        return x


class ConvNet(torch.nn.Module):
    """4 x (conv3x3 64 -> 64, padding 1) + ReLU."""

    def __init__(self, channels: int = 64, depth: int = 4):
        super().__init__()
        convs = (torch.nn.Conv2d(channels, channels, 3, padding=1) for _ in range(depth))
        self.convs = torch.nn.ModuleList(convs)

    def forward(self, x):
        for conv in self.convs:
            x = torch.relu(conv(x))
        return x


def bench_model(name: str, model: torch.nn.Module, example: torch.Tensor, target, repeat: int):
    """Row of (tvmamp latency ms, torch latency ms) for ``model``; also checks the numerics."""
    model = model.eval()
    with torch.no_grad():
        program = torch.export.export(model, (example,))
        mod = from_exported_program(program, unwrap_unit_return_tuple=True)
        vm = build(mod, target)
        arg = tvm.runtime.tensor(example.numpy())
        ref = model(example).numpy()
        np.testing.assert_allclose(vm["main"](arg).numpy(), ref, rtol=1e-3, atol=1e-3)
        ours, ref = paired_medians([lambda: vm["main"](arg), lambda: model(example)], repeat, 1)
    return (name, ours * 1e3, ref * 1e3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=15, help="timed repetitions (median)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    if os.environ.get("TVM_NUM_THREADS") != "1":
        print("warning: set TVM_NUM_THREADS=1 for single-thread numbers")
    target = _target(1)
    print(f"{'benchmark (1 thread)':44} {'tvmamp':>10} {'torch fp32':>11} {'ratio':>7}")
    for name, ours, ref in bench_matmul(1024, target, args.repeat):
        print(f"{name + ' GFLOP/s':44} {ours:10.1f} {ref:11.1f} {ours / ref:7.2f}")
    models = [
        ("SimpleNet 9xLinear(1024) b256 fp32", SimpleNet(1024), torch.randn(256, 1024)),
        ("ConvNet 4xconv3x3 64ch 1x64x56x56 fp32", ConvNet(), torch.randn(1, 64, 56, 56)),
    ]
    for name, model, example in models:
        row, ours, ref = bench_model(name, model, example, target, args.repeat)
        print(f"{row + ' ms':44} {ours:10.2f} {ref:11.2f} {ref / ours:7.2f}")
    print("ratio: tvmamp speed / torch speed (> 1 means tvmamp is faster)")


if __name__ == "__main__":
    main()
