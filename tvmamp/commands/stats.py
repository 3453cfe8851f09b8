"""``tvmamp stats``: Paddle's operator table (calls per dtype) for a model converted with AMP."""

from __future__ import annotations

import json
import sys

from .common import add_build_options, add_shape_option, build_kwargs, load_model_arg


def register(subparsers) -> None:
    """Add the ``stats`` parser."""
    p = subparsers.add_parser(
        "stats",
        help="op calls per dtype after AMP conversion",
        description="Convert MODEL to mixed precision and print each op with its number of "
        "calls in FP16 / BF16 / FP32 / Other, from the IR or (--executed) counted in a run.",
    )
    add_build_options(p)
    add_shape_option(p)
    p.add_argument(
        "--executed",
        action="store_true",
        help="build an instrumented model, run it once on random inputs and count the calls "
        "actually executed",
    )
    p.add_argument("--json", action="store_true", help="print the counts as JSON")
    p.set_defaults(func=run)


def run(args) -> int:
    """Print the operator table."""
    from tvmamp import debugging, models
    from tvmamp.conversion import convert
    from tvmamp.driver import build

    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    log(f"[stats] loading {args.model} ...")
    mod, params = load_model_arg(args)
    if args.executed:
        log(f"[stats] building an instrumented model at {args.level} and running it once ...")
        inputs = models.example_inputs(mod)  # before the build: a symbolic input fails here
        with debugging.operator_stats_collection(verbose=False) as stats:
            exe = build(mod, params=params, **build_kwargs(args))
            exe(*inputs)
    else:
        log(f"[stats] converting at {args.level} ...")
        stats = debugging.static_operator_stats(convert(mod, params=params, **build_kwargs(args)))
    print(json.dumps(stats.as_dict(), indent=1) if args.json else stats.table())
    return 0
