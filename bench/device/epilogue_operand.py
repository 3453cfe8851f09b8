"""The steps of test_an_operand_the_epilogue_also_reads[(2, 5, 5)], timed one by one.

On the Emerald Rapids host of 2026-11-28 the test ran on its xdist worker from 15 % to 54 % of
a 150 s run under ``--timeout 100``, the longest test by far (the next took 18 %), and the run
was cut before pytest printed why. Built here for ``emeraldrapids`` it compiles to the same TIR
as with AMX and avx512_fp16 masked (the assembly differs by ``vmovw`` loads) and passes in 3 s.
This script tells apart:

- a slow step (``export``, ``build``, ``first call``: the worker's first torch.export, the
  first VM call that links the library) from a hang (the stacks faulthandler dumps after
  ``--hang`` seconds);
- a wrong result (``err``, the worst element and its index) from a right one;
- whether a preceding AMX kernel run in the same process (``--amx-first``: the worker had just
  run ``test_a_blockless_kernel_beside_packed_weights_builds[amx]``) changes either.

Usage: ``python3 -P bench/device/epilogue_operand.py [--amx-first] [--hang 25]``
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import sys
import time

import numpy as np


def _step(name: str, start: float) -> float:
    now = time.perf_counter()
    print(f"{name}: {now - start:.2f} s", flush=True)
    return now


def _amx_kernel() -> None:
    """The AMX GEMM the worker ran just before (x @ W on sapphirerapids, two cores)."""
    from tvm import relax

    import tvmamp

    rng = np.random.default_rng(0)
    weight = rng.standard_normal((128, 64)).astype("float32")
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((64, 128), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(bb.emit(relax.op.matmul(x, relax.const(weight))))
        bb.emit_func_output(out)
    exe = tvmamp.build(bb.get(), "O2", "llvm -mcpu=sapphirerapids -num-cores=2", dtype="bfloat16")
    xs = rng.standard_normal((64, 128)).astype("float32")
    try:
        got = np.asarray(exe(xs))
    except RuntimeError as err:  # the CPU feature guard, on a host without AMX
        print("amx kernel not run:", str(err).splitlines()[0], flush=True)
        return
    ref = xs @ weight
    print("amx kernel err", float(np.abs(got - ref).max() / np.abs(ref).max()), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--amx-first", action="store_true")
    parser.add_argument("--hang", type=float, default=25.0, help="dump stacks after this long")
    args = parser.parse_args()
    faulthandler.dump_traceback_later(args.hang, repeat=True, file=sys.stderr)
    t = time.perf_counter()
    import torch

    import tvmamp
    from tvmamp.targets.llvm import host_cpu, make_target

    t = _step("import", t)
    print("torch", torch.__version__, "threads", torch.get_num_threads(), flush=True)
    print("TVM_NUM_THREADS", os.environ.get("TVM_NUM_THREADS"), "host", host_cpu(), flush=True)
    print("target", make_target({"num-cores": 1}), flush=True)
    if args.amx_first:
        _amx_kernel()
        t = _step("amx kernel", t)

    class Residual(torch.nn.Module):
        def forward(self, x):
            n = x.shape[-1]
            return torch.baddbmm(x[:, :, :n], x, x.transpose(1, 2)[:, :, :n])

    torch.manual_seed(0)
    model, x = Residual().eval(), torch.randn(2, 5, 5)
    mod, params = tvmamp.from_torch(model, (x,))
    t = _step("export", t)
    print(mod.script(), flush=True)
    exe = tvmamp.build(mod, "O2", "llvm -num-cores=1", params=params)
    t = _step("build", t)
    print(exe.vm_exec.as_text().split("\n\n")[0], flush=True)
    out = exe(x.numpy())
    t = _step("first call", t)
    out = exe(x.numpy())
    t = _step("second call", t)
    with torch.no_grad():
        ref = model(x).numpy()
    out = np.asarray(out)
    diff = np.abs(out - ref)
    worst = np.unravel_index(np.argmax(diff), diff.shape)
    print("err", float(diff.max() / np.abs(ref).max()), "worst", worst, out[worst], ref[worst])
    close = np.allclose(out, ref, rtol=2e-2, atol=2e-2 * np.abs(ref).max())
    print("nan", int(np.isnan(out).sum()), "allclose", bool(close), flush=True)
    faulthandler.cancel_dump_traceback_later()


if __name__ == "__main__":
    main()
