"""``tvmamp profile``: each kernel's time, share and achieved rate against the machine's peak."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from .common import add_build_options, add_input_options, build_kwargs, count, load_model_arg

_EPILOG = """\
MODEL is anything 'tvmamp compile' takes: a built-in model (simplenet, convnet, transformer,
overflow), a suite model (resnet18, mobilenet_v2, transformer_encoder, onnx_cnn), a .onnx,
.pt2, .pt or .json file, or module:function / file.py:function.

Each kernel is rated against the peak of its class: GFLOP/s against the fp32 FMA peak (times
the dtype's factor, e.g. 2x for bf16 with avx512_bf16) when its FLOPs per byte exceed the
machine's balance, GB/s against the copy bandwidth otherwise. Both peaks are measured once with
two small built kernels. Kernels below --threshold of their peak are marked '<'.

examples:
  tvmamp profile simplenet --level O2
  tvmamp profile resnet18 --level O0 --threads 2
  tvmamp profile model.onnx --input-shape 1,3,224,224 --level O2 --json > profile.json
"""


def register(subparsers) -> None:
    """Add the ``profile`` parser."""
    p = subparsers.add_parser(
        "profile",
        help="time each kernel and rate it against the machine's peak",
        description="Build MODEL, run it on random inputs and print every kernel, slowest "
        "first: time, share, calls, argument shapes and achieved GFLOP/s or GB/s against the "
        "machine's peak for its class (compute- or memory-bound).",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_build_options(p)
    add_input_options(p)
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="TVM runtime threads (default: TVM_NUM_THREADS, else every physical core)",
    )
    p.add_argument(
        "--rounds", type=count(1), default=3, help="instrumented calls (median; default 3)"
    )
    p.add_argument(
        "--threshold",
        type=float,
        default=0.10,
        help="flag kernels below this fraction of their peak (default 0.10)",
    )
    p.add_argument("--json", action="store_true", help="print the profile as JSON")
    p.set_defaults(func=run)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _check_args(args) -> None:
    """Fail on a bad level or thread count before the (long) load and build."""
    from tvmamp.policy import LEVELS

    if args.level not in LEVELS:
        raise ValueError(f"tvmamp profile: level {args.level!r} is not one of {', '.join(LEVELS)}")
    # TVM's thread pool aborts the process past a few thousand threads (--threads 100000)
    most = max(64, 4 * (os.cpu_count() or 1))
    if args.threads is not None and not 1 <= args.threads <= most:
        raise ValueError(
            f"tvmamp profile: --threads {args.threads} is not between 1 and {most} "
            f"(this machine has {os.cpu_count()} CPUs)"
        )
    from tvmamp.debugging.peaks import runs_on_host

    if not runs_on_host(args.target):
        raise ValueError(
            f"tvmamp profile: target {args.target!r} is not supported; kernels are timed on "
            "the host, so the target must be a CPU (llvm ...)"
        )


def _set_threads(threads: int | None) -> int:
    """Set the TVM runtime's thread count (it is fixed at the first parallel call)."""
    if threads is not None:
        os.environ["TVM_NUM_THREADS"] = str(threads)  # read when TVM starts its thread pool
    import tvm

    running = tvm.runtime.num_threads()
    if threads is not None and running != threads:
        raise RuntimeError(
            f"tvmamp profile: --threads {threads} cannot apply, the TVM runtime of this process "
            f"already runs {running} thread(s); run the command in a fresh process"
        )
    return running


def run(args) -> int:
    """Load, build with the kernels' costs recorded, measure the peaks, profile, print."""
    _check_args(args)
    threads = _set_threads(args.threads)
    from tvmamp import debugging, models
    from tvmamp.driver import build

    _log(f"[profile 1/4] loading {args.model} ...")
    mod, params = load_model_arg(args)
    inputs = models.example_inputs(mod)  # before the build: a symbolic input fails here
    _log(f"[profile 2/4] building at {args.level} for {args.target} (the longest step) ...")
    start = time.perf_counter()
    with debugging.kernel_cost_recording() as costs:
        exe = build(mod, params=params, tuning_log=args.tuning_log, **build_kwargs(args))
    _log(f"[profile 2/4] built in {time.perf_counter() - start:.1f} s")
    _log(f"[profile 3/4] measuring the machine's peaks ({threads} thread(s)) ...")
    peaks = debugging.measure_peaks(exe.target, threads)
    _log(f"[profile 4/4] timing every kernel over {args.rounds} call(s) ...")
    prof = debugging.profile(
        exe, inputs, rounds=args.rounds, costs=costs, peaks=peaks, threshold=args.threshold
    )
    if args.json:
        print(json.dumps(dict(prof.as_dict(), model=args.model, level=args.level), indent=1))
    else:
        print(f"{args.model} at {args.level}, target {exe.target.kind.name}")
        print(prof.table())
    return 0
