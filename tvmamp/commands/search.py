"""``tvmamp search``: find the fastest precision plan that meets an error budget."""

from __future__ import annotations

import sys

from .common import add_build_options, add_shape_option, load_model_arg, read_arrays


def register(subparsers) -> None:
    """Add the ``search`` parser."""
    p = subparsers.add_parser(
        "search",
        help="search a per-node precision plan that meets an error budget",
        description="Start from --level (O3), return the nodes that break the budget to fp32 "
        "and write the plan as JSON; apply it with 'tvmamp compile MODEL --plan plan.json'.",
    )
    add_build_options(p)
    add_shape_option(p)
    p.set_defaults(level="O3")
    p.add_argument(
        "--inputs",
        required=True,
        help=".npz of calibration data: one array per model input, samples along "
        "axis 0 (the last --holdout fraction is held out)",
    )
    p.add_argument("--budget", type=float, default=5e-3, help="error budget (default 5e-3)")
    p.add_argument(
        "--metric",
        default="output",
        choices=["output", "top1"],
        help="output: max relative error; top1: fraction of changed arg-max classes",
    )
    p.add_argument("--time-limit", type=float, default=300.0, help="seconds (default 300)")
    p.add_argument(
        "--no-latency",
        action="store_true",
        help="skip the speed step: keep the accuracy search's plan without timing alternatives",
    )
    p.add_argument("--holdout", type=float, default=0.25, help="held-out fraction (default 0.25)")
    p.add_argument("-o", "--output", required=True, help="where to write the plan (.json)")
    p.set_defaults(func=run)


def load_samples(path: str) -> list[tuple]:
    """Samples from an .npz: arrays in file order, one per model input, samples along axis 0."""
    arrays = read_arrays(path, "tvmamp search")
    if not arrays or len({a.shape[0] for a in arrays}) != 1:
        raise ValueError(f"{path}: expected arrays with the same number of samples along axis 0")
    return [tuple(a[i] for a in arrays) for i in range(arrays[0].shape[0])]


def run(args) -> int:
    """Search and save the plan."""
    from tvmamp.search import ErrorBudget, search_precision

    mod, params = load_model_arg(args)
    samples = load_samples(args.inputs)
    print(
        f"[search] {len(samples)} samples, budget {args.budget:g} ({args.metric})",
        file=sys.stderr,
        flush=True,
    )
    plan = search_precision(
        mod,
        samples,
        target=args.target,
        dtype=args.dtype,
        budget=ErrorBudget(args.budget, args.metric),
        params=params,
        start_level=args.level,
        time_limit_s=args.time_limit,
        holdout=args.holdout,
        measure_latency=not args.no_latency,
    )
    plan.save(args.output)
    print(plan.summary())
    print(f"wrote {args.output}")
    return 0
