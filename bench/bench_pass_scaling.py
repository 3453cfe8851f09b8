"""How long AutoMixedPrecision takes on generated graphs of growing size (target: 10,000 ops < 2 s).

Run: python bench/bench_pass_scaling.py [--ops 1000 5000 10000] [--level O2]
"""

from __future__ import annotations

import argparse
import time

from tvm import relax

from tvmamp.policy import Policy
from tvmamp.relay_passes import AutoMixedPrecision

# A repeating chain that touches every category: white, follow, black, promote.
PATTERN = ("matmul", "relu", "add", "exp", "atan2", "softmax", "multiply", "reshape")


def chain(n_ops: int) -> relax.Function:
    """A function with ``n_ops`` op bindings over 16x16 fp32 tensors."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((16, 16), "float32"))
    w = relax.Var("w", relax.TensorType((16, 16), "float32"))
    make = {
        "matmul": lambda h: relax.op.matmul(h, w),
        "relu": relax.op.nn.relu,
        "add": lambda h: relax.op.add(h, x),
        "exp": relax.op.exp,
        "atan2": lambda h: relax.op.atan2(h, x),
        "softmax": relax.op.nn.softmax,
        "multiply": lambda h: relax.op.multiply(h, w),
        "reshape": lambda h: relax.op.reshape(h, (16, 16)),
    }
    with bb.function("main", [x, w]):
        with bb.dataflow():
            h = x
            for i in range(n_ops):
                h = bb.emit(make[PATTERN[i % len(PATTERN)]](h))
            out = bb.emit_output(h)
        bb.emit_func_output(out)
    return bb.get()


def main() -> None:
    """Print a table of op count, conversion time and casts inserted."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ops", type=int, nargs="+", default=[1000, 2500, 5000, 10000])
    parser.add_argument("--level", default="O2")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    print(f"{'ops':>7} {'median s':>9} {'us/op':>7} {'casts':>6}")
    for n in args.ops:
        mod = chain(n)
        times, casts = [], 0
        for _ in range(args.repeat):
            amp = AutoMixedPrecision(Policy.for_level(args.level, "float16"))
            start = time.perf_counter()
            amp(mod)
            times.append(time.perf_counter() - start)
            casts = amp.report.casts_inserted
        med = sorted(times)[len(times) // 2]
        print(f"{n:>7} {med:>9.3f} {med / n * 1e6:>7.1f} {casts:>6}")


if __name__ == "__main__":
    main()
