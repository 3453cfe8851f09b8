"""``tvmamp tune``: auto-schedule the AMP kernels of a model and write a tuning log."""

from __future__ import annotations

import sys

from .common import add_build_options, add_shape_option, build_kwargs, count, load_model_arg


def register(subparsers) -> None:
    """Add the ``tune`` parser."""
    p = subparsers.add_parser(
        "tune",
        help="tune a model's kernels (meta_schedule, XGBoost) into a tuning log",
        description="Convert MODEL to mixed precision, lower it as tvmamp compile does and tune "
        "its kernels with meta_schedule's XGBoost cost model. Rerunning the same command "
        "continues a killed or shorter run. Use the log with tvmamp compile --tuning-log.",
    )
    add_build_options(p)
    add_shape_option(p)
    p.set_defaults(level="O2")
    p.add_argument("--work-dir", default="logs/", help="tuning log directory (default logs/)")
    p.add_argument("--trials", type=count(1), default=512, help="measured candidates in total")
    p.add_argument("--rpc-tracker", default=None, help="host:port of a TVM RPC tracker")
    p.add_argument("--rpc-key", default=None, help="device key registered with the tracker")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.set_defaults(func=run)


def run(args) -> int:
    """Tune and print the per-kernel table."""
    from tvmamp.tuning import RPC, tune

    if (args.rpc_tracker is None) != (args.rpc_key is None):
        raise ValueError("--rpc-tracker and --rpc-key go together (give both or neither)")
    rpc = RPC(args.rpc_tracker, args.rpc_key) if args.rpc_tracker else None
    print(f"[tune] loading {args.model} ...", file=sys.stderr, flush=True)
    mod, params = load_model_arg(args)
    result = tune(
        mod,
        work_dir=args.work_dir,
        trials=args.trials,
        params=params,
        rpc=rpc,
        progress=not args.no_progress,
        **build_kwargs(args),
    )
    print(result.summary())
    verb = "measured" if result.measured else "built (not measured)"
    print(
        f"{verb} {result.new_trials} new candidates in {result.seconds:.1f} s; "
        f"log in {result.work_dir}"
    )
    return 0
