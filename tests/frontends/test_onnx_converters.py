"""Ops whose optional outputs TVM's importer filled with a scalar 0 (tvmamp.frontends.
onnx_converters): LayerNormalization's Mean and InvStdDev, SkipLayerNormalization's sum, Dropout's
mask; and LayerNormalization's broadcast scale, which normalised too few axes (error 0.72)."""

from __future__ import annotations

import numpy as np
import pytest

import tvmamp
from tvmamp.frontends import UnsupportedOperatorError

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from onnx import TensorProto  # noqa: E402
from onnx import helper as h  # noqa: E402
from onnx import numpy_helper as nh  # noqa: E402

FLOAT, FLOAT16 = TensorProto.FLOAT, TensorProto.FLOAT16


def _model(node, inputs, outputs, inits=(), opset=17, ms=False):
    """A one-node model; ``ms`` imports onnxruntime's com.microsoft domain too."""
    graph = h.make_graph([node], "g", inputs, outputs, list(inits))
    opsets = [h.make_opsetid("", opset)] + [h.make_opsetid("com.microsoft", 1)] * ms
    model = h.make_model(graph, opset_imports=opsets)
    model.ir_version = 8
    return model


def _compare(model, feeds, level, tol):
    """Every output of ``model`` against onnxruntime's, shapes and dtypes included."""
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    want = session.run(None, feeds)
    mod, params = tvmamp.from_onnx(model)
    got = tvmamp.build(mod, params=params, level=level, target="llvm")(*feeds.values())
    got = got if isinstance(got, tuple) else (got,)
    assert len(got) == len(want)
    for out, ref in zip(got, want, strict=True):
        assert out.shape == ref.shape and out.dtype == ref.dtype
        np.testing.assert_allclose(out.astype("float32"), ref.astype("float32"), tol, tol)


def _value(name, elem, shape):
    return h.make_tensor_value_info(name, elem, shape)


@pytest.mark.parametrize(
    "shape, axis, scale_shape",
    [
        ((2, 3, 8), -1, (8,)),
        ((2, 3, 8), 1, (3, 8)),
        ((2, 4, 4), 1, (4,)),  # broadcast over the normalised (4, 4): TVM normalised one axis
        ((4, 4, 4), 0, (4, 4)),
        ((2, 4, 4), 1, (1, 4)),
    ],
)
@pytest.mark.parametrize("level", ["O0", "O2"])
def test_layer_norm_with_its_statistics(shape, axis, scale_shape, level, rng):
    rank = len(shape)
    stats = [d if i < (axis % rank) else 1 for i, d in enumerate(shape)]
    inits = [
        nh.from_array(rng.standard_normal(scale_shape).astype("float32"), "g"),
        nh.from_array(rng.standard_normal(scale_shape).astype("float32"), "b"),
    ]
    node = h.make_node(
        "LayerNormalization", ["x", "g", "b"], ["y", "mean", "inv"], axis=axis, epsilon=1e-3
    )
    outputs = [_value("y", FLOAT, shape), _value("mean", FLOAT, stats), _value("inv", FLOAT, stats)]
    model = _model(node, [_value("x", FLOAT, shape)], outputs, inits)
    x = rng.standard_normal(shape).astype("float32") * 3 + 1
    _compare(model, {"x": x}, level, 2e-5)


def test_layer_norm_of_fp16_keeps_fp32_statistics(rng):
    """stash_type 1 (the default): Mean and InvStdDev are computed and returned in fp32."""
    shape = (2, 5, 16)
    inits = [nh.from_array(rng.standard_normal(16).astype("float16"), "g")]
    node = h.make_node("LayerNormalization", ["x", "g"], ["y", "mean", "inv"])
    outputs = [_value("y", FLOAT16, shape)] + [_value(n, FLOAT, (2, 5, 1)) for n in ("mean", "inv")]
    model = _model(node, [_value("x", FLOAT16, shape)], outputs, inits)
    x = (rng.standard_normal(shape) * 4).astype("float16")
    _compare(model, {"x": x}, "O0", 3e-3)


@pytest.mark.parametrize("optional", [("beta", "bias"), ("beta",), ()])
def test_skip_layer_norm_returns_the_sum_for_the_residual(optional, rng):
    """onnxruntime's optimised BERT graphs read the 4th output; beta and bias are optional."""
    shape = (2, 7, 32)
    names = {"beta": "be", "bias": "bi"}
    inits = [nh.from_array(rng.standard_normal(32).astype("float32"), "g")]
    inits += [nh.from_array(rng.standard_normal(32).astype("float32"), names[o]) for o in optional]
    inputs = ["x", "s", "g", *(names[o] if o in optional else "" for o in ("beta", "bias"))]
    while inputs[-1] == "":
        inputs.pop()
    node = h.make_node(
        "SkipLayerNormalization",
        inputs,
        ["y", "mean", "inv", "sum"],
        domain="com.microsoft",
        epsilon=1e-5,
    )
    stats = (2, 7, 1)
    outputs = [_value("y", FLOAT, shape), _value("mean", FLOAT, stats)]
    outputs += [_value("inv", FLOAT, stats), _value("sum", FLOAT, shape)]
    model = _model(
        node, [_value("x", FLOAT, shape), _value("s", FLOAT, shape)], outputs, inits, ms=True
    )
    x, s = (rng.standard_normal(shape).astype("float32") for _ in range(2))
    _compare(model, {"x": x, "s": s}, "O0", 2e-5)


def test_dropout_mask_is_boolean(rng):
    """TVM returned a float mask; a Not of it failed to import."""
    shape = (2, 3, 4)
    nodes = [
        h.make_node("Dropout", ["x", "r"], ["d", "m"]),
        h.make_node("Not", ["m"], ["n"]),
        h.make_node("Where", ["n", "x", "d"], ["y"]),
    ]
    graph = h.make_graph(
        nodes,
        "g",
        [_value("x", FLOAT, shape)],
        [_value("y", FLOAT, shape), _value("m", TensorProto.BOOL, shape)],
        [nh.from_array(np.array(0.3, "float32"), "r")],
    )
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 13)])
    model.ir_version = 8
    _compare(model, {"x": rng.standard_normal(shape).astype("float32")}, "O0", 0)


def test_dropout_in_training_mode_is_refused():
    node = h.make_node("Dropout", ["x", "r", "t"], ["y"])
    inits = [
        nh.from_array(np.array(0.3, "float32"), "r"),
        nh.from_array(np.array(True), "t"),
    ]
    model = _model(node, [_value("x", FLOAT, (2, 3))], [_value("y", FLOAT, (2, 3))], inits)
    with pytest.raises(UnsupportedOperatorError, match="training_mode"):
        tvmamp.from_onnx(model)


def test_4_bit_tensors_are_refused_by_name():
    """TVM reads INT4 initializers one value a byte: "TensorCopyFromBytes: size mismatch"."""
    weights = h.make_tensor("wq", TensorProto.INT4, (4, 8), np.ones(32, "int8").tolist())
    node = h.make_node("DequantizeLinear", ["wq", "s"], ["y"])
    scale = nh.from_array(np.array(0.5, "float32"), "s")
    graph = h.make_graph([node], "g", [], [_value("y", FLOAT, (4, 8))], [weights, scale])
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 21)])
    model.ir_version = 10
    with pytest.raises(UnsupportedOperatorError, match="4-bit tensors: 'wq' .INT4."):
        tvmamp.from_onnx(model)


def test_layer_norm_in_an_opset_14_file(rng):
    """onnxruntime's optimiser writes LayerNormalization into opset-14 BERT and ViT files,
    where ONNX has none (its own is opset 17): the checker refused them."""
    shape = (2, 5, 16)
    inits = [nh.from_array(rng.standard_normal(16).astype("float32"), n) for n in "gb"]
    node = h.make_node("LayerNormalization", ["x", "g", "b"], ["y"], epsilon=1e-5)
    model = _model(node, [_value("x", FLOAT, shape)], [_value("y", FLOAT, shape)], inits, 14)
    _compare(model, {"x": rng.standard_normal(shape).astype("float32")}, "O0", 2e-5)


def test_simplified_layer_norm_is_an_rms_norm(rng):
    """T5 and LLaMA files from onnxruntime's optimiser (which registers it in ONNX's domain):
    TVM has no converter, and the checker refused it."""
    shape = (2, 5, 16)
    inits = [nh.from_array(rng.standard_normal(16).astype("float32"), "g")]
    node = h.make_node("SimplifiedLayerNormalization", ["x", "g"], ["y", "inv"], epsilon=1e-6)
    outputs = [_value("y", FLOAT, shape), _value("inv", FLOAT, (2, 5, 1))]
    model = _model(node, [_value("x", FLOAT, shape)], outputs, inits, 14)
    _compare(model, {"x": rng.standard_normal(shape).astype("float32") * 3}, "O0", 2e-5)


@pytest.mark.parametrize("bias", [False, True])
def test_skip_simplified_layer_norm_and_quick_gelu(bias, rng):
    shape = (2, 5, 16)
    inits = [nh.from_array(rng.standard_normal(16).astype("float32"), n) for n in "gc"]
    nodes = [
        h.make_node(
            "SkipSimplifiedLayerNormalization",
            ["x", "s", "g", *(["c"] if bias else [])],
            ["n", "", "", "sum"],
            domain="com.microsoft",
            epsilon=1e-6,
        ),
        h.make_node("QuickGelu", ["n"], ["y"], domain="com.microsoft", alpha=1.5),
    ]
    graph = h.make_graph(
        nodes,
        "g",
        [_value("x", FLOAT, shape), _value("s", FLOAT, shape)],
        [_value("y", FLOAT, shape), _value("sum", FLOAT, shape)],
        inits,
    )
    opsets = [h.make_opsetid("", 17), h.make_opsetid("com.microsoft", 1)]
    model = h.make_model(graph, opset_imports=opsets)
    model.ir_version = 8
    x, s = (rng.standard_normal(shape).astype("float32") for _ in range(2))
    _compare(model, {"x": x, "s": s}, "O0", 2e-5)


def _bert_block(mask_input: bool, unidirectional: int = 0):
    """EmbedLayerNormalization -> Attention, as onnxruntime's BERT optimiser writes them: the
    attention reads the 1-D mask index (sequence ends) of a mask, or a raw 2-D mask."""
    rng = np.random.default_rng(3)
    hidden, vocab = 32, 50

    def weight(name, *shape):
        return nh.from_array((rng.standard_normal(shape) * 0.2).astype("float32"), name)

    inits = [weight("we", vocab, hidden), weight("pe", 64, hidden), weight("se", 2, hidden)]
    inits += [weight("g", hidden), weight("bt", hidden), weight("w", hidden, 3 * hidden)]
    inits.append(weight("b", 3 * hidden))
    embed = h.make_node(
        "EmbedLayerNormalization",
        ["ids", "seg", "we", "pe", "se", "g", "bt", "mask"],
        ["x", "mask_index"],
        domain="com.microsoft",
        epsilon=1e-5,
    )
    attention = h.make_node(
        "Attention",
        ["x", "w", "b", "mask" if mask_input else "mask_index"],
        ["y"],
        domain="com.microsoft",
        num_heads=4,
        unidirectional=unidirectional,
    )
    ids = [h.make_tensor_value_info(n, TensorProto.INT32, ["batch", "seq"]) for n in ("ids", "seg")]
    ids.append(h.make_tensor_value_info("mask", TensorProto.INT32, ["batch", "seq"]))
    graph = h.make_graph(
        [embed, attention], "g", ids, [_value("y", FLOAT, ["batch", "seq", hidden])], inits
    )
    opsets = [h.make_opsetid("", 14), h.make_opsetid("com.microsoft", 1)]
    model = h.make_model(graph, opset_imports=opsets)
    model.ir_version = 8
    return model


@pytest.mark.parametrize(
    "mask_input, unidirectional, shape_dict",
    [
        (False, 0, None),  # the optimiser's default: a 1-D mask index, symbolic axes
        (False, 0, {"ids": (2, 9), "seg": (2, 9), "mask": (2, 9)}),
        (True, 0, None),  # a raw 2-D mask
        (True, 1, {"ids": (2, 9), "seg": (2, 9), "mask": (2, 9)}),  # causal
    ],
)
def test_onnxruntime_attention_with_its_masks(mask_input, unidirectional, shape_dict, rng):
    """TVM's Attention converter refused the 1-D mask index ("mask index should be in shape
    of (batch_size, seq_len)"), failed on a raw mask alone ("The bias should have 4
    dimensions") and on unidirectional; its EmbedLayerNormalization needed static shapes."""
    model = _bert_block(mask_input, unidirectional)
    mask = np.ones((2, 9), "int32")
    mask[1, 6:] = 0
    segments = np.zeros((2, 9), "int32")
    segments[:, 5:] = 1
    feeds = {"ids": rng.integers(0, 50, (2, 9)).astype("int32"), "seg": segments, "mask": mask}
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    (want,) = session.run(None, feeds)
    mod, params = tvmamp.from_onnx(model, shape_dict=shape_dict)
    got = tvmamp.build(mod, params=params, level="O0", target="llvm")(*feeds.values())
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


def test_dropout_before_opset_10_has_its_mask_in_the_input_dtype(rng):
    """Dropout-7 to 9: a float mask, zeros in onnxruntime (opset 10 on: bool, True)."""
    node = h.make_node("Dropout", ["x"], ["y", "m"])
    outputs = [_value("y", FLOAT, (2, 3)), _value("m", FLOAT, (2, 3))]
    model = _model(node, [_value("x", FLOAT, (2, 3))], outputs, opset=9)
    _compare(model, {"x": rng.standard_normal((2, 3)).astype("float32")}, "O0", 0)


def test_attention_with_a_mask_of_ends_and_starts_is_refused_by_name(rng):
    """A (2 * batch,) mask was read as sequence ends: the import failed in a Reshape."""
    node = h.make_node(
        "Attention", ["x", "w", "b", "m"], ["y"], domain="com.microsoft", num_heads=2
    )
    inits = [
        nh.from_array(rng.standard_normal((8, 24)).astype("float32"), "w"),
        nh.from_array(rng.standard_normal(24).astype("float32"), "b"),
    ]
    inputs = [_value("x", FLOAT, (2, 5, 8)), _value("m", TensorProto.INT32, (4,))]
    model = _model(node, inputs, [_value("y", FLOAT, (2, 5, 8))], inits, ms=True)
    with pytest.raises(UnsupportedOperatorError, match="converter for Attention"):
        tvmamp.from_onnx(model)
