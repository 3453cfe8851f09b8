"""PyTorch ``TransformerEncoderLayer(512, 8, 2048)`` on 8 x 128 tokens: tvmamp O1/O2 against torch.

Issue 17's transformer-block target: tvmamp O2 (bf16) no slower than torch pure bf16
(``.to(torch.bfloat16)``). The layer is imported with ``tvmamp.from_torch`` (random weights,
seed 0, eval mode); every variant is timed in one process with ``paired_medians`` (interleaved,
settled), and the error of each against torch fp32 is printed beside its time. The last part
is the per-kernel profile of O2 (``tvmamp.debugging.profile``). ``--copies`` adds O2 built with
the head split's copies as kernels of their own (the llvm entry without
``SinkRowLayoutBelowMatmul`` and ``FuseLayoutIntoGemm``: the build before they landed).

Run: TVM_NUM_THREADS=1 python bench/bench_transformer.py [--threads 1] [--repeat 15] [--copies]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os

import numpy as np
import torch
import tvm

import tvmamp
from tvmamp import debugging
from tvmamp.benchmark import max_rel_error, paired_medians
from tvmamp.relay_passes.gemm_layout import FuseLayoutIntoGemm
from tvmamp.relay_passes.row_layout import SinkRowLayoutBelowMatmul
from tvmamp.targets import registry


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=int(os.environ.get("TVM_NUM_THREADS", 1)))
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--levels", default="O1,O2")
    parser.add_argument("--copies", action="store_true", help="add O2 with the copy kernels")
    args = parser.parse_args()
    if os.environ.get("TVM_NUM_THREADS") != str(args.threads):
        parser.error(f"set TVM_NUM_THREADS={args.threads} (TVM reads it when it starts)")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(512, 8, 2048, batch_first=True).eval()
    x = torch.randn(args.batch, args.tokens, 512)
    with torch.inference_mode():
        ref = layer(x).numpy()
    low = _low_copy(layer)
    x_low = x.bfloat16()

    mod, params = tvmamp.from_torch(layer, (x,))
    target = f"llvm -num-cores={args.threads}"
    exes = {
        lv: tvmamp.build(mod, lv, target, dtype="bfloat16", params=params)
        for lv in args.levels.split(",")
    }
    if args.copies:
        with head_split_copies():
            exes["O2 (head split copies)"] = tvmamp.build(
                mod, "O2", target, dtype="bfloat16", params=params
            )
    inputs = [tvm.runtime.tensor(np.ascontiguousarray(x.numpy()))]
    fns = {f"tvmamp {lv}": (lambda e=e: e.vm["main"](*inputs)) for lv, e in exes.items()}
    fns["torch fp32"] = lambda: layer(x)
    fns["torch .to(bfloat16)"] = lambda: low(x_low)

    def autocast():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return layer(x)

    fns["torch autocast bf16"] = autocast
    with torch.inference_mode():
        errors = {
            name: max_rel_error(np.asarray(_numpy(fn()), dtype="float32"), ref)
            for name, fn in fns.items()
        }
        times = paired_medians(list(fns.values()), repeat=args.repeat)
    print(
        f"\nTransformerEncoderLayer(512, 8, 2048), {args.batch} x {args.tokens} tokens, "
        f"{args.threads} thread(s)\n"
    )
    print("| variant | ms | / torch .to(bfloat16) | max rel err vs torch fp32 |\n|---|---|---|---|")
    base = times[list(fns).index("torch .to(bfloat16)")]
    for (name, _), t in zip(fns.items(), times):
        print(f"| {name} | {t * 1e3:.2f} | {t / base:.2f} | {errors[name]:.1e} |")
    last = args.levels.split(",")[-1]
    prof = debugging.profile(exes[last], inputs)
    print(f"\nSlowest kernels of {last}:\n")
    print("| kernel | ms | share | % of peak |\n|---|---|---|---|")
    for r in prof.records[:8]:
        peak = "-" if r.efficiency is None else f"{100 * r.efficiency:.0f}"  # None: no cost model
        print(f"| `{r.name}` | {r.ms:.3f} | {100 * r.share:.0f} % | {peak} |")


@contextlib.contextmanager
def head_split_copies():
    """Build with the llvm entry's head-split passes left out (the copies stay kernels)."""
    entry = registry.REGISTRY["llvm"]
    moves = (SinkRowLayoutBelowMatmul, FuseLayoutIntoGemm)

    def without(passes):
        return lambda *a: [p for p in passes(*a) if not isinstance(p, moves)]

    registry.REGISTRY["llvm"] = dataclasses.replace(
        entry,
        partition_passes=without(entry.partition_passes),
        fusion_passes=without(entry.fusion_passes),
    )
    try:
        yield
    finally:
        registry.REGISTRY["llvm"] = entry


def _low_copy(layer):
    import copy

    return copy.deepcopy(layer).to(torch.bfloat16)


def _numpy(out):
    if isinstance(out, torch.Tensor):
        return out.float().numpy()
    return out.numpy() if hasattr(out, "numpy") else out


if __name__ == "__main__":
    main()
