"""Paddle's AMP training table on this CPU: 9 x Linear(N), SGD lr 1e-4, 2 epochs x 10 batches.

fp32 (O0), O1 and O2 train from the same weights on the same data; the final loss (the loss of
the last batch, as Paddle's guide prints it) and the time per training step come from one run,
the step times measured interleaved. torch fp32 and torch autocast (same weights and data) are
a cross-check of the fp32 numbers.

Run: TVM_NUM_THREADS=1 python bench/bench_training.py [--hidden 512] [--batch 128] [--number 3]
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

from tvmamp import models
from tvmamp.benchmark import paired_medians
from tvmamp.training import SGD, Trainer

PADDLE = {"fp32": (0.6486028, 0.529), "O1": (0.6486219, 0.118), "O2": (0.6743, 0.102)}


def _data(args):
    rng = np.random.default_rng(args.seed)
    shape = (args.batches, args.batch, args.hidden)
    return rng.random(shape).astype("float32"), rng.random(shape).astype("float32")


def _train(trainer, xs, ys, epochs):
    for _ in range(epochs):
        for x, y in zip(xs, ys):
            loss = trainer.step(x, y)
    return loss


def _torch_rows(args, params, xs, ys):
    import torch

    torch.set_num_threads(int(os.environ.get("TVM_NUM_THREADS", "1")))
    rows, tx, ty = {}, torch.from_numpy(xs), torch.from_numpy(ys)
    for name, dtype in (("torch fp32", None), (f"torch autocast {args.dtype}", args.dtype)):
        net = _torch_net(params, args.layers)
        opt = torch.optim.SGD(net.parameters(), lr=args.lr)

        def step(x, y, net=net, opt=opt, dtype=dtype):
            with torch.autocast("cpu", getattr(torch, dtype or "bfloat16"), enabled=bool(dtype)):
                loss = torch.nn.functional.mse_loss(net(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            return loss.item()

        for _ in range(args.epochs):
            for i in range(args.batches):
                loss = step(tx[i], ty[i])
        rows[name] = (loss, lambda step=step, x=tx[0], y=ty[0]: step(x, y))
    return rows


def _torch_net(params, layers):
    import torch

    mods = []
    for i in range(layers):
        w = params[f"linear{i}.weight"]
        lin = torch.nn.Linear(w.shape[1], w.shape[0])
        lin.weight.data = torch.from_numpy(w.copy())
        lin.bias.data = torch.from_numpy(params[f"linear{i}.bias"].copy())
        mods += [lin] + ([torch.nn.ReLU()] if i < layers - 1 else [])
    return torch.nn.Sequential(*mods)


def _table(results, times, args):
    base = results["fp32"]
    lines = [
        "| mode | final loss | rel. diff vs fp32 | ms / step | speed-up | Paddle final loss "
        "(rel. diff) | Paddle s / step (V100) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, loss in results.items():
        p_loss, p_time = "-", "-"
        if name in PADDLE:
            paddle, ref = PADDLE[name], PADDLE["fp32"][0]
            p_loss, p_time = f"{paddle[0]} ({(paddle[0] - ref) / ref:+.1e})", paddle[1]
        lines.append(
            f"| {name} | {loss:.7f} | {(loss - base) / base:+.2e} | {times[name] * 1e3:.1f} | "
            f"{times['fp32'] / times[name]:.2f}x | {p_loss} | {p_time} |"
        )
    return "\n".join(lines)


def main() -> None:
    """Train each mode, then time one step of each interleaved, and print the table."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--layers", type=int, default=9)
    parser.add_argument("--batches", type=int, default=10)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument(
        "--number",
        type=int,
        default=3,
        help="steps per timing: each round times this many steps of one mode in a row "
        "(1 = every step right after another mode's, its weights out of cache)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-torch", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("TVM_NUM_THREADS", "1")

    mod, params = models.simple_net(args.batch, args.hidden, args.layers, seed=args.seed)
    xs, ys = _data(args)
    results, steps = {}, {}
    for name, level in (("fp32", "O0"), ("O1", "O1"), ("O2", "O2")):
        start = time.perf_counter()
        trainer = Trainer(mod, "mse", SGD(args.lr), level=level, dtype=args.dtype, params=params)
        compiled = time.perf_counter() - start
        results[name] = _train(trainer, xs, ys, args.epochs)
        steps[name] = lambda t=trainer: t.step(xs[0], ys[0])
        print(f"{name}: compiled in {compiled:.0f} s, final loss {results[name]:.7f}", flush=True)
    if not args.no_torch:
        for name, (loss, step) in _torch_rows(args, params, xs, ys).items():
            results[name], steps[name] = loss, step
    medians = paired_medians(list(steps.values()), repeat=args.repeat, number=args.number)
    print(_table(results, dict(zip(steps, medians)), args))


if __name__ == "__main__":
    main()
