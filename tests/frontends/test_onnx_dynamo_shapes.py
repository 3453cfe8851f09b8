"""tvmamp.from_onnx on the shape arithmetic of torch.onnx.export(dynamo=True) with dynamic
shapes: symbolic sizes reshaped to one element."""

import io

import numpy as np
import pytest

import tvmamp

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from onnx import TensorProto as TP  # noqa: E402
from onnx import helper as h  # noqa: E402
from onnx import numpy_helper as nh  # noqa: E402
from onnx_graphs import onnx_model, run_ort  # noqa: E402

TARGET = "llvm -num-cores=1"


def _ints(name, values):
    return nh.from_array(np.array(values, np.int64), name)


def _size_reshaped(op):
    """``x.view(b * s, 3)`` as the dynamo exporter writes it: the sizes as scalars
    (``Squeeze`` of ``Shape`` slices), their product made one element by ``op``."""
    one = h.make_node("Reshape", ["bs", "minus_one"], ["bs1"])
    if op == "Unsqueeze":
        one = h.make_node("Unsqueeze", ["bs", "zero_axis"], ["bs1"])
    nodes = [
        h.make_node("Shape", ["x"], ["s0"], start=0, end=1),
        h.make_node("Squeeze", ["s0"], ["b"]),
        h.make_node("Shape", ["x"], ["s1"], start=1, end=2),
        h.make_node("Squeeze", ["s1"], ["s"]),
        h.make_node("Mul", ["b", "s"], ["bs"]),
        one,
        h.make_node("Concat", ["bs1", "three"], ["shape"], axis=0),
        h.make_node("Reshape", ["x", "shape"], ["y"]),
    ]
    inits = [_ints("minus_one", [-1]), _ints("zero_axis", [0]), _ints("three", [3])]
    return onnx_model(
        nodes,
        [h.make_tensor_value_info("x", TP.FLOAT, ["batch", "seq", 3])],
        [h.make_tensor_value_info("y", TP.FLOAT, ["n", 3])],
        inits,
        opset=20,
    )


@pytest.mark.parametrize("op", ["Reshape", "Unsqueeze"])
def test_a_symbolic_size_reshaped_to_one_element_is_a_shape(rng, op):
    model = _size_reshaped(op)
    mod, params = tvmamp.from_onnx(model)
    assert "batch * seq" in mod.script()
    exe = tvmamp.build(mod, "O0", TARGET, params=params)
    for shape in [(2, 5, 3), (3, 4, 3)]:
        x = rng.standard_normal(shape).astype(np.float32)
        np.testing.assert_allclose(np.asarray(exe(x)), run_ort(model, x=x), rtol=0, atol=0)


def test_dynamo_export_of_multihead_attention_with_dynamic_shapes(rng):
    """nn.MultiheadAttention exported by the dynamo exporter over a dynamic batch and
    sequence: its ``batch * heads`` sizes are reshaped scalars."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("onnxscript")
    torch.manual_seed(0)
    attention = torch.nn.MultiheadAttention(16, 4, batch_first=True).eval()

    class SelfAttention(torch.nn.Module):
        def forward(self, x):
            return attention(x, x, x, need_weights=False)[0]

    batch, seq = torch.export.Dim("batch", max=64), torch.export.Dim("seq", max=256)
    buffer = io.BytesIO()
    x = torch.randn(2, 5, 16)
    program = torch.onnx.export(
        SelfAttention(), (x,), dynamo=True, dynamic_shapes=({0: batch, 1: seq},), verbose=False
    )
    program.save(buffer)
    model = onnx.load_from_string(buffer.getvalue())
    name = model.graph.input[0].name
    mod, params = tvmamp.from_onnx(model)
    exe = tvmamp.build(mod, "O0", TARGET, params=params)
    for shape in [(2, 5, 16), (3, 7, 16)]:
        x = rng.standard_normal(shape).astype(np.float32)
        ref = run_ort(model, **{name: x})
        np.testing.assert_allclose(np.asarray(exe(x)), ref, rtol=1e-5, atol=1e-5)
