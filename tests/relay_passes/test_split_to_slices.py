"""SplitToSlices: splits read only by elementwise or layout ops become slices that fuse."""

from __future__ import annotations

import numpy as np
import torch
import tvm
from tvm import relax
from tvm.script import relax as R

import tvmamp
from tvmamp.relay_passes.split_to_slices import SplitToSlices


def test_gate_split_becomes_slices():
    @tvm.script.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((4, 12), "float32")):
            with R.dataflow():
                parts = R.split(x, indices_or_sections=[3, 9], axis=1)
                a = R.sigmoid(parts[0])
                b = R.tanh(parts[1])
                c = R.multiply(parts[2], R.const(2.0, "float32"))
                R.output(a, b, c)
            return (a, b, c)

    @tvm.script.ir_module
    class After:
        @R.function
        def main(x: R.Tensor((4, 12), "float32")):
            with R.dataflow():
                p0 = R.strided_slice(x, axes=[1], begin=[0], end=[3])
                a = R.sigmoid(p0)
                p1 = R.strided_slice(x, axes=[1], begin=[3], end=[9])
                b = R.tanh(p1)
                p2 = R.strided_slice(x, axes=[1], begin=[9], end=[12])
                c = R.multiply(p2, R.const(2.0, "float32"))
                R.output(a, b, c)
            return (a, b, c)

    tvm.ir.assert_structural_equal(SplitToSlices()(Before), After)


def test_a_part_read_by_a_matmul_keeps_the_split():
    @tvm.script.ir_module
    class QKV:
        @R.function
        def main(x: R.Tensor((4, 12), "float32"), w: R.Tensor((4, 5), "float32")):
            with R.dataflow():
                parts = R.split(x, indices_or_sections=3, axis=1)
                q = R.matmul(parts[0], w)
                k = R.sigmoid(parts[1])
                R.output(q, k)
            return (q, k)

    tvm.ir.assert_structural_equal(SplitToSlices()(QKV), QKV)


def test_heads_split_by_layout_ops_become_slices():
    """An ONNX export's ``q, k, v = split(qkv)`` read by the head split's reshapes and
    transposes: each part becomes a slice that joins its layout chain."""

    @tvm.script.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((2, 8, 12), "float32")):
            with R.dataflow():
                parts = R.split(x, indices_or_sections=3, axis=2)
                q = R.permute_dims(R.reshape(parts[0], (2, 8, 2, 2)), [0, 2, 1, 3])
                k = R.permute_dims(R.reshape(parts[1], (2, 8, 2, 2)), [0, 2, 3, 1])
                v = R.squeeze(R.reshape(parts[2], (2, 8, 1, 4)), [2])
                R.output(q, k, v)
            return (q, k, v)

    @tvm.script.ir_module
    class After:
        @R.function
        def main(x: R.Tensor((2, 8, 12), "float32")):
            with R.dataflow():
                p0 = R.strided_slice(x, axes=[2], begin=[0], end=[4])
                q = R.permute_dims(R.reshape(p0, (2, 8, 2, 2)), [0, 2, 1, 3])
                p1 = R.strided_slice(x, axes=[2], begin=[4], end=[8])
                k = R.permute_dims(R.reshape(p1, (2, 8, 2, 2)), [0, 2, 3, 1])
                p2 = R.strided_slice(x, axes=[2], begin=[8], end=[12])
                v = R.squeeze(R.reshape(p2, (2, 8, 1, 4)), [2])
                R.output(q, k, v)
            return (q, k, v)

    tvm.ir.assert_structural_equal(SplitToSlices()(Before), After)


def test_lstm_gates_fuse_and_match_torch():
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lstm = torch.nn.LSTM(12, 20, batch_first=True)

        def forward(self, x):
            return self.lstm(x)[0]

    torch.manual_seed(0)
    model = Net().eval()
    x = torch.randn((3, 7, 12))
    with torch.no_grad():
        ref = model(x).numpy()
    mod, params = tvmamp.from_torch(model, (x,))
    split = tvm.ir.Op.get("relax.split")
    calls = []
    relax.analysis.post_order_visit(
        SplitToSlices()(mod)["main"],
        lambda e: calls.append(e) if isinstance(e, relax.Call) and e.op == split else None,
    )
    assert not calls  # every gate split became slices
    exe = tvmamp.build(mod, "O0", "llvm", params=params)
    out = exe.vm["main"](tvm.runtime.tensor(x.numpy(), exe.device)).numpy()
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
