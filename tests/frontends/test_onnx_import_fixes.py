"""tvmamp.from_onnx fixes: constant shape initializers, negative axes with a dynamic batch,
clear errors for symbolic shapes, empty Resize inputs and inexact Resize scales."""

import numpy as np
import pytest

import tvmamp
from tvmamp.frontends import UnsupportedOperatorError

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from onnx import TensorProto as TP  # noqa: E402
from onnx import helper as h  # noqa: E402
from onnx import numpy_helper as nh  # noqa: E402
from onnx_graphs import onnx_model, resize_by_shape, run_ort  # noqa: E402

TARGET = "llvm -num-cores=1"


def _run(model, x, level="O0", shape_dict=None):
    mod, params = tvmamp.from_onnx(model, shape_dict=shape_dict or {"x": x.shape})
    return np.asarray(tvmamp.build(mod, level, TARGET, params=params)(x)), params


def test_expand_with_an_initializer_shape_builds_and_is_a_constant(rng):
    shape = nh.from_array(np.array([2, 1, 6], np.int64), "s")
    model = onnx_model(
        [h.make_node("Expand", ["x", "s"], ["y"])],
        [h.make_tensor_value_info("x", TP.FLOAT, [3, 1])],
        [h.make_tensor_value_info("y", TP.FLOAT, [2, 3, 6])],
        [shape],
    )
    x = rng.standard_normal((3, 1)).astype(np.float32)
    out, params = _run(model, x)
    assert "s" not in params
    np.testing.assert_allclose(out, run_ort(model, x=x), rtol=1e-5, atol=1e-5)


def test_shape_initializers_become_constants_and_float_weights_stay_params(rng):
    w = rng.standard_normal((6, 4)).astype(np.float32)
    inits = [
        nh.from_array(w, "w"),
        nh.from_array(np.array([0], np.int64), "starts"),
        nh.from_array(np.array([3], np.int64), "ends"),
        nh.from_array(np.array([-1], np.int64), "axes"),
        nh.from_array(np.array([2, 1], np.int64), "reps"),
        nh.from_array(np.array([2, 6], np.int64), "shape"),
        nh.from_array(np.array([0, 1, 0, 1], np.int64), "pads"),
    ]
    nodes = [
        h.make_node("MatMul", ["x", "w"], ["m"]),
        h.make_node("Slice", ["m", "starts", "ends", "axes"], ["s"]),
        h.make_node("Tile", ["s", "reps"], ["t"]),
        h.make_node("Reshape", ["t", "shape"], ["r"]),
        h.make_node("Pad", ["r", "pads"], ["y"]),
    ]
    model = onnx_model(
        nodes,
        [h.make_tensor_value_info("x", TP.FLOAT, [2, 6])],
        [h.make_tensor_value_info("y", TP.FLOAT, [2, 8])],
        inits,
    )
    x = rng.standard_normal((2, 6)).astype(np.float32)
    out, params = _run(model, x)
    assert set(params) == {"w"}
    ref = run_ort(model, x=x)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
    low, _ = _run(model, x, level="O2")
    np.testing.assert_allclose(low, ref, rtol=2e-2, atol=2e-2 * float(np.abs(ref).max()))


def test_split_negative_axis_with_a_dynamic_batch_runs(rng):
    inits = [nh.from_array(np.array([3, 5], np.int64), "split")]
    model = onnx_model(
        [
            h.make_node("Split", ["x", "split"], ["a", "b"], axis=-1),
            h.make_node("Concat", ["b", "a"], ["c"], axis=-1),
            h.make_node("Softmax", ["c"], ["y"], axis=-1),
        ],
        [h.make_tensor_value_info("x", TP.FLOAT, ["batch", 4, 8])],
        [h.make_tensor_value_info("y", TP.FLOAT, ["batch", 4, 8])],
        inits,
    )
    mod, params = tvmamp.from_onnx(model)
    exe = tvmamp.build(mod, "O0", TARGET, params=params)
    for batch in (1, 3):
        x = rng.standard_normal((batch, 4, 8)).astype(np.float32)
        np.testing.assert_allclose(np.asarray(exe(x)), run_ort(model, x=x), rtol=1e-5, atol=1e-5)


def test_torch_glu_with_a_dynamic_batch_runs(rng, tmp_path):
    torch = pytest.importorskip("torch")

    class Glu(torch.nn.Module):
        def forward(self, x):
            return torch.nn.functional.glu(x, -1)

    path = tmp_path / "glu.onnx"
    torch.onnx.export(
        Glu(),
        (torch.randn(1, 10, 64),),
        str(path),
        dynamo=False,
        opset_version=17,
        input_names=["x"],
        output_names=["y"],
        dynamic_axes={"x": {0: "b"}, "y": {0: "b"}},
    )
    mod, params = tvmamp.from_onnx(str(path))
    exe = tvmamp.build(mod, "O0", TARGET, params=params)
    model = onnx.load(str(path))
    for batch in (1, 3):
        x = rng.standard_normal((batch, 10, 64)).astype(np.float32)
        np.testing.assert_allclose(np.asarray(exe(x)), run_ort(model, x=x), rtol=1e-5, atol=1e-5)


def test_importer_failure_with_symbolic_inputs_suggests_shape_dict():
    # Resize sizes computed from Shape: TVM's importer needs them static.
    model = resize_by_shape()
    with pytest.raises(ValueError, match=r"symbolic input dimensions.*shape_dict=\{'x'") as info:
        tvmamp.from_onnx(model)
    assert info.value.__cause__ is not None
    assert "batch" in str(info.value)
    # with a static shape it imports and runs
    x = np.ones((1, 2, 4, 4), np.float32)
    out, _ = _run(model, x)
    np.testing.assert_allclose(out, run_ort(model, x=x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("where", ["initializer", "constant"])
def test_resize_with_empty_roi_and_scales_and_sizes(rng, where):
    sizes = np.array([1, 2, 8, 11], np.int64)
    empty = np.array([], np.float32)
    nodes, inits = [], [nh.from_array(sizes, "sizes")]
    if where == "initializer":
        inits += [nh.from_array(empty, "roi"), nh.from_array(empty, "sc")]
    else:
        nodes += [
            h.make_node("Constant", [], ["roi"], value=nh.from_array(empty)),
            h.make_node("Constant", [], ["sc"], value=nh.from_array(empty)),
        ]
    nodes.append(h.make_node("Resize", ["x", "roi", "sc", "sizes"], ["y"], mode="linear"))
    model = onnx_model(
        nodes,
        [h.make_tensor_value_info("x", TP.FLOAT, [1, 2, 5, 7])],
        [h.make_tensor_value_info("y", TP.FLOAT, [1, 2, 8, 11])],
        inits,
    )
    x = rng.standard_normal((1, 2, 5, 7)).astype(np.float32)
    out, _ = _run(model, x)
    np.testing.assert_allclose(out, run_ort(model, x=x), rtol=1e-5, atol=1e-5)


def _resize_scales(width, scale, mode, ctm, **attrs):
    node = h.make_node(
        "Resize",
        ["x", "", "scales"],
        ["y"],
        name="up",
        mode=mode,
        coordinate_transformation_mode=ctm,
        **attrs,
    )
    return onnx_model(
        [node],
        [h.make_tensor_value_info("x", TP.FLOAT, [1, 1, 4, width])],
        [h.make_tensor_value_info("y", TP.FLOAT, [1, 1, 4, int(width * scale)])],
        [nh.from_array(np.array([1, 1, 1, scale], np.float32), "scales")],
    )


@pytest.mark.parametrize("mode", ["nearest", "linear", "cubic"])
def test_resize_integer_result_scales_stay_exact(rng, mode):
    model = _resize_scales(6, 1.5, mode, "half_pixel")
    x = rng.standard_normal((1, 1, 4, 6)).astype(np.float32)
    out, _ = _run(model, x)
    np.testing.assert_allclose(out, run_ort(model, x=x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "width, scale, mode, ctm",
    [
        (7, 1.5, "linear", "half_pixel"),
        (7, 1.5, "nearest", "half_pixel"),
        (7, 1.5, "nearest", "asymmetric"),
        (7, 1.5, "cubic", "pytorch_half_pixel"),
        (5, 1.7, "linear", "asymmetric"),
        (7, 0.6, "linear", "half_pixel"),
        (7, 1.5, "linear", "align_corners"),
    ],
)
def test_resize_non_integer_scale_result_is_exact(rng, width, scale, mode, ctm):
    # in*scale not an integer: imported as Pad(edge) -> Resize(sizes) -> Slice, exact.
    model = _resize_scales(width, scale, mode, ctm)
    x = rng.standard_normal((1, 1, 4, width)).astype(np.float32)
    out, _ = _run(model, x)
    np.testing.assert_allclose(out, run_ort(model, x=x), rtol=1e-5, atol=1e-5)


def test_resize_non_integer_scale_result_without_exact_rewrite_is_refused():
    model = _resize_scales(7, 1.5, "cubic", "half_pixel", exclude_outside=1)
    with pytest.raises(
        UnsupportedOperatorError, match=r"'up'.*axis 3: in=7, scale=1.5, in\*scale=10.5.*sizes"
    ):
        tvmamp.from_onnx(model, shape_dict={"x": (1, 1, 4, 7)})


def test_max_pool_with_an_indices_output_is_refused_clearly():
    """TVM's MaxPool converter computes the values only and failed with an assertion."""
    model = onnx_model(
        [h.make_node("MaxPool", ["x"], ["v", "i"], kernel_shape=[2, 2], strides=[2, 2])],
        [h.make_tensor_value_info("x", TP.FLOAT, [1, 2, 4, 4])],
        [
            h.make_tensor_value_info("v", TP.FLOAT, [1, 2, 2, 2]),
            h.make_tensor_value_info("i", TP.INT64, [1, 2, 2, 2]),
        ],
    )
    with pytest.raises(UnsupportedOperatorError, match="MaxPool with an Indices output"):
        tvmamp.from_onnx(model)


def test_max_pool_without_indices_still_imports(rng):
    model = onnx_model(
        [h.make_node("MaxPool", ["x"], ["v"], kernel_shape=[2, 2], strides=[2, 2])],
        [h.make_tensor_value_info("x", TP.FLOAT, [1, 2, 4, 4])],
        [h.make_tensor_value_info("v", TP.FLOAT, [1, 2, 2, 2])],
    )
    x = rng.standard_normal((1, 2, 4, 4)).astype(np.float32)
    out, _ = _run(model, x)
    np.testing.assert_allclose(out, run_ort(model, x=x), rtol=1e-6, atol=1e-6)
