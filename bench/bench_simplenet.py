"""SimpleNet (Paddle's AMP guide: 9 x Linear(1024), batch 256) through tvmamp.build vs torch.

One thread by default (TVM_NUM_THREADS=1, torch.set_num_threads(1)); every figure in a table
comes from the same run, timed interleaved.

Run: TVM_NUM_THREADS=1 python bench/bench_simplenet.py [--batch 256] [--levels O0,O1,O2]
"""

from __future__ import annotations

import argparse
import os

import numpy as np
import torch

import tvmamp
from tvmamp import models
from tvmamp.benchmark import max_rel_error, paired_medians


def torch_simplenet(params: dict, layers: int) -> torch.nn.Sequential:
    """The same network in torch, with tvmamp's weights."""
    mods = []
    for i in range(layers):
        w = params[f"linear{i}.weight"]
        lin = torch.nn.Linear(w.shape[1], w.shape[0])
        lin.weight.data = torch.from_numpy(w)
        lin.bias.data = torch.from_numpy(params[f"linear{i}.bias"])
        mods += [lin] + ([torch.nn.ReLU()] if i < layers - 1 else [])
    return torch.nn.Sequential(*mods).eval()


def main() -> None:
    """Print latency and error of each tvmamp level and of torch fp32 / autocast bf16."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=9)
    parser.add_argument("--levels", default="O0,O1,O2")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    threads = int(os.environ.get("TVM_NUM_THREADS", "1"))
    os.environ["TVM_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)

    mod, params = models.simple_net(args.batch, args.hidden, args.layers)
    x = models.example_inputs(mod)[0]
    net, tx = torch_simplenet(params, args.layers), torch.from_numpy(x)
    target = f"llvm -num-cores={threads}"
    exes = {
        lv: tvmamp.build(mod, lv, target, dtype=args.dtype, params=params)
        for lv in args.levels.split(",")
    }
    with torch.no_grad():
        reference = net(tx).numpy()

        def autocast():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return net(tx)

        fns = [lambda e=e: e(x) for e in exes.values()] + [lambda: net(tx), autocast]
        times = paired_medians(fns, repeat=args.repeat)
        errors = [max_rel_error(e(x), reference) for e in exes.values()]
        errors += [0.0, max_rel_error(autocast().float().numpy(), reference)]
    names = [f"tvmamp {lv} {args.dtype if lv != 'O0' else 'fp32'}" for lv in exes]
    names += ["torch fp32", "torch autocast bf16"]
    torch_fp32 = times[len(exes)]
    print(
        f"SimpleNet {args.layers} x Linear({args.hidden}), batch {args.batch}, {threads} thread(s)"
    )
    print(f"{'variant':<28} {'median ms':>10} {'vs torch fp32':>14} {'max rel err':>12}")
    for name, t, err in zip(names, times, errors):
        print(f"{name:<28} {t * 1e3:>10.2f} {torch_fp32 / t:>13.2f}x {err:>12.2e}")
    print("vs torch fp32: torch fp32 time / variant time (> 1 is faster than torch fp32)")
    assert np.isfinite(times).all()


if __name__ == "__main__":
    main()
