"""tvmamp.from_onnx on the shape arithmetic of exports with dynamic shapes: symbolic sizes
reshaped to one element and a ``-1`` next to a cache length (torch.onnx.export(dynamo=True)),
a slice from minus a size (the legacy exporter, as optimum runs it)."""

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


def _cache_heads():
    """``cat([past, new], 2).reshape(-1, past + seq, 16)``, the shape read off the concat (a
    GPT-2 or LLaMA with a key/value cache, exported with dynamic shapes)."""
    nodes = [
        h.make_node("Concat", ["past", "new"], ["kv"], axis=2),
        h.make_node("Shape", ["kv"], ["tail"], start=2, end=4),
        h.make_node("Concat", ["minus_one", "tail"], ["shape"], axis=0),
        h.make_node("Reshape", ["kv", "shape"], ["flat"]),
        h.make_node("Transpose", ["flat"], ["y"], perm=[0, 2, 1]),
    ]
    return onnx_model(
        nodes,
        [
            h.make_tensor_value_info("past", TP.FLOAT, ["batch", 4, "past_len", 16]),
            h.make_tensor_value_info("new", TP.FLOAT, ["batch", 4, "seq", 16]),
        ],
        [h.make_tensor_value_info("y", TP.FLOAT, ["n", 16, "total"])],
        [_ints("minus_one", [-1])],
        opset=20,
    )


def test_minus_one_beside_a_cache_length_is_the_leftover_dims(rng):
    model = _cache_heads()
    mod, params = tvmamp.from_onnx(model)
    # the -1 is batch * 4, not batch * (past_len + seq) * 64 // (past_len * 16 + seq * 16)
    assert "//" not in mod.script()
    for level, tol in (("O0", 1e-6), ("O2", 1e-2)):
        exe = tvmamp.build(mod, level, TARGET, params=params)
        for b, p, s in [(2, 3, 5), (3, 1, 1)]:
            past = rng.standard_normal((b, 4, p, 16)).astype(np.float32)
            new = rng.standard_normal((b, 4, s, 16)).astype(np.float32)
            ref = run_ort(model, past=past, new=new)
            out = np.asarray(exe(past, new), dtype=np.float32)
            np.testing.assert_allclose(out, ref, rtol=tol, atol=tol * float(np.abs(ref).max()))


def test_a_minus_one_whose_dims_do_not_cancel_is_left_to_tvm(rng):
    """``x.reshape(-1, len(y))``: ``len(y)`` cancels none of ``x``'s dims, TVM's quotient
    ``a * 6 // c`` stands."""
    nodes = [
        h.make_node("Shape", ["y"], ["c"]),
        h.make_node("Concat", ["minus_one", "c"], ["shape"], axis=0),
        h.make_node("Reshape", ["x", "shape"], ["z"]),
    ]
    model = onnx_model(
        nodes,
        [
            h.make_tensor_value_info("x", TP.FLOAT, ["a", 6]),
            h.make_tensor_value_info("y", TP.FLOAT, ["c"]),
        ],
        [h.make_tensor_value_info("z", TP.FLOAT, ["n", "c"])],
        [_ints("minus_one", [-1])],
        opset=20,
    )
    mod, params = tvmamp.from_onnx(model)
    assert "a * 6 // c" in mod.script()
    exe = tvmamp.build(mod, "O0", TARGET, params=params)
    for a, c in [(2, 3), (1, 2)]:
        x = rng.standard_normal((a, 6)).astype(np.float32)
        y = rng.standard_normal((c,)).astype(np.float32)
        np.testing.assert_allclose(np.asarray(exe(x, y)), run_ort(model, x=x, y=y), atol=0)


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


def test_a_slice_from_minus_a_symbolic_size_counts_from_the_end(rng):
    """``x[:, -seq:]`` as the legacy exporter writes it (T5's position bias, exported by
    optimum): the start is ``Neg`` of a size, a negative symbolic bound."""
    nodes = [
        h.make_node("Shape", ["y"], ["y_shape"]),
        h.make_node("Gather", ["y_shape", "one"], ["seq"], axis=0),
        h.make_node("Neg", ["seq"], ["minus_seq"]),
        h.make_node("Unsqueeze", ["minus_seq", "zero"], ["starts"]),
        h.make_node("Slice", ["x", "starts", "end", "axis"], ["tail"]),
        h.make_node("Add", ["tail", "y"], ["z"]),
    ]
    model = onnx_model(
        nodes,
        [
            h.make_tensor_value_info("x", TP.FLOAT, ["batch", "n", 4]),
            h.make_tensor_value_info("y", TP.FLOAT, ["batch", "seq", 4]),
        ],
        [h.make_tensor_value_info("z", TP.FLOAT, ["batch", "seq", 4])],
        [
            nh.from_array(np.array(1, np.int64), "one"),
            _ints("zero", [0]),
            _ints("end", [2**63 - 1]),
            _ints("axis", [1]),
        ],
    )
    mod, params = tvmamp.from_onnx(model)
    exe = tvmamp.build(mod, "O0", TARGET, params=params)
    for b, n, s in [(2, 7, 3), (1, 4, 4)]:
        x = rng.standard_normal((b, n, 4)).astype(np.float32)
        y = rng.standard_normal((b, s, 4)).astype(np.float32)
        np.testing.assert_allclose(np.asarray(exe(x, y)), run_ort(model, x=x, y=y), atol=1e-6)
