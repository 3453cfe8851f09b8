"""tvmamp.from_onnx on symbolic dims: the Range, Slice, Gather, Expand and Pad overrides of
tvmamp.frontends.onnx_symbolic, and shape_dict dims left symbolic with None."""

import numpy as np
import pytest

import tvmamp

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from onnx import TensorProto as TP  # noqa: E402
from onnx import helper as h  # noqa: E402
from onnx import numpy_helper as nh  # noqa: E402
from onnx_graphs import onnx_model, resize_by_shape, run_ort  # noqa: E402

TARGET = "llvm -num-cores=1"
END = np.iinfo(np.int64).max


def _ints(name, values):
    return nh.from_array(np.array(values, np.int64), name)


def _dim(shape, axis, out):
    """Nodes computing ``out = Shape(shape)[axis]`` (a scalar)."""
    return [
        h.make_node("Constant", [], [f"{out}_axis"], value=nh.from_array(np.array(axis, np.int64))),
        h.make_node("Shape", [shape], [f"{out}_shape"]),
        h.make_node("Gather", [f"{out}_shape", f"{out}_axis"], [out]),
    ]


def _rows_model(nodes, inits, out_dims):
    """A model of ``nodes`` from ``x[batch, seq]`` (fp32) to ``y`` of ``out_dims``."""
    return onnx_model(
        nodes,
        [h.make_tensor_value_info("x", TP.FLOAT, ["batch", "seq"])],
        [h.make_tensor_value_info("y", TP.FLOAT, out_dims)],
        inits,
    )


def _check_two_sizes(model, shapes, rng, rtol=1e-5):
    """Import without shape_dict, build once, and match onnxruntime at each input shape."""
    mod, params = tvmamp.from_onnx(model)
    exe = tvmamp.build(mod, "O0", TARGET, params=params)
    for shape in shapes:
        x = rng.uniform(0.5, 1.5, shape).astype(np.float32)
        ref = run_ort(model, x=x)
        out = np.asarray(exe(x))
        assert out.shape == ref.shape
        np.testing.assert_allclose(out, ref, rtol=rtol, atol=rtol * float(np.abs(ref).max()))


def test_range_over_a_symbolic_length_keeps_it(rng):
    # ConvBERT's position ids: Range(0, seq) added to the rows, then flattened.
    nodes = _dim("x", 1, "seq") + [
        h.make_node("Range", ["zero", "seq", "one"], ["pos"]),
        h.make_node("Cast", ["pos"], ["posf"], to=TP.FLOAT),
        h.make_node("Add", ["x", "posf"], ["sum"]),
        h.make_node("Reshape", ["sum", "flat"], ["y"]),
    ]
    inits = [
        nh.from_array(np.array(0, np.int64), "zero"),
        nh.from_array(np.array(1, np.int64), "one"),
        _ints("flat", [-1]),
    ]
    model = _rows_model(nodes, inits, [None])
    _check_two_sizes(model, [(2, 5), (3, 9)], rng)


def test_range_down_from_a_symbolic_start_keeps_its_length(rng):
    # XLNet's relative positions: Range(seq, -seq, -1) has 2 * seq elements.
    nodes = _dim("x", 1, "seq") + [
        h.make_node("Neg", ["seq"], ["neg"]),
        h.make_node("Range", ["seq", "neg", "down"], ["pos"]),
        h.make_node("Cast", ["pos"], ["posf"], to=TP.FLOAT),
        h.make_node("Concat", ["x", "x"], ["xx"], axis=1),
        h.make_node("Mul", ["xx", "posf"], ["prod"]),
        h.make_node("Reshape", ["prod", "flat"], ["y"]),
    ]
    inits = [nh.from_array(np.array(-1, np.int64), "down"), _ints("flat", [-1])]
    model = _rows_model(nodes, inits, [None])
    _check_two_sizes(model, [(2, 5), (3, 9)], rng)


def test_slice_to_the_end_from_a_symbolic_start(rng):
    # MPT's ALiBi bias: table[:, 16 - seq:] (INT64_MAX end) added to the scores.
    nodes = _dim("x", 1, "seq") + [
        h.make_node("Sub", ["sixteen", "seq"], ["first"]),
        h.make_node("Unsqueeze", ["first", "zero"], ["starts"]),
        h.make_node("Slice", ["table", "starts", "end", "one"], ["bias"]),
        h.make_node("Add", ["x", "bias"], ["y"]),
    ]
    inits = [
        nh.from_array(rng.standard_normal((1, 16)).astype(np.float32), "table"),
        nh.from_array(np.array(16, np.int64), "sixteen"),
        _ints("zero", [0]),
        _ints("one", [1]),
        _ints("end", [END]),
    ]
    model = _rows_model(nodes, inits, ["batch", "seq"])
    _check_two_sizes(model, [(2, 5), (3, 16)], rng)


def test_slice_with_negative_and_open_bounds_on_a_symbolic_axis(rng):
    # WavLM's positional conv: frames[:, :-1] next to frames[:, 1:], then flattened.
    nodes = [
        h.make_node("Slice", ["x", "zero", "minus_one", "one"], ["head"]),
        h.make_node("Slice", ["x", "one", "end", "one"], ["tail"]),
        h.make_node("Add", ["head", "tail"], ["sum"]),
        h.make_node("Reshape", ["sum", "flat"], ["y"]),
    ]
    inits = [
        _ints("zero", [0]),
        _ints("one", [1]),
        _ints("minus_one", [-1]),
        _ints("end", [END]),
        _ints("flat", [-1]),
    ]
    model = onnx_model(
        nodes,
        [h.make_tensor_value_info("x", TP.FLOAT, ["batch", "seq", 3])],
        [h.make_tensor_value_info("y", TP.FLOAT, [None])],
        inits,
    )
    _check_two_sizes(model, [(2, 5, 3), (1, 8, 3)], rng)


def test_gather_of_a_shape_picking_static_dims_is_a_constant(rng):
    # DeBERTa v1's chunk: heads split by a Reshape whose -1 ONNX's shape inference cannot
    # resolve, then Shape(t)[[-1]] // 2 bounds the Slices of the two halves.
    nodes = (
        _dim("x", 0, "b")
        + _dim("x", 1, "seq")
        + [
            h.make_node("Unsqueeze", ["b", "zero"], ["b1"]),
            h.make_node("Unsqueeze", ["seq", "zero"], ["seq1"]),
            h.make_node("Concat", ["b1", "seq1", "heads"], ["split"], axis=0),
            h.make_node("Reshape", ["x", "split"], ["r"]),
            h.make_node("Transpose", ["r"], ["t"], perm=[0, 2, 1, 3]),
            h.make_node("Shape", ["t"], ["t_shape"]),
            h.make_node("Gather", ["t_shape", "last"], ["width"]),
            h.make_node("Div", ["width", "two"], ["half"]),
            h.make_node("Slice", ["t", "zero", "half", "last"], ["lo"]),
            h.make_node("Slice", ["t", "half", "width", "last"], ["hi"]),
            h.make_node("Mul", ["lo", "hi"], ["prod"]),
            h.make_node("Reshape", ["prod", "flat"], ["y"]),
        ]
    )
    inits = [
        _ints("zero", [0]),
        _ints("heads", [4, -1]),
        _ints("last", [-1]),
        _ints("two", [2]),
        _ints("flat", [-1]),
    ]
    model = onnx_model(
        nodes,
        [h.make_tensor_value_info("x", TP.FLOAT, ["batch", "seq", 16])],
        [h.make_tensor_value_info("y", TP.FLOAT, [None])],
        inits,
    )
    _check_two_sizes(model, [(2, 5, 16), (1, 7, 16)], rng)


def test_gather_of_a_shape_held_in_a_variable(rng):
    # A Slice with a run-time end has a shape TVM does not know; Shape of it is a variable.
    nodes = [
        h.make_node("Slice", ["x", "zero", "n", "one"], ["s"]),
        h.make_node("Shape", ["s"], ["s_shape"]),
        h.make_node("Gather", ["s_shape", "one"], ["rows"]),
        h.make_node("Cast", ["rows"], ["rowsf"], to=TP.FLOAT),
        h.make_node("Add", ["s", "rowsf"], ["y"]),
    ]
    model = onnx_model(
        nodes,
        [
            h.make_tensor_value_info("x", TP.FLOAT, ["batch", "seq"]),
            h.make_tensor_value_info("n", TP.INT64, [1]),
        ],
        [h.make_tensor_value_info("y", TP.FLOAT, ["batch", None])],
        [_ints("zero", [0]), _ints("one", [1])],
    )
    mod, params = tvmamp.from_onnx(model)
    exe = tvmamp.build(mod, "O0", TARGET, params=params)
    for shape, n in [((2, 6), 4), ((3, 9), 9)]:
        x = rng.uniform(0.5, 1.5, shape).astype(np.float32)
        ends = np.array([n], np.int64)
        ref = run_ort(model, x=x, n=ends)
        np.testing.assert_allclose(np.asarray(exe(x, ends)), ref, rtol=1e-6, atol=1e-6)


def test_expand_of_symbolic_dims_to_a_constant_shape(rng):
    # WavLM's position bias: Expand to a constant shape of 1s (and here a static width).
    nodes = [
        h.make_node("Expand", ["x", "shape"], ["e"]),
        h.make_node("Add", ["e", "x"], ["y"]),
    ]
    model = onnx_model(
        nodes,
        [h.make_tensor_value_info("x", TP.FLOAT, ["batch", "seq", 1])],
        [h.make_tensor_value_info("y", TP.FLOAT, ["batch", "seq", 4])],
        [_ints("shape", [1, 1, 4])],
    )
    _check_two_sizes(model, [(2, 5, 1), (3, 8, 1)], rng)


@pytest.mark.parametrize(
    ("bias_shape", "repeats_of", "out_dims"),
    [
        ((1, 2, 3), lambda b: [b, "one", "one"], ["batch", 2, 3]),  # WavLM's position bias
        ((2, 3), lambda b: [b, "one"], ["batch2", 3]),  # blocks of two rows
        ((2, 1, 3), lambda b: ["one", b, "one"], [2, "batch", 3]),  # a middle axis
    ],
    ids=["leading 1", "leading 2", "middle"],
)
def test_tile_by_a_run_time_repeat(rng, bias_shape, repeats_of, out_dims):
    """``bias.repeat(batch, 1, 1)``: ``Tile`` whose repeats are a ``Concat`` of the batch read
    off ``Shape(x)`` and constants. TVM's importer refuses a shape expression as an input of
    ``Tile`` (WavLM imported only with a static ``shape_dict``); it becomes Unsqueeze, Expand
    and Reshape per repeated axis (``tvmamp/frontends/onnx_tile.py``)."""
    bias = rng.uniform(-1, 1, bias_shape).astype(np.float32)
    nodes = [
        *_dim("x", 0, "b"),
        h.make_node("Unsqueeze", ["b", "zero"], ["b1"]),
        h.make_node("Concat", [n if n != "b" else "b1" for n in repeats_of("b")], ["r"], axis=0),
        h.make_node("Tile", ["bias", "r"], ["y"]),
    ]
    inits = [nh.from_array(bias, "bias"), _ints("zero", [0]), _ints("one", [1])]
    model = _rows_model(nodes, inits, out_dims)
    _check_two_sizes(model, [(2, 5), (3, 4)], rng)


def test_pad_with_pads_computed_from_the_shape(rng):
    # SEW-D's F.pad to a multiple of 4: pads = [0, 0, 0, (4 - seq % 4) % 4], a tensor (here
    # made one by a Cast: TVM refuses a shape as Pad's input before any converter runs).
    nodes = _dim("x", 1, "seq") + [
        h.make_node("Mod", ["seq", "four"], ["rem"]),
        h.make_node("Sub", ["four", "rem"], ["gap"]),
        h.make_node("Mod", ["gap", "four"], ["amount"]),
        h.make_node("Unsqueeze", ["amount", "zero"], ["after"]),
        h.make_node("Concat", ["none", "after"], ["pads64"], axis=0),
        h.make_node("Cast", ["pads64"], ["pads32"], to=TP.INT32),
        h.make_node("Cast", ["pads32"], ["pads"], to=TP.INT64),
        h.make_node("Pad", ["x", "pads", "value"], ["y"], mode="constant"),
    ]
    inits = [
        nh.from_array(np.array(4, np.int64), "four"),
        _ints("zero", [0]),
        _ints("none", [0, 0, 0]),
        nh.from_array(np.array(0.5, np.float32), "value"),
    ]
    model = _rows_model(nodes, inits, ["batch", None])
    _check_two_sizes(model, [(2, 5), (3, 8)], rng)


def _baked_length_model(rng):
    """x + bias with the length baked into bias (as Funnel's and Mamba's traces are)."""
    nodes = [
        h.make_node("Add", ["x", "bias"], ["sum"]),
        h.make_node("Reshape", ["sum", "flat"], ["y"]),
    ]
    inits = [
        nh.from_array(rng.standard_normal((1, 8)).astype(np.float32), "bias"),
        _ints("flat", [-1]),
    ]
    return _rows_model(nodes, inits, [None])


def test_shape_dict_none_keeps_a_dim_symbolic(rng):
    model = _baked_length_model(rng)
    mod, params = tvmamp.from_onnx(model, shape_dict={"x": (None, 8)})
    batch, length = mod["main"].params[0].ty.shape.values
    assert str(batch) == "batch" and int(length) == 8
    exe = tvmamp.build(mod, "O0", TARGET, params=params)
    for rows in (2, 5):
        x = rng.uniform(0.5, 1.5, (rows, 8)).astype(np.float32)
        np.testing.assert_allclose(np.asarray(exe(x)), run_ort(model, x=x), rtol=1e-6, atol=1e-6)
    assert model.graph.input[0].type.tensor_type.shape.dim[1].dim_param == "seq"  # not modified


@pytest.mark.parametrize(
    ("shape", "match"),
    [
        ((0, 8), r"shape_dict\['x'\] = \(0, 8\) is not a shape \(0\).*positive ints, or None"),
        ((None, "8"), r"shape_dict\['x'\] = \(None, '8'\) is not a shape \('8'\)"),
        (8, r"shape_dict\['x'\] = 8 is not a shape"),
        ((None, 8, 1), r"shape_dict\['x'\] has 3 dimensions, but the model's input has 2"),
    ],
)
def test_shape_dict_bad_values_are_refused(rng, shape, match):
    with pytest.raises(ValueError, match=match):
        tvmamp.from_onnx(_baked_length_model(rng), shape_dict={"x": shape})


def test_converters_are_restored_after_an_import_that_fails():
    from tvm.relax.frontend.onnx import onnx_frontend

    before = onnx_frontend._get_convert_map
    model = resize_by_shape()
    with pytest.raises(ValueError, match="symbolic input dimensions"):
        tvmamp.from_onnx(model)
    assert onnx_frontend._get_convert_map is before
