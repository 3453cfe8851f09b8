"""SlicesToSplit: a sequence sliced into many steps becomes one split (steps share a kernel)."""

from __future__ import annotations

import re

import numpy as np
import torch
import tvm
from tvm import relax

import tvmamp
from tvmamp.relay_passes.slices_to_split import SlicesToSplit


def _sliced(count: int, cover: bool = True) -> tvm.IRModule:
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((count, 2, 3), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            steps = [
                bb.emit(relax.op.strided_slice(x, [0], [t], [t + 1]))
                for t in range(count if cover else count - 1)
            ]
            total = steps[0]
            for step in steps[1:]:
                total = bb.emit(relax.op.add(relax.op.sigmoid(total), step))
            out = bb.emit_output(total)
        bb.emit_func_output(out)
    return bb.get()


def _expected(count: int) -> tvm.IRModule:
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((count, 2, 3), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            split = bb.emit(relax.op.split(x, list(range(1, count)), 0))
            steps = [bb.emit(relax.TupleGetItem(split, t)) for t in range(count)]
            total = steps[0]
            for step in steps[1:]:
                total = bb.emit(relax.op.add(relax.op.sigmoid(total), step))
            out = bb.emit_output(total)
        bb.emit_func_output(out)
    return bb.get()


def test_many_step_slices_become_one_split():
    tvm.ir.assert_structural_equal(SlicesToSplit()(_sliced(6)), _expected(6))


def test_few_slices_or_a_partial_cover_are_left_alone():
    for mod in (_sliced(4), _sliced(6, cover=False)):
        tvm.ir.assert_structural_equal(SlicesToSplit()(mod), mod)


def test_an_unrolled_gru_compiles_one_gate_kernel_and_matches_torch():
    """torch decomposes the GRU into T slices of the input projection: each was fused into its
    step's gate kernel, making T different kernels (a 50-step GRU built in 80 s)."""
    torch.manual_seed(0)
    gru = torch.nn.GRU(6, 8, batch_first=True).eval()
    x = torch.randn((2, 12, 6))
    with torch.no_grad():
        ref = gru(x)[0].numpy()
    mod, params = tvmamp.from_torch(torch.nn.Sequential(gru), (x,))
    exe = tvmamp.build(mod, "O0", "llvm", params=params)
    names = set(re.findall(r"@(\w+)", exe.vm_exec.as_text()))
    gates = [n for n in names if "sigmoid" in n]
    assert 1 <= len(gates) <= 3, sorted(names)  # the first step, the others, the last
    out = exe.vm["main"](tvm.runtime.tensor(x.numpy(), exe.device))
    out = out[0].numpy() if not hasattr(out, "numpy") else out.numpy()
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
