"""``tvmamp compile``: build a model with AMP and export a deployable shared library."""

from __future__ import annotations

import sys
import time

from .common import add_build_options, build_kwargs


def register(subparsers) -> None:
    """Add the ``compile`` parser."""
    p = subparsers.add_parser(
        "compile",
        help="compile a model with AMP to a .so",
        description="Convert MODEL to mixed precision, compile it and "
        "export a shared library for tvm.runtime.load_module.",
    )
    add_build_options(p)
    p.add_argument("--tuning-log", default=None, help="tuning log directory from tvmamp tune")
    p.add_argument("-o", "--output", required=True, help="output .so path")
    p.set_defaults(func=run)


def run(args) -> int:
    """Compile and export."""
    from tvmamp.build import build
    from tvmamp.loading import load_model

    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    log(f"[compile] loading {args.model} ...")
    mod, params = load_model(args.model)
    log(f"[compile] converting at {args.level} and compiling for {args.target} ...")
    start = time.perf_counter()
    exe = build(mod, params=params, tuning_log=args.tuning_log, **build_kwargs(args))
    log(f"[compile] built in {time.perf_counter() - start:.1f} s")
    exe.export_library(args.output)
    print(exe.stats.summary())
    print(f"wrote {args.output}")
    return 0
