"""``tvmamp run``: load an exported .so and run it on .npy inputs."""

from __future__ import annotations

import os

import numpy as np


def register(subparsers) -> None:
    """Add the ``run`` parser."""
    p = subparsers.add_parser(
        "run",
        help="run an exported model on .npy inputs",
        description="Load a .so written by 'tvmamp compile' with "
        "tvm.runtime.load_module and run main on the given inputs.",
    )
    p.add_argument("library", help="the .so from tvmamp compile")
    p.add_argument("--inputs", nargs="+", required=True, help=".npy files, one per input")
    p.add_argument("-o", "--output", default=None, help="save the output(s) to this .npy/.npz")
    p.set_defaults(func=run)


def run(args) -> int:
    """Run the library and print (or save) the outputs."""
    import tvm
    from tvm import relax

    from tvmamp.executable import to_numpy

    for path in [args.library, *args.inputs]:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no such file {path!r}")
    vm = relax.VirtualMachine(tvm.runtime.load_module(args.library), tvm.cpu())
    inputs = [tvm.runtime.tensor(np.load(p)) for p in args.inputs]
    outputs = to_numpy(vm["main"](*inputs))
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    for i, out in enumerate(outputs):
        print(
            f"output {i}: shape {out.shape} dtype {out.dtype} "
            f"min {out.min():.6g} max {out.max():.6g} mean {out.mean():.6g}"
        )
    if args.output:
        if args.output.endswith(".npz"):
            np.savez(args.output, *outputs)
        else:
            np.save(args.output, outputs[0])
        print(f"wrote {args.output}")
    return 0
