"""FoldPadIntoConv, and the ONNX import of padding="same" convs and constant pads it serves."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import relax as R

import tvmamp
from tvmamp.relay_passes.pad_into_conv import FoldPadIntoConv

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
from onnx import TensorProto as TP  # noqa: E402
from onnx import helper as h  # noqa: E402
from onnx import numpy_helper as nh  # noqa: E402
from onnx_graphs import onnx_model, run_ort  # noqa: E402


def test_a_zero_pad_of_the_spatial_axes_becomes_the_conv_padding():
    @tvm.script.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor(("n", 4, 9, 8), "float32"), w: R.Tensor((6, 4, 3, 3), "float32")):
            with R.dataflow():
                p = R.nn.pad(x, [0, 0, 0, 0, 1, 2, 0, 3])
                y = R.nn.conv2d(p, w, strides=2, padding=[1, 1, 0, 0])
                R.output(y)
            return y

    @tvm.script.ir_module
    class After:
        @R.function
        def main(x: R.Tensor(("n", 4, 9, 8), "float32"), w: R.Tensor((6, 4, 3, 3), "float32")):
            with R.dataflow():
                y = R.nn.conv2d(x, w, strides=2, padding=[2, 1, 2, 3])
                R.output(y)
            return y

    after = relax.transform.DeadCodeElimination()(FoldPadIntoConv()(Before))
    tvm.ir.assert_structural_equal(after, After)


@pytest.mark.parametrize(
    ("widths", "value"),
    [
        ([0, 0, 0, 0, 1, 1, 1, 1], 1.0),  # not zeros
        ([0, 0, 1, 1, 1, 1, 1, 1], 0.0),  # pads the channels
        ([0, 0, 0, 0, -1, 1, 1, 1], 0.0),  # crops
    ],
    ids=["value", "channels", "negative"],
)
def test_other_pads_are_left_alone(widths, value):
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 4, 9, 8), "float32"))
    w = relax.Var("w", relax.TensorType((6, 4 + sum(widths[2:4]), 3, 3), "float32"))
    with bb.function("main", [x, w]):
        with bb.dataflow():
            p = bb.emit(relax.op.nn.pad(x, widths, pad_value=value))
            y = bb.emit_output(relax.op.nn.conv2d(p, w))
        bb.emit_func_output(y)
    mod = bb.get()
    tvm.ir.assert_structural_equal(FoldPadIntoConv()(mod), mod)


def _conv_model(auto_pad: str | None, pads=None, stride=2):
    """x[batch, 3, 11, 10] -> (an explicit Pad) -> Conv 3x3 (or 4x4) -> y."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((5, 3, 3, 4)).astype("float32")
    nodes, inits = [], [nh.from_array(w, "w")]
    source = "x"
    if pads is not None:
        inits.append(nh.from_array(np.array(pads, np.int64), "pads"))
        nodes.append(h.make_node("Pad", ["x", "pads"], ["padded"], mode="constant"))
        source = "padded"
    options = {"auto_pad": auto_pad} if auto_pad else {}
    nodes.append(h.make_node("Conv", [source, "w"], ["y"], strides=[stride, stride], **options))
    return onnx_model(
        nodes,
        [h.make_tensor_value_info("x", TP.FLOAT, ["batch", 3, 11, 10])],
        [h.make_tensor_value_info("y", TP.FLOAT, ["batch", 5, "oh", "ow"])],
        inits,
    )


@pytest.mark.parametrize(
    ("auto_pad", "pads"),
    [("SAME_UPPER", None), ("SAME_LOWER", None), (None, [0, 0, 2, 1, 0, 0, 1, 2])],
    ids=["same upper", "same lower", "explicit pad"],
)
def test_same_and_padded_convs_import_without_a_pad_kernel(auto_pad, pads, rng):
    """A Conv with auto_pad "SAME", or after a constant Pad, reads its input unpadded (the
    pad is the conv's own), and matches onnxruntime at two batch sizes."""
    model = _conv_model(auto_pad, pads)
    mod, params = tvmamp.from_onnx(model)
    text = relax.transform.DeadCodeElimination()(FoldPadIntoConv()(mod)).script()
    assert "R.call_tir" not in text and "R.nn.pad" not in text, text  # no pad, TE or Relax
    exe = tvmamp.build(mod, "O0", "llvm -num-cores=1", params=params)
    for batch in (1, 3):
        x = rng.standard_normal((batch, 3, 11, 10)).astype("float32")
        np.testing.assert_allclose(np.asarray(exe(x)), run_ort(model, x=x), rtol=1e-5, atol=1e-5)
