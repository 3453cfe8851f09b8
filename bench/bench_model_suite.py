"""The model suite through tvmamp at O0/O1/O2 against torch fp32 and torch autocast bf16.

For each model: relative error of every tvmamp level against the framework's fp32 output, top-1
agreement with fp32 over N random inputs (batch 1 each), and latency of one batch-1 call, timed
interleaved with torch fp32 and torch autocast bf16 in the same run, one thread.

Run: TVM_NUM_THREADS=1 python bench/bench_model_suite.py [--models resnet18,...] [--inputs 64]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("TVM_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

import tvmamp  # noqa: E402
from tvmamp import suite  # noqa: E402
from tvmamp.benchmark import max_rel_error, paired_medians  # noqa: E402


def log(msg: str) -> None:
    """Progress on stderr."""
    print(msg, file=sys.stderr, flush=True)


def torch_run(model, x, bf16: bool) -> np.ndarray:
    """torch eager on ``x``: fp32, or under CPU autocast bf16 (output as fp32)."""
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        return model(torch.from_numpy(x)).float().numpy()


def accuracy(exe, inputs, refs):
    """(max relative error, top-1 agreement) of ``exe`` against the fp32 outputs."""
    outs = [exe(x) for x in inputs]
    err = max(max_rel_error(o, r) for o, r in zip(outs, refs))
    agree = np.mean([o.argmax() == r.argmax() for o, r in zip(outs, refs)])
    return err, float(agree)


def bench_model(name, args):
    """One table row per level (plus the torch rows) for suite model ``name``."""
    size = dict(image_size=args.image_size, seq_len=args.seq_len)
    model = suite.create(name, image_size=args.image_size)
    inputs = [suite.example_inputs(name, 1, seed=100 + i, **size)[0] for i in range(args.inputs)]
    refs = [suite.reference(model, [x]) for x in inputs]
    log(f"[{name}] importing ...")
    mod, params = suite.load(name, batch=1, **size)
    exes = {}
    for level in args.levels:
        start = time.perf_counter()
        exes[level] = tvmamp.build(mod, level, args.target, dtype="bfloat16", params=params)
        log(f"[{name}] built {level} in {time.perf_counter() - start:.0f} s")
    rows = {level: accuracy(exe, inputs, refs) for level, exe in exes.items()}
    is_torch = isinstance(model, torch.nn.Module)
    torch_rows = [("torch fp32", False), ("torch autocast bf16", True)] if is_torch else []
    fns = [lambda b=b: torch_run(model, inputs[0], b) for _, b in torch_rows]
    fns += [lambda e=e: e(inputs[0]) for e in exes.values()]
    log(f"[{name}] timing {len(fns)} variants interleaved, {args.repeat} rounds ...")
    times = paired_medians(fns, repeat=args.repeat)
    classes = len({int(r.argmax()) for r in refs})
    table = []
    for (label, bf16), t in zip(torch_rows, times):
        outs = [torch_run(model, x, bf16) for x in inputs]
        err = max(max_rel_error(o, r) for o, r in zip(outs, refs))
        agree = float(np.mean([o.argmax() == r.argmax() for o, r in zip(outs, refs)]))
        table.append((name, label, err, agree, t, classes))
    for level, t in zip(exes, times[len(torch_rows) :]):
        label = f"tvmamp {level} " + ("(fp32, no conversion)" if level == "O0" else "bf16")
        table.append((name, label, *rows[level], t, classes))
    return table, (times[0] if torch_rows else None)


def format_rows(table, torch_ms) -> list[str]:
    """Markdown table rows; times relative to torch fp32 where there is a torch model."""
    lines = []
    for name, label, err, agree, t, classes in table:
        ratio = f"{t / torch_ms:.2f}x" if torch_ms else "n/a"
        top1 = f"{agree * 100:.1f}%"
        lines.append(
            f"| {name} | {label} | {err:.2e} | {top1} | {t * 1e3:.2f} | {ratio} | {classes} |"
        )
    return lines


def main() -> None:
    """Print the markdown table."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", default=",".join(suite.SUITE))
    parser.add_argument("--levels", default="O0,O1,O2")
    parser.add_argument("--inputs", type=int, default=64, help="random inputs for top-1")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--target", default="llvm -num-cores=1")
    args = parser.parse_args()
    args.levels = [lv.strip() for lv in args.levels.split(",") if lv.strip()]
    torch.set_num_threads(1)
    print(
        "| model | variant | max rel err vs fp32 | top-1 = fp32 | ms (batch 1) "
        "| time / torch fp32 | fp32 classes seen |"
    )
    print("|---|---|---|---|---|---|---|")
    for name in args.models.split(","):
        table, torch_ms = bench_model(name.strip(), args)
        print("\n".join(format_rows(table, torch_ms)), flush=True)


if __name__ == "__main__":
    main()
