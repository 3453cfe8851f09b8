"""``tvmamp compile``: build a model with AMP and export a deployable shared library."""

from __future__ import annotations

import argparse
import os
import sys
import time

from .common import add_build_options, add_input_options, build_kwargs, load_model_arg

_EPILOG = """\
MODEL is one of:
  a built-in model       simplenet, convnet, transformer
  a suite model          resnet18, mobilenet_v2, transformer_encoder, onnx_cnn (random weights)
  an ONNX file           model.onnx        (--input-shape for symbolic dimensions)
  an exported program    model.pt2         (torch.export.save)
  a TorchScript file     model.pt          (needs --input-shape; weights become constants)
  a Relax module         model.json        (tvm.ir.save_json)
  a Python factory       pkg.mod:function or file.py:function, returning a Relax module,
                         (module, params), a torch.nn.Module (with --input-shape),
                         (nn.Module, example_inputs) or an onnx.ModelProto

examples:
  tvmamp compile model.onnx --level O2 --dtype bfloat16 -o model.so
  tvmamp compile resnet18 --input-shape 1,3,224,224 --level O1 -o resnet18.so
  tvmamp compile model.onnx --input-shape image=4,3,224,224 --tuning-log logs/ -o model.so
  tvmamp compile transformer --level auto-search --inputs calib.npz --budget 5e-3 -o m.so
"""


def register(subparsers) -> None:
    """Add the ``compile`` parser."""
    p = subparsers.add_parser(
        "compile",
        help="compile a model (ONNX, PyTorch, Relax) with AMP to a .so",
        description="Import MODEL, convert it to mixed precision, compile it and export a shared "
        "library that tvm.runtime.load_module loads (run it with 'tvmamp run').",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_build_options(p)
    add_input_options(p)
    p.add_argument(
        "--tuning-log-override",
        action="store_true",
        help="apply a tuning log made for another target, level or dtype anyway",
    )
    p.add_argument(
        "--plan",
        default=None,
        help="precision plan (.json) from 'tvmamp search'; sets the level, dtype and "
        "every node's dtype",
    )
    p.add_argument(
        "--inputs",
        default=None,
        help="with --level auto-search: .npz of calibration data (as for 'tvmamp search')",
    )
    p.add_argument(
        "--budget", type=float, default=5e-3, help="with --level auto-search (default 5e-3)"
    )
    p.add_argument(
        "--metric", default="output", choices=["output", "top1"], help="with --level auto-search"
    )
    p.set_defaults(level=None)
    p.add_argument("-o", "--output", required=True, help="output .so path")
    p.set_defaults(func=run)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _check_output(path: str) -> None:
    """Refuse an output path that cannot be written before the (long) compile, not after."""
    if not path or path.endswith(os.sep) or os.path.isdir(path):
        raise ValueError(
            f"tvmamp compile: -o {path!r} names no file (give a library path such as model.so)"
        )
    if not path.endswith(".so"):
        # TVM's .tar route takes no linker options (the CPU guard's), and others need a linker
        # of their own: both failed after the compile
        raise ValueError(f"tvmamp compile: -o {path!r} must end in .so (a shared library)")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(f"tvmamp compile: the folder of -o {path!r} does not exist: {folder}")
    if not os.access(folder, os.W_OK):
        raise ValueError(f"tvmamp compile: the folder of -o {path!r} is not writable: {folder}")


def run(args) -> int:
    """Load, convert, compile and export, reporting each step and its time."""
    from tvmamp.conversion import convert
    from tvmamp.driver import compile_with_log, resolve_plan

    _check_output(args.output)
    start = time.perf_counter()
    _log(f"[compile 1/4] loading and importing {args.model} ...")
    mod, params = load_model_arg(args)
    _log(
        f"[compile 1/4] imported in {time.perf_counter() - start:.1f} s ({_describe(mod, params)})"
    )
    kwargs = build_kwargs(args)
    resolved = resolve_plan(
        mod, kwargs["level"], args.dtype, target=args.target, params=params, **_plan_options(args)
    )
    kwargs.update(level=resolved.level, dtype=resolved.dtype, node_dtypes=resolved.node_dtypes)
    _log(f"[compile 2/4] converting to mixed precision at {kwargs['level']} ...")
    converted = convert(mod, params=params, **kwargs)
    _log(f"[compile 3/4] compiling for {converted.target.kind.name} (the longest step) ...")
    step = time.perf_counter()
    exe = compile_with_log(converted, args.tuning_log, args.tuning_log_override)
    for note in exe.notes:
        _log(f"[compile] tuning log: {note}")
    _log(f"[compile 3/4] compiled in {time.perf_counter() - step:.1f} s")
    _log(f"[compile 4/4] exporting {args.output} ...")
    exe.export_library(args.output)
    print(exe.stats.summary())
    print(f"wrote {args.output} ({_signature(exe)}) in {time.perf_counter() - start:.1f} s")
    return 0


def _plan_options(args) -> dict:
    """``plan`` from --plan, or ``calib_inputs`` and ``budget`` for --level auto-search."""
    from tvmamp.driver import AUTO_SEARCH
    from tvmamp.search import ErrorBudget, PrecisionPlan

    if args.level != AUTO_SEARCH:
        if args.inputs is not None:
            raise ValueError(f"--inputs is only used with --level {AUTO_SEARCH}")
        return {"plan": PrecisionPlan.load(args.plan) if args.plan is not None else None}
    if args.plan is not None or args.inputs is None:
        raise ValueError(f"--level {AUTO_SEARCH} needs --inputs calib.npz and no --plan")
    from .search import load_samples

    _log(f"[compile 1/4] searching a precision plan (budget {args.budget:g}, {args.metric}) ...")
    budget = ErrorBudget(args.budget, args.metric)
    return {"calib_inputs": load_samples(args.inputs), "budget": budget}


def _describe(mod, params) -> str:
    main = mod["main"] if "main" in mod else None
    n_inputs = len(main.params) - len(params or {}) if main is not None else 0
    return f"{n_inputs} input(s), {len(params or {})} params"


def _signature(exe) -> str:
    """``main(image: float32[batchx3x16x16])``: symbolic dimensions by name."""
    from tvm import relax

    from tvmamp.tensors import dim_texts, type_dtype

    shown = []
    for p in exe.mod["main"].params:
        shape = getattr(p.ty, "shape", None)
        if isinstance(shape, relax.ShapeExpr):
            dims = "x".join(dim_texts(shape.values))
        else:
            dims = "dynamic"  # not even the rank is known
        shown.append(f"{p.name}: {type_dtype(p.ty)}[{dims}]")
    return "main(" + ", ".join(shown) + ")"
