"""Conv1dAsConv2d: 1-D convolutions as height-1 conv2d (IR, numerics, what is left alone)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import tvm
from tolerances import assert_close, tolerance
from tvm import relax
from tvm.script import relax as R
from tvm.script import tirx as T

import tvmamp
from tvmamp.relay_passes.conv1d_as_conv2d import Conv1dAsConv2d


def test_conv1d_becomes_a_height_one_conv2d():
    @tvm.script.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((2, 4, 20), "float32"), w: R.Tensor((6, 2, 3), "float32")):
            with R.dataflow():
                y = R.nn.conv1d(x, w, strides=[2], padding=[1, 2], dilation=[2], groups=2)
                R.output(y)
            return y

    @tvm.script.ir_module
    class After:
        @R.function
        def main(x: R.Tensor((2, 4, 20), "float32"), w: R.Tensor((6, 2, 3), "float32")):
            with R.dataflow():
                lv = R.nn.conv2d(
                    R.reshape(x, (2, 4, 1, 20)),
                    R.reshape(w, (6, 2, 1, 3)),
                    strides=[1, 2],
                    padding=[0, 1, 0, 2],
                    dilation=[1, 2],
                    groups=2,
                )
                y = R.reshape(lv, (2, 6, 10))
                R.output(y)
            return y

    tvm.ir.assert_structural_equal(Conv1dAsConv2d()(Before), After)


def test_symbolic_batch_becomes_a_height_one_conv2d():
    """A dynamic batch axis: TVM's conv1d loops ran 150x slower than the static build."""

    @tvm.script.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor(("n", 4, 20), "float32"), w: R.Tensor((6, 4, 3), "float32")):
            with R.dataflow():
                y = R.nn.conv1d(x, w, padding=[1, 1])
                R.output(y)
            return y

    @tvm.script.ir_module
    class After:
        @R.function
        def main(x: R.Tensor(("n", 4, 20), "float32"), w: R.Tensor((6, 4, 3), "float32")):
            n = T.int64()
            with R.dataflow():
                lv = R.nn.conv2d(
                    R.reshape(x, (n, 4, 1, 20)), R.reshape(w, (6, 4, 1, 3)), padding=[0, 1, 0, 1]
                )
                y = R.reshape(lv, (n, 6, 20))
                R.output(y)
            return y

    tvm.ir.assert_structural_equal(Conv1dAsConv2d()(Before), After)


def test_dynamic_length_is_left_alone():
    @tvm.script.ir_module
    class Dynamic:
        @R.function
        def main(x: R.Tensor((1, 4, "n"), "float32"), w: R.Tensor((6, 4, 3), "float32")):
            with R.dataflow():
                y = R.nn.conv1d(x, w)
                R.output(y)
            return y

    tvm.ir.assert_structural_equal(Conv1dAsConv2d()(Dynamic), Dynamic)


# (channels in, out, kernel, stride, padding, dilation, groups, length)
CONVS = [
    (1, 16, 10, 5, 0, 1, 1, 401),  # a waveform front end
    (19, 24, 3, 2, 1, 1, 1, 97),
    (24, 24, 5, 1, 2, 1, 24, 50),  # depthwise
    (12, 20, 3, 1, 2, 2, 4, 33),  # grouped, dilated
]


@pytest.mark.parametrize("level", ["O0", "O2"])
@pytest.mark.parametrize("case", CONVS, ids=str)
def test_conv1d_matches_torch(case, level):
    cin, cout, k, s, p, d, g, length = case
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv1d(cin, cout, k, s, p, d, g), torch.nn.GELU()).eval()
    x = torch.randn((2, cin, length))
    with torch.no_grad():
        ref = model(x).numpy()
    mod, params = tvmamp.from_torch(model, (x,))
    exe = tvmamp.build(mod, level, "llvm", params=params)
    out = exe.vm["main"](tvm.runtime.tensor(x.numpy(), exe.device)).numpy()
    dtype = "float32" if level == "O0" else exe.policy.low_dtype
    assert_close(out, ref, **tolerance(dtype, np.abs(ref).max()), what=f"{case} {level}")


@pytest.mark.parametrize("level", ["O0", "O2"])
def test_conv1d_transpose_matches_torch(level):
    torch.manual_seed(0)
    model = torch.nn.ConvTranspose1d(10, 6, 4, stride=2, padding=1, output_padding=1).eval()
    x = torch.randn((1, 10, 37))
    with torch.no_grad():
        ref = model(x).numpy()
    mod, params = tvmamp.from_torch(model, (x,))
    exe = tvmamp.build(mod, level, "llvm", params=params)
    out = exe.vm["main"](tvm.runtime.tensor(x.numpy(), exe.device)).numpy()
    dtype = "float32" if level == "O0" else exe.policy.low_dtype
    assert_close(out, ref, **tolerance(dtype, np.abs(ref).max()), what=level)


@pytest.mark.parametrize("level", ["O0", "O2"])
@pytest.mark.parametrize("case", CONVS, ids=str)
def test_conv1d_over_a_symbolic_batch_matches_torch(case, level):
    """The same convs with a symbolic batch, built once and run at batches 1 and 3."""
    cin, cout, k, s, p, d, g, length = case
    torch.manual_seed(0)
    conv = torch.nn.Conv1d(cin, cout, k, s, p, d, g).eval()
    bb = relax.BlockBuilder()
    n = tvm.tirx.Var("n", "int64")
    x = relax.Var("x", relax.TensorType((n, cin, length), "float32"))
    weight, bias = (relax.const(t.detach().numpy()) for t in (conv.weight, conv.bias))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = relax.op.nn.conv1d(x, weight, s, p, d, g)
            y = bb.emit_output(relax.op.add(y, relax.op.reshape(bias, (1, cout, 1))))
        bb.emit_func_output(y)
    exe = tvmamp.build(bb.get(), level, "llvm")
    dtype = "float32" if level == "O0" else exe.policy.low_dtype
    for batch in (1, 3):
        data = torch.randn((batch, cin, length))
        with torch.no_grad():
            ref = conv(data).numpy()
        out = np.asarray(exe(data.numpy()))
        assert_close(out, ref, **tolerance(dtype, np.abs(ref).max()), what=f"{case} {batch}")


def test_conv1d_transpose_over_a_symbolic_batch_matches_torch():
    torch.manual_seed(0)
    conv = torch.nn.ConvTranspose1d(10, 6, 4, stride=2, padding=1, output_padding=1).eval()
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((tvm.tirx.Var("n", "int64"), 10, 37), "float32"))
    weight, bias = (relax.const(t.detach().numpy()) for t in (conv.weight, conv.bias))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = relax.op.nn.conv1d_transpose(x, weight, 2, 1, output_padding=1)
            y = bb.emit_output(relax.op.add(y, relax.op.reshape(bias, (1, 6, 1))))
        bb.emit_func_output(y)
    mod = bb.get()
    assert "conv1d_transpose" not in Conv1dAsConv2d()(mod).script()
    exe = tvmamp.build(mod, "O0", "llvm")
    for batch in (1, 3):
        data = torch.randn((batch, 10, 37))
        with torch.no_grad():
            ref = conv(data).numpy()
        assert_close(np.asarray(exe(data.numpy())), ref, **tolerance("float32", 1.0))
