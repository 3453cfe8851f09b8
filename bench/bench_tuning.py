"""Tuned vs untuned tvmamp kernels vs torch, one thread, one run: matmuls, bf16 GEMMs, SimpleNet.

For each model (O2, bf16): build with the default schedules, tune ``--trials`` trials with
``tvmamp.tune`` (timed, from an empty log), then build twice with the log:

- "meta_schedule": every kernel with a record takes its best record (what TVM's
  MetaScheduleApplyDatabase does with the raw log);
- "tvmamp log": through ``load_tuning_log``, which keeps a kernel's default schedule where it
  was timed faster than the best record while tuning.

Untuned, both tuned builds, torch fp32 and torch bf16 are then timed interleaved in the same run
(``paired_medians``). torch bf16 is autocast for "matmul" and SimpleNet; for the "gemm MxKxN"
cases (bf16 GEMM kernels, tuned in tvmamp's vdpbf16ps/AMX space) it is ``torch.mm`` on bf16
tensors converted beforehand, the strongest anchor (oneDNN brgemm).

A case "zoo:NAME" tunes a model of the zoo (bench/zoo_models.py, imported with
``tvmamp.from_torch``) against torch fp32 and autocast bf16 on the same seeded inputs.

Run: TVM_NUM_THREADS=1 python bench/bench_tuning.py [--trials 64] [--repeat 15]
     [--cases matmul,simplenet,gemm512x1024x1024,gemm257x4096x1024,zoo:resnet50,zoo:bert]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np
import torch
import tvm
from bench_simplenet import torch_simplenet
from bench_zoo import _first  # a model's output as one float64 array
from tvm import relax
from tvm.s_tir import meta_schedule as ms
from zoo_models import ZOO

import tvmamp
from tvmamp import models
from tvmamp.benchmark import max_rel_error, paired_medians
from tvmamp.executable import Executable
from tvmamp.pipeline import relax_pipeline
from tvmamp.tuning import load_tuning_log, tune
from tvmamp.tuning.intrinsics import register_log_intrinsics


def matmul_model(size: int, k: int | None = None, n: int | None = None):
    """``x[size, k] @ w[k, n]`` in fp32 (square by default), ``w`` a param (bound at build)."""
    k, n = k or size, n or size
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((size, k), "float32"))
    w = relax.Var("w", relax.TensorType((k, n), "float32"))
    with bb.function("main", [x, w]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.matmul(x, w))
        bb.emit_func_output(out)
    mod = bb.get()
    mod["main"] = mod["main"].with_attr("num_input", 1)
    rng = np.random.default_rng(0)
    w = rng.standard_normal((k, n)) / np.sqrt(k)
    return mod, {"w": w.astype("float32")}


def torch_fns(name: str, params: dict, xs: list[np.ndarray]):
    """torch fp32 and autocast-bf16 callables for the same model and weights."""
    tx = torch.from_numpy(xs[0])
    if name.startswith("zoo:"):
        net = ZOO[name.removeprefix("zoo:")].build()
        tensors = [torch.from_numpy(x) for x in xs]
        fp32 = lambda: net(*tensors)  # noqa: E731
    elif name.startswith("gemm"):  # bf16 operands converted once, as weights would be
        tw = torch.from_numpy(params["w"])
        xb, wb = tx.bfloat16(), tw.bfloat16()
        return (lambda: torch.mm(tx, tw)), (lambda: torch.mm(xb, wb))
    elif name == "matmul":
        tw = torch.from_numpy(params["w"])
        fp32 = lambda: torch.mm(tx, tw)  # noqa: E731
    else:
        net = torch_simplenet(params, 9)
        fp32 = lambda: net(tx)  # noqa: E731

    def bf16():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return fp32()

    return fp32, bf16


def build_with(converted, database) -> Executable:
    """Compile ``converted`` as tvmamp.build does, applying ``database`` in phase 3."""
    pipeline = relax_pipeline(converted.target, converted.entry, converted.policy, database)
    with database:
        vm_exec = tvm.compile(
            converted.mod,
            target=converted.target,
            relax_pipeline=pipeline,
            tir_pipeline=converted.entry.tir_pipeline(converted.target),
        )
    c = converted
    return Executable(vm_exec, c.target, c.mod, c.report, c.policy)


def bench(name, mod, params, target, trials, repeat, work_dir, inputs=None):
    """One row: ms of untuned, meta_schedule, tvmamp log, torch fp32 and bf16; tuning; notes."""
    untuned = tvmamp.build(mod, "O2", target, "bfloat16", params)
    start = time.perf_counter()
    result = tune(mod, target, "O2", "bfloat16", work_dir, trials, params)
    tuning_s = time.perf_counter() - start
    converted = tvmamp.convert(mod, "O2", target, "bfloat16", params)
    register_log_intrinsics(work_dir)
    raw = build_with(converted, ms.database.JSONDatabase(work_dir=work_dir))
    database, notes = load_tuning_log(work_dir, converted)  # also registers the log's intrinsics
    logged = build_with(converted, database)
    xs = inputs or models.example_inputs(mod)[:1]
    fp32, bf16 = torch_fns(name, params, xs)
    exes = (untuned, raw, logged)
    with torch.no_grad():
        ref = _first(fp32())
        fns = [*(lambda e=e: e(*xs) for e in exes), fp32, bf16]
        times = paired_medians(fns, repeat)
    errors = [max_rel_error(_first(e(*xs)), ref) for e in exes]
    print(result.summary(), *notes, sep="\n", file=sys.stderr)
    return [t * 1e3 for t in times], tuning_s, result.new_trials, errors


def case(name: str, size: int) -> tuple:
    """``(key, label, mod, params, inputs)`` of a case: matmul, simplenet, gemmMxKxN, zoo:NAME.

    ``inputs`` is a list of numpy arrays for zoo models, else None (the model's example input).
    """
    if name == "matmul":
        return ("matmul", f"matmul {size}^3", *matmul_model(size), None)
    if name == "simplenet":
        return ("simplenet", "SimpleNet 9xLinear(1024) b256", *models.simple_net(), None)
    if name.startswith("zoo:"):
        entry = ZOO.get(name.removeprefix("zoo:"))
        if entry is None:
            raise ValueError(
                f"bench_tuning: zoo model {name!r} is not one of "
                + ", ".join(f"zoo:{n}" for n in ZOO)
            )
        example = entry.inputs(100)
        mod, params = tvmamp.from_torch(entry.build(), tuple(example))
        return (name, f"zoo {entry.name}", mod, params, [t.numpy() for t in example])
    if name.startswith("gemm"):
        m, k, n = (int(v) for v in name.removeprefix("gemm").split("x"))
        return (name, f"bf16 GEMM {m} x {k} x {n}", *matmul_model(m, k, n), None)
    raise ValueError(
        f"bench_tuning: case {name!r} is not one of matmul, simplenet, gemmMxKxN "
        "(e.g. gemm512x1024x1024), zoo:NAME (e.g. zoo:resnet50)"
    )


def main() -> None:
    """Print one markdown table row per model."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--trials", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--cases", default="matmul,simplenet,gemm512x1024x1024,gemm257x4096x1024")
    args = parser.parse_args()
    threads = int(os.environ.get("TVM_NUM_THREADS", "1"))
    os.environ["TVM_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)
    target = f"llvm -num-cores={threads}"
    cases = [case(name, args.size) for name in args.cases.split(",")]
    print(
        "| model (O2 bf16, 1 thread) | untuned ms | meta_schedule ms | tvmamp log ms "
        "| torch fp32 ms | torch bf16 ms | speed / best torch: untuned, meta_schedule, log "
        "| trials | tuning s | max rel err (untuned, meta_schedule, log) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for key, label, mod, params, inputs in cases:
        with tempfile.TemporaryDirectory() as work_dir:
            t, tuning_s, n, err = bench(
                key, mod, params, target, args.trials, args.repeat, work_dir, inputs
            )
        best_torch = min(t[3], t[4])
        speeds = ", ".join(f"{best_torch / v:.2f}" for v in t[:3])
        errs = ", ".join(f"{e:.1e}" for e in err)
        print(
            f"| {label} | {t[0]:.2f} | {t[1]:.2f} | {t[2]:.2f} | {t[3]:.2f} | {t[4]:.2f} "
            f"| {speeds} | {n} | {tuning_s:.0f} | {errs} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
