"""``tvmamp compare``: each op's output in the AMP build against the fp32 build (CSV and PNG)."""

from __future__ import annotations

import sys

from .common import add_build_options, add_shape_option, build_kwargs, load_model_arg


def register(subparsers) -> None:
    """Add the ``compare`` parser."""
    p = subparsers.add_parser(
        "compare",
        help="per-op accuracy of the AMP build against fp32",
        description="Build MODEL in fp32 and with AMP, run both on the same random inputs and "
        "report, op by op in graph order, the compute dtype, max abs/rel error and the "
        "overflow/underflow counts, and the first op over the threshold.",
    )
    add_build_options(p)
    add_shape_option(p)
    p.add_argument("-o", "--output", default="amp_compare", help="output directory")
    p.add_argument(
        "--threshold",
        type=float,
        default=None,
        help="relative error that flags an op (default 1e-2 for float16, 5e-2 for bfloat16)",
    )
    p.add_argument("--no-plot", action="store_true", help="write the CSV only")
    p.add_argument("--seed", type=int, default=1, help="seed of the random inputs")
    p.set_defaults(func=run)


def run(args) -> int:
    """Compare, print the summary, write accuracy.csv and accuracy.png."""
    from tvmamp import debugging, models

    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    log(f"[compare] loading {args.model} ...")
    mod, params = load_model_arg(args)
    inputs = models.example_inputs(mod, seed=args.seed)
    log(f"[compare] building and running fp32 and {args.level} instrumented builds ...")
    report = debugging.compare_accuracy(
        mod,
        inputs,
        params=params,
        output_path=args.output,
        threshold=args.threshold,
        plot=not args.no_plot,
        **build_kwargs(args),
    )
    print(report.summary())
    return 0
