"""``tvmamp run``: load an exported .so and run it on .npy / .npz inputs."""

from __future__ import annotations

import argparse
import os
import sys
import time

import ml_dtypes
import numpy as np

from tvmamp.messages import last_line

from .common import count, read_arrays


def register(subparsers) -> None:
    """Add the ``run`` parser."""
    p = subparsers.add_parser(
        "run",
        help="run an exported model on .npy/.npz inputs",
        description="Load a .so written by 'tvmamp compile' with tvm.runtime.load_module and run "
        "main on the given inputs (only the TVM runtime is needed).",
        epilog="examples:\n  tvmamp run model.so --inputs x.npy\n"
        "  tvmamp run model.so --inputs a.npy b.npy -o out.npz\n"
        "  tvmamp run model.so --inputs batch.npz --repeat 20",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("library", help="the .so from tvmamp compile")
    p.add_argument(
        "--inputs",
        nargs="+",
        required=True,
        help=".npy files (one per input) or .npz files (their arrays in stored order), in the "
        "order of main's inputs",
    )
    p.add_argument("-o", "--output", default=None, help="save the output(s) to this .npy/.npz")
    p.add_argument(
        "--repeat", type=count(0), default=0, help="also time N runs and print the median"
    )
    p.set_defaults(func=run)


def load_inputs(paths) -> list[np.ndarray]:
    """Arrays from .npy files and .npz archives (each archive's arrays in stored order). numpy
    stores a bfloat16 array (``ml_dtypes``) as 2-byte void values: those are read as bfloat16."""
    arrays = []
    for path in paths:
        if not path.endswith((".npy", ".npz")):
            raise ValueError(f"tvmamp run: input {path!r} is not a .npy or .npz file")
        arrays += read_arrays(path, "tvmamp run")
    return [a.view(ml_dtypes.bfloat16) if a.dtype == np.dtype("V2") else a for a in arrays]


def _parameter_names(vm) -> list[str]:
    """The names of the library's ``main`` parameters."""
    module = vm.module
    arity = module["get_function_arity"]("main")
    return [module["get_function_param_name"]("main", i) for i in range(arity)]


def _call_main(vm, inputs, source: str):
    """``main(*inputs)``; a wrong number of inputs, or an input of another dtype or shape than
    the library's, raises a ValueError naming main's parameters (TVM's own check does not)."""
    names = _parameter_names(vm)
    if len(inputs) != len(names):
        raise ValueError(
            f"tvmamp run: the library's main takes {len(names)} inputs ({', '.join(names)}); "
            f"{source} gave {len(inputs)}"
        )
    try:
        return vm["main"](*inputs)
    except Exception as err:  # TVM's argument checks raise its own error types
        text = last_line(err)
        given = ", ".join(f"{x.dtype}{list(x.shape)}" for x in inputs)
        raise ValueError(
            f"tvmamp run: main({', '.join(names)}) failed on the inputs {given}: {text}"
        ) from err


def run(args) -> int:
    """Run the library and print (or save) the outputs."""
    import tvm

    from tvmamp.executable import AlignedVirtualMachine, to_numpy
    from tvmamp.targets.cpu_guard import check_library

    if not os.path.isfile(args.library):
        raise FileNotFoundError(f"tvmamp run: no such file {args.library!r}")
    if args.output and not args.output.endswith((".npy", ".npz")):
        raise ValueError(f"tvmamp run: -o {args.output!r} must end in .npy (one output) or .npz")
    arrays = load_inputs(args.inputs)
    print(f"[run] loading {args.library} ...", file=sys.stderr, flush=True)
    try:
        lib = tvm.runtime.load_module(args.library)
    except Exception as err:  # TVM raises its own error types for a file dlopen refuses
        raise ValueError(
            f"tvmamp run: cannot load {args.library!r} as a library: {last_line(err)}"
        ) from err
    check_library(lib)  # the CPU features it was compiled for, before any kernel runs
    vm = AlignedVirtualMachine(lib, tvm.cpu())
    inputs = [tvm.runtime.tensor(a, tvm.cpu()) for a in arrays]  # aligned copies
    start = time.perf_counter()
    outputs = to_numpy(_call_main(vm, inputs, f"--inputs {' '.join(args.inputs)}"))
    print(f"[run] ran in {time.perf_counter() - start:.3f} s", file=sys.stderr, flush=True)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    for i, out in enumerate(outputs):
        print(f"output {i}: shape {out.shape} dtype {out.dtype}{_summary(out)}")
    if args.repeat > 0:
        timer = vm.time_evaluator("main", tvm.cpu(), number=1, repeat=args.repeat)
        median_ms = np.median(timer(*inputs).results) * 1e3
        print(f"median latency over {args.repeat} runs: {median_ms:.3f} ms")
    if args.output:
        _save(args.output, outputs)
    return 0


def _summary(out: np.ndarray) -> str:
    """Minimum, maximum and mean of a non-empty output."""
    if out.size == 0:
        return " (empty)"
    values = out.astype("float64") if out.dtype == ml_dtypes.bfloat16 else out
    return f" min {values.min():.6g} max {values.max():.6g} mean {values.mean():.6g}"


def _save(path, outputs) -> None:
    """Write ``outputs`` to ``path`` (``.npy`` or ``.npz``, checked before the run): an ``.npz``
    of them all, or one ``.npy``, which cannot hold several outputs (the others were lost).
    numpy has no bfloat16 of its own: a bfloat16 output is written as float32 (exactly)."""
    low = [i for i, out in enumerate(outputs) if out.dtype == ml_dtypes.bfloat16]
    outputs = [out.astype("float32") if i in low else out for i, out in enumerate(outputs)]
    if low:
        print(f"output(s) {', '.join(map(str, low))}: bfloat16 written as float32")
    if path.endswith(".npz"):
        np.savez(path, *outputs)
    elif len(outputs) > 1:
        raise ValueError(
            f"tvmamp run: the model has {len(outputs)} outputs; -o {path!r} holds one, give a "
            ".npz path to write them all"
        )
    else:
        np.save(path, outputs[0])
    print(f"wrote {path}")
