"""fp16 on the CPU (F16C, fp32 FMA): SimpleNet O2 fp16 against tvmamp fp32 and torch, same run.

Times SimpleNet (9 x Linear(1024), ReLU) at batch 1 and 256 through tvmamp O2 fp16 (the
``CPUMatmulFP16`` rule: fp16 weights packed at compile time), the same build with that rule
turned off (the generic CPU matmul rule, the fp16 path before it), tvmamp O0 fp32, torch fp32
and torch ``model.to(float16)``, interleaved (``tvmamp.benchmark.paired_medians``).

Run: python bench/bench_cpu_fp16.py [--threads 1] [--repeat 20] [--batches 1,256]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import os

from bench_simplenet import torch_simplenet  # bench/ is on sys.path when run as a script


def main() -> None:
    """Parse options, set the thread count before TVM starts, print one table per batch."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--batches", default="1,256")
    args = parser.parse_args()
    os.environ["TVM_NUM_THREADS"] = str(args.threads)  # before TVM starts its thread pool
    import torch

    torch.set_num_threads(args.threads)
    print(f"date {datetime.date.today()}, torch {torch.__version__}, {args.threads} thread(s)")
    for batch in (int(b) for b in args.batches.split(",")):
        simplenet_table(batch, args.threads, args.repeat)


@contextlib.contextmanager
def generic_fp16_rule():
    """Build without the F16C rule: fp16 matmuls go to the generic CPU matmul rule."""
    from tvmamp.schedules.cpu import default_rules

    saved = default_rules.has_f16c
    default_rules.has_f16c = lambda _target: False
    try:
        yield
    finally:
        default_rules.has_f16c = saved


def _builds(mod, params, target: str) -> dict:
    """The tvmamp executables compared: O2 fp16 with and without the F16C rule, O0 fp32."""
    from tqdm import tqdm

    import tvmamp

    exes = {}
    steps = ["tvmamp O2 fp16", "tvmamp O2 fp16, generic rule", "tvmamp O0 fp32"]
    for name in tqdm(steps, desc="building", leave=False):
        if name == "tvmamp O0 fp32":
            exes[name] = tvmamp.build(mod, "O0", target, params=params)
            continue
        with generic_fp16_rule() if "generic" in name else contextlib.nullcontext():
            exes[name] = tvmamp.build(mod, "O2", target, "float16", params=params)
    return exes


def simplenet_table(batch: int, threads: int, repeat: int) -> None:
    """Time SimpleNet at ``batch``; print a markdown table and each variant's error vs torch."""
    times, errors = time_variants(batch, threads, repeat)
    print(f"\nSimpleNet 9 x Linear(1024), batch {batch}, {threads} thread(s), repeat {repeat}\n")
    print("| variant | median ms | time / tvmamp O2 fp16 | max rel err vs torch fp32 |")
    print("|---|---|---|---|")
    ours = times["tvmamp O2 fp16"]
    for name, sec in times.items():
        err = f"{errors[name]:.1e}" if name in errors else "0 (reference)"
        print(f"| {name} | {sec * 1e3:.2f} | {sec / ours:.2f} | {err} |")


def time_variants(batch: int, threads: int, repeat: int) -> tuple[dict, dict]:
    """Median seconds per call of every variant (interleaved) and max rel errors vs torch fp32."""
    import numpy as np
    import torch
    import tvm

    from tvmamp import models
    from tvmamp.benchmark import max_rel_error, paired_medians

    mod, params = models.simple_net(batch=batch)
    x = np.random.default_rng(1).standard_normal((batch, 1024)).astype("float32")
    exes = _builds(mod, params, f"llvm -num-cores={threads}")
    net = torch_simplenet(params, 9)
    net16, tx = copy.deepcopy(net).to(torch.float16), torch.from_numpy(x)
    tx16 = tx.half()  # converted once, outside the timed calls
    arg = [tvm.runtime.tensor(x)]
    fns = {name: (lambda e=exe: e.vm["main"](*arg)) for name, exe in exes.items()}
    fns["torch fp32"] = lambda: net(tx)
    fns["torch model.to(float16)"] = lambda: net16(tx16)
    with torch.no_grad():
        ref = net(tx).numpy()
        errors = {name: max_rel_error(np.asarray(exe(x)), ref) for name, exe in exes.items()}
        errors["torch model.to(float16)"] = max_rel_error(net16(tx16).float().numpy(), ref)
        times = dict(zip(fns, paired_medians(list(fns.values()), repeat), strict=True))
    return times, errors


if __name__ == "__main__":
    main()
