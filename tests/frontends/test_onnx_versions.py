"""Old op versions TVM's importer misread (tvmamp.frontends.onnx_versions): an Upsample-7
nearest gave an error of 0.91 against onnxruntime; Upsample-9, Resize-10 and Slice-1 did not
import."""

from __future__ import annotations

import numpy as np
import pytest

import tvmamp
from tvmamp.frontends import UnsupportedOperatorError

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
from onnx import TensorProto  # noqa: E402
from onnx import helper as h  # noqa: E402
from onnx import numpy_helper as nh  # noqa: E402
from onnx_graphs import run_ort  # noqa: E402

from tvmamp.frontends.onnx_versions import upgrade_old_ops  # noqa: E402


def _model(nodes, opset, shape, inits=()):
    """``nodes`` from ``x`` (fp32 of ``shape``) to ``y`` (its shape left to inference)."""
    x = h.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))
    y = h.make_tensor_value_info("y", TensorProto.FLOAT, None)
    graph = h.make_graph(nodes, "g", [x], [y], list(inits))
    return h.make_model(graph, opset_imports=[h.make_opsetid("", opset)])


def _scales(values):
    return nh.from_array(np.array(values, "float32"), "s")


def _check(model, shape, level="O0", tol=1e-5):
    x = np.random.default_rng(sum(shape)).standard_normal(shape).astype("float32")
    mod, params = tvmamp.from_onnx(model)
    out = tvmamp.build(mod, params=params, level=level, target="llvm")(x)
    ref = run_ort(model, x=x)
    assert out.shape == ref.shape
    np.testing.assert_allclose(out, ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("mode", ["nearest", "linear"])
@pytest.mark.parametrize("scale", [2.0, 1.5, 3.0])
@pytest.mark.parametrize("opset", [7, 9])
def test_upsample(opset, scale, mode):
    """Opset 7 takes the scales as an attribute, 9 as an input."""
    scales = [1.0, 1.0, scale, scale]
    if opset == 7:
        node = h.make_node("Upsample", ["x"], ["y"], scales=scales, mode=mode)
        model = _model([node], 7, (1, 2, 4, 5))
    else:
        node = h.make_node("Upsample", ["x", "s"], ["y"], mode=mode)
        model = _model([node], 9, (1, 2, 4, 5), [_scales(scales)])
    _check(model, (1, 2, 4, 5))


@pytest.mark.parametrize("mode", ["nearest", "linear"])
@pytest.mark.parametrize("scale", [0.5, 0.6, 1.5, 2.0])
def test_resize_10(scale, mode):
    """onnxruntime rounds a nearest sample down when enlarging and up when shrinking."""
    node = h.make_node("Resize", ["x", "s"], ["y"], mode=mode)
    model = _model([node], 10, (1, 2, 6, 10), [_scales([1.0, 1.0, scale, scale])])
    _check(model, (1, 2, 6, 10))


def test_slice_1_and_the_other_ops_of_an_opset_9_model_at_o2():
    """Slice's bounds as attributes, ``Pad`` by attribute and ``Softmax`` over a flattened
    axis, all in one opset-9 model that the converter brings to opset 13 as a whole."""
    nodes = [
        h.make_node("Pad", ["x"], ["p"], pads=[0, 0, 1, 1, 0, 0, 1, 1], mode="constant"),
        h.make_node("Upsample", ["p", "s"], ["u"], mode="nearest"),
        h.make_node("Slice", ["u"], ["c"], starts=[1], ends=[9], axes=[2]),
        h.make_node("Softmax", ["c"], ["y"], axis=1),
    ]
    model = _model(nodes, 9, (1, 2, 4, 5), [_scales([1.0, 1.0, 2.0, 2.0])])
    _check(model, (1, 2, 4, 5))
    _check(model, (1, 2, 4, 5), level="O2", tol=2e-2)


def test_a_model_of_current_op_versions_is_left_as_it_is():
    node = h.make_node("Resize", ["x", "", "s"], ["y"], mode="nearest")
    model = _model([node], 13, (1, 2, 4, 5), [_scales([1.0, 1.0, 2.0, 2.0])])
    assert upgrade_old_ops(onnx, model) is model


def test_nearest_scales_that_enlarge_and_shrink_are_refused():
    node = h.make_node("Upsample", ["x", "s"], ["y"], mode="nearest", name="up")
    model = _model([node], 9, (1, 2, 4, 8), [_scales([1.0, 1.0, 2.0, 0.5])])
    with pytest.raises(UnsupportedOperatorError, match="Upsample node 'up'.*enlarge and shrink"):
        tvmamp.from_onnx(model)
