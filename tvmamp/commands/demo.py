"""``tvmamp demo``: the built-in SimpleNet at O0/O1/O2 on the host CPU."""

from __future__ import annotations

import sys


def register(subparsers) -> None:
    """Add the ``demo`` parser."""
    p = subparsers.add_parser(
        "demo",
        help="build the built-in SimpleNet at O0, O1, O2 and print casts, dtypes, error, latency",
        description="Build Paddle's AMP-guide SimpleNet (9 x Linear(1024), batch 256) at O0, O1 "
        "and O2 for the host CPU and compare each with the fp32 build.",
    )
    p.add_argument(
        "--dtype",
        default=None,
        choices=["float16", "bfloat16"],
        help="low dtype (default: bfloat16 on CPUs with avx512_bf16, else float16)",
    )
    p.add_argument("--target", default="llvm", help="target (default: llvm, the host CPU)")
    p.add_argument("--levels", default="O0,O1,O2", help="comma-separated levels (default O0,O1,O2)")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=9)
    p.add_argument("--repeat", type=int, default=10, help="timed runs per level (median)")
    p.set_defaults(func=run)


def run(args) -> int:
    """Run the demo and print its table."""
    from tvmamp.demo import format_table, run_demo
    from tvmamp.targets import resolve_target

    target, entry = resolve_target(args.target)
    dtype = args.dtype or entry.default_dtype(target)
    levels = tuple(lv.strip() for lv in args.levels.split(",") if lv.strip())
    rows = run_demo(
        levels,
        dtype,
        target,
        args.batch,
        args.hidden,
        args.layers,
        args.repeat,
        log=lambda msg: print(msg, file=sys.stderr, flush=True),
    )
    print(format_table(rows, dtype))
    return 0
