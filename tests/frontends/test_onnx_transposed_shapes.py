"""Shapes as onnxruntime's transpose optimiser leaves them (level 99 of its transformer
optimiser, LLaMA files): ``Shape(Transpose(x))`` as ``Gather(Shape(x), perm)``, split into its
dims by ``Split``. TVM's importer made both run-time tensors, and the ``Reshape`` to the shape
built from them failed: "Reshape requires the input new shape to be Shape"
(tvmamp.frontends.onnx_symbolic)."""

from __future__ import annotations

import numpy as np
import pytest

import tvmamp

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from onnx import TensorProto  # noqa: E402
from onnx import helper as h  # noqa: E402
from onnx import numpy_helper as nh  # noqa: E402

PERM = [0, 2, 1, 3]


def _ints(name, values):
    return nh.from_array(np.array(values, "int64"), name)


def _merge_heads_model(split: bool):
    """``y = Reshape(Transpose(a, PERM), [b, h, -1])`` (``a = QuickGelu(x)``, ``x``: ``batch,
    seq, heads, 8``), with ``b, h`` read off ``Gather(Shape(a), PERM)``: by a ``Split`` into
    its dims (then a ``Squeeze`` and ``Unsqueeze``, as the optimiser writes them), or by
    ``Gather``. The contrib op stops ONNX's shape inference, as the optimiser's fused ops do,
    so that a static shape_dict does not fold the shapes away."""
    nodes = [
        h.make_node("QuickGelu", ["x"], ["a"], domain="com.microsoft"),
        h.make_node("Transpose", ["a"], ["t"], perm=PERM),
        h.make_node("Shape", ["a"], ["s"]),
        h.make_node("Gather", ["s", "perm"], ["ts"], axis=0),
    ]
    if split:
        nodes += [
            h.make_node("Split", ["ts", "ones"], ["d0", "d1", "d2", "d3"], axis=0),
            h.make_node("Squeeze", ["d0", "zero"], ["b0"]),
            h.make_node("Unsqueeze", ["b0", "zero"], ["b"]),
            h.make_node("Concat", ["b", "d1", "minus_one"], ["shape"], axis=0),
        ]
    else:
        nodes += [
            h.make_node("Gather", ["ts", "zero_scalar"], ["b0"], axis=0),
            h.make_node("Gather", ["ts", "one_scalar"], ["h0"], axis=0),
            h.make_node("Unsqueeze", ["b0", "zero"], ["b"]),
            h.make_node("Unsqueeze", ["h0", "zero"], ["h"]),
            h.make_node("Concat", ["b", "h", "minus_one"], ["shape"], axis=0),
        ]
    nodes.append(h.make_node("Reshape", ["t", "shape"], ["y"]))
    inits = [_ints("perm", PERM), _ints("ones", [1, 1, 1, 1]), _ints("zero", [0])]
    inits += [_ints("minus_one", [-1]), _ints("zero_scalar", 0), _ints("one_scalar", 1)]
    return _model(nodes, ["batch", "seq", 4, 8], inits)


def _model(nodes, dims, inits):
    """A model of ``nodes`` from ``x`` (``dims``) to ``y``, opset 17 and com.microsoft."""
    x = h.make_tensor_value_info("x", TensorProto.FLOAT, dims)
    y = h.make_tensor_value_info("y", TensorProto.FLOAT, None)
    graph = h.make_graph(nodes, "g", [x], [y], inits)
    opsets = [h.make_opsetid("", 17), h.make_opsetid("com.microsoft", 1)]
    model = h.make_model(graph, opset_imports=opsets)
    model.ir_version = 8
    return model


@pytest.mark.parametrize(
    "split, shape_dict",
    [
        (True, None),
        (True, {"x": (2, 5, 4, 8)}),  # a static Split of a shape was split at run time
        (False, None),  # static, TVM's constants of the picked dims reached the Reshape
    ],
)
def test_reshape_to_a_transposed_shape(split, shape_dict, rng):
    model = _merge_heads_model(split)
    x = rng.standard_normal((2, 5, 4, 8)).astype("float32")
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    (want,) = session.run(None, {"x": x})
    mod, params = tvmamp.from_onnx(model, shape_dict=shape_dict)
    got = tvmamp.build(mod, params=params, level="O0", target="llvm")(x)
    assert got.shape == want.shape == (2, 4, 40)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert model == _merge_heads_model(split)  # the Split rewritten in a copy


def _arithmetic_model(dims, numel: bool):
    """``Gather(Shape(a), [1, 0, 2])`` read by ``Mul`` then ``Reshape`` (``numel=False``), or by
    ``ReduceProd`` then ``Cast`` and ``Div`` (``x / x.numel()``)."""
    nodes = [
        h.make_node("QuickGelu", ["x"], ["a"], domain="com.microsoft"),
        h.make_node("Shape", ["a"], ["s"]),
        h.make_node("Gather", ["s", "perm"], ["ts"], axis=0),
    ]
    if numel:
        nodes += [
            h.make_node("ReduceProd", ["ts"], ["n"], keepdims=0),
            h.make_node("Cast", ["n"], ["nf"], to=TensorProto.FLOAT),
            h.make_node("Div", ["a", "nf"], ["y"]),
        ]
    else:
        nodes += [
            h.make_node("Mul", ["ts", "ones"], ["ts2"]),
            h.make_node("Reshape", ["a", "ts2"], ["y"]),
        ]
    return _model(nodes, dims, [_ints("perm", [1, 0, 2]), _ints("ones", [1, 1, 1])])


@pytest.mark.parametrize(
    "dims, numel", [([2, 6, 8], False), (["batch", "seq", 8], True), ([2, 6, 8], True)]
)
def test_arithmetic_on_a_transposed_shape(dims, numel, rng):
    """The permuted shape is kept a shape for ``Reshape``; TVM's importer refused it as the
    input of ``Mul`` or ``ReduceProd`` ("cannot handle ShapeExpr inputs"). Such readers get it
    as a tensor (a constant where static)."""
    model = _arithmetic_model(dims, numel)
    x = rng.standard_normal((2, 6, 8)).astype("float32")
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    (want,) = session.run(None, {"x": x})
    mod, params = tvmamp.from_onnx(model)
    got = tvmamp.build(mod, params=params, level="O0", target="llvm -num-cores=1")(x)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
