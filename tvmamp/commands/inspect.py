"""``tvmamp inspect``: build a model and show, kernel by kernel, what runs on tensor cores."""

from __future__ import annotations

import argparse
import sys
import time

from .common import add_build_options, add_shape_option, build_kwargs, load_model_arg


def register(subparsers) -> None:
    """Add the ``inspect`` parser."""
    p = subparsers.add_parser(
        "inspect",
        help="show the kernels of a compiled model and their tensor-core instructions",
        description="Convert MODEL to mixed precision, compile it, print the AMP report and, for "
        "CUDA targets, each kernel's tensor-core instructions (mma.sync / wmma.mma.sync with "
        "their operand and accumulator types), ldmatrix and cp.async use. No GPU is needed.",
        epilog="examples:\n  tvmamp inspect simplenet --level O2 --target cuda -arch=sm_80 --ptx\n"
        "  tvmamp inspect convnet --level O2 --target nvidia/a100 --dtype bfloat16 "
        "--dump kernels.ptx --ptx",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_build_options(p)
    add_shape_option(p)
    p.add_argument(
        "-arch",
        "--arch",
        default=None,
        help="CUDA arch such as sm_80, appended to --target (so '--target cuda -arch=sm_80' works)",
    )
    p.add_argument(
        "--ptx",
        action="store_true",
        help="read the instructions from PTX compiled by nvcc (default: the CUDA source)",
    )
    p.add_argument("--dump", default=None, help="also write the CUDA source (or PTX) to this file")
    p.set_defaults(func=run)


def run(args) -> int:
    """Build, then print the AMP report and the per-kernel tensor-core table."""
    from tvmamp.driver import build
    from tvmamp.targets import resolve_target

    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    kwargs = build_kwargs(args)
    if args.arch:
        kwargs["target"] = f"{args.target} -arch={args.arch}"
    entry = resolve_target(kwargs["target"])[1]
    emits_ptx = "ptx" in entry.source_formats  # the targets whose kernels have tensor cores
    if args.ptx and not emits_ptx:
        raise ValueError(f"tvmamp inspect: --ptx needs a CUDA target, got {entry.name!r}")
    log(f"[inspect] loading {args.model} ...")
    mod, params = load_model_arg(args)
    log(f"[inspect] converting at {args.level} and compiling for {kwargs['target']} ...")
    start = time.perf_counter()
    exe = build(mod, params=params, **kwargs)
    log(f"[inspect] built in {time.perf_counter() - start:.1f} s")
    print(exe.stats.summary())
    if not emits_ptx:
        return 0
    if args.ptx:
        log("[inspect] compiling the CUDA source to PTX with nvcc ...")
    source = exe.get_source("ptx" if args.ptx else "cuda")
    if args.dump:
        with open(args.dump, "w") as f:
            f.write(source)
        log(f"[inspect] wrote {args.dump}")
    print(kernel_table(source, exe.policy.low_dtype))
    return 0


def kernel_table(source: str, low_dtype: str) -> str:
    """The per-kernel table and a closing line counting GEMM kernels on tensor cores."""
    from tvmamp.targets.ptx import gemm_kernels_without_tensor_cores, kernel_reports

    reports = kernel_reports(source)
    lines = [f"{len(reports)} kernels (tensor-core instruction [data movement]):"]
    lines += [f"  {report.summary()}" for report in reports]
    gemms = [r.name for r in reports if r.is_gemm]
    missing = gemm_kernels_without_tensor_cores(source, low_dtype)
    lines.append(
        f"{len(gemms) - len(missing)} of {len(gemms)} matmul/conv kernels use {low_dtype} tensor "
        "cores with float32 accumulation" + (f"; not: {', '.join(missing)}" if missing else "")
    )
    return "\n".join(lines)
