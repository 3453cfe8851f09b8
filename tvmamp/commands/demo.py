"""``tvmamp demo``: SimpleNet at O0, O1 and O2 on the host CPU, with casts, dtypes, error, time."""

from __future__ import annotations

import dataclasses
import sys
import time

from .common import count


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
    p.add_argument("--batch", type=count(1), default=256)
    p.add_argument("--hidden", type=count(1), default=1024)
    p.add_argument("--layers", type=count(1), default=9)
    p.add_argument("--repeat", type=count(1), default=10, help="timed runs per level (median)")
    p.set_defaults(func=run)


def run(args) -> int:
    """Run the demo and print its table."""
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


@dataclasses.dataclass
class DemoRow:
    """One line of the demo table."""

    level: str
    casts: int
    ops_per_dtype: dict
    max_rel_err: float
    latency_ms: float
    build_s: float


def run_demo(
    levels=("O0", "O1", "O2"),
    dtype="bfloat16",
    target="llvm",
    batch=256,
    hidden=1024,
    layers=9,
    repeat=10,
    log=print,
) -> list[DemoRow]:
    """Build SimpleNet at each level and measure it against the fp32 (O0) build."""
    from tvmamp import models
    from tvmamp.benchmark import max_rel_error, median_latency_ms
    from tvmamp.driver import build

    mod, params = models.simple_net(batch=batch, hidden=hidden, layers=layers)
    inputs = models.example_inputs(mod)
    rows, reference = [], None
    for level in ("O0", *[lv for lv in levels if lv != "O0"]):
        log(
            f"[demo] building SimpleNet ({layers} x Linear({hidden}), batch {batch}) at {level} ..."
        )
        start = time.perf_counter()
        exe = build(mod, level=level, target=target, dtype=dtype, params=params)
        build_s = time.perf_counter() - start
        out = exe(*inputs)
        reference = out if reference is None else reference
        stats = exe.stats
        rows.append(
            DemoRow(
                level,
                stats.casts_inserted,
                stats.ops_per_dtype(),
                max_rel_error(out, reference),
                median_latency_ms(exe, inputs, repeat),
                build_s,
            )
        )
    return [r for r in rows if r.level in levels]


def format_table(rows: list[DemoRow], dtype: str) -> str:
    """The demo table as text."""
    header = (
        f"{'level':<6} {'casts':>5}  {'ops per dtype':<28} {'max rel err':>11} "
        f"{'median ms':>10} {'build s':>8}"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        ops = (
            ", ".join(f"{d}:{n}" for d, n in sorted(r.ops_per_dtype.items())) or "fp32 (unchanged)"
        )
        lines.append(
            f"{r.level:<6} {r.casts:>5}  {ops:<28} {r.max_rel_err:>11.2e} "
            f"{r.latency_ms:>10.2f} {r.build_s:>8.1f}"
        )
    lines.append(f"low dtype: {dtype}; error is max|out - fp32| / max|fp32| against the O0 build")
    return "\n".join(lines)
