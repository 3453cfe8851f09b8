"""onnxruntime's fused ``Attention`` with a key/value cache (tvmamp.frontends.onnx_converters),
as its GPT-2 optimiser writes it for decoders exported with ``past_key_values``: the ``past``
input ``(2, batch, heads, past, head_size)`` and the ``present`` output (``past`` followed by
the new keys and values), which TVM's converter refused ("past state for key and value is not
currently supported") or returned as a scalar 0. Checked against onnxruntime."""

from __future__ import annotations

import numpy as np
import pytest

import tvmamp

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from onnx import TensorProto  # noqa: E402
from onnx import helper as h  # noqa: E402
from onnx import numpy_helper as nh  # noqa: E402

HIDDEN, HEADS = 16, 2
SIZE = HIDDEN // HEADS


def _attention_model(mask: str | None, unidirectional: int, past: bool = True, batch=2):
    """One ``Attention`` node over ``x`` (``batch, seq, 16``) with the cache ``past`` of
    ``past_seq`` positions and a mask over ``total_seq`` keys: ``"raw"`` (``batch, total``,
    ones and zeros, as the GPT-2 optimiser casts ``attention_mask``), ``"ends"`` (1-D, each
    sequence's end) or ``"3d"`` (``batch, seq, total``)."""
    rng = np.random.default_rng(7)
    inits = [
        nh.from_array((rng.standard_normal((HIDDEN, 3 * HIDDEN)) * 0.3).astype("float32"), "w"),
        nh.from_array((rng.standard_normal(3 * HIDDEN) * 0.3).astype("float32"), "b"),
    ]
    mask_dims = {"raw": [batch, "total_seq"], "ends": [batch], "3d": [batch, "seq", "total_seq"]}
    inputs = [h.make_tensor_value_info("x", TensorProto.FLOAT, [batch, "seq", HIDDEN])]
    if mask is not None:
        inputs.append(h.make_tensor_value_info("mask", TensorProto.INT32, mask_dims[mask]))
    if past:
        dims = [2, batch, HEADS, "past_seq", SIZE]
        inputs.append(h.make_tensor_value_info("past", TensorProto.FLOAT, dims))
    node = h.make_node(
        "Attention",
        ["x", "w", "b", "mask" if mask else "", "past" if past else ""],
        ["y", "present"],
        domain="com.microsoft",
        num_heads=HEADS,
        unidirectional=unidirectional,
    )
    outputs = [
        h.make_tensor_value_info("y", TensorProto.FLOAT, [batch, "seq", HIDDEN]),
        h.make_tensor_value_info("present", TensorProto.FLOAT, [2, batch, HEADS, None, SIZE]),
    ]
    graph = h.make_graph([node], "g", inputs, outputs, inits)
    opsets = [h.make_opsetid("", 14), h.make_opsetid("com.microsoft", 1)]
    model = h.make_model(graph, opset_imports=opsets)
    model.ir_version = 8
    return model


def _feeds(model, seq: int, past: int, rng) -> dict:
    """Random inputs for ``seq`` new positions after ``past`` cached ones; the masks hide the
    first key of sequence 0 (left padding) and the last of sequence 1."""
    names = [i.name for i in model.graph.input]
    total = past + seq
    feeds = {"x": rng.standard_normal((2, seq, HIDDEN)).astype("float32")}
    if "mask" in names:
        rank = len(model.graph.input[names.index("mask")].type.tensor_type.shape.dim)
        if rank == 1:
            feeds["mask"] = np.array([total, total - 1], "int32")
        else:
            raw = np.ones((2, total), "int32")
            raw[0, 0] = raw[1, -1] = 0
            feeds["mask"] = raw if rank == 2 else np.repeat(raw[:, None, :], seq, axis=1)
    if "past" in names:
        feeds["past"] = rng.standard_normal((2, 2, HEADS, past, SIZE)).astype("float32")
    return feeds


def _check(exe, model, feeds, tol):
    """Both outputs of ``exe`` against onnxruntime's, shapes included."""
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    want = session.run(None, feeds)
    got = exe(*feeds.values())
    for out, ref in zip(got, want, strict=True):
        assert out.shape == ref.shape
        np.testing.assert_allclose(out, ref, rtol=tol, atol=tol)


@pytest.mark.parametrize(
    "mask, unidirectional",
    [("raw", 1), ("raw", 0), (None, 1), ("ends", 1), ("3d", 0)],
)
def test_attention_with_a_cache_over_symbolic_lengths(mask, unidirectional, rng):
    """One build with symbolic ``seq`` and ``past_seq`` runs a prompt (no cached positions),
    decode steps and a chunk after a cache; causal masking starts at ``past``."""
    model = _attention_model(mask, unidirectional)
    mod, params = tvmamp.from_onnx(model)
    exe = tvmamp.build(mod, params=params, level="O0", target="llvm")
    for seq, past in ((5, 0), (1, 6), (3, 4)):
        _check(exe, model, _feeds(model, seq, past, rng), 1e-5)


@pytest.mark.parametrize("past", [True, False])
def test_attention_cache_of_static_shapes(past, rng):
    """A static ``shape_dict``: the causal mask is the attention's own, shifted by ``past``;
    without a cache, ``present`` holds the new keys and values."""
    model = _attention_model("raw", 1, past=past)
    shapes = {"x": (2, 3, HIDDEN), "mask": (2, 3 + 4 * past)}
    if past:
        shapes["past"] = (2, 2, HEADS, 4, SIZE)
    mod, params = tvmamp.from_onnx(model, shape_dict=shapes)
    exe = tvmamp.build(mod, params=params, level="O0", target="llvm")
    _check(exe, model, _feeds(model, 3, 4 * past, rng), 1e-5)


def test_attention_cache_in_bfloat16(rng):
    """At O2 the cache passes through in fp32 at the outputs; the attention runs in bf16 (fp32
    scores and softmax)."""
    model = _attention_model("raw", 1)
    mod, params = tvmamp.from_onnx(model)
    exe = tvmamp.build(mod, params=params, level="O2", target="llvm", dtype="bfloat16")
    _check(exe, model, _feeds(model, 2, 5, rng), 3e-2)


def test_attention_cache_of_static_length_after_symbolic_new_positions(rng):
    """A static cache beside a symbolic ``seq``: the keys' length is ``4 + seq`` as the concat
    writes it and ``seq + 4`` as TVM simplifies it; FuseTIR failed at O2 on the two forms
    ("Parameter expression T.int64(4) expected an integer argument with value 4")."""
    model = _attention_model("raw", 1, batch="batch")
    shapes = {"x": (None, None, HIDDEN), "mask": (None, None), "past": (2, None, HEADS, 4, SIZE)}
    mod, params = tvmamp.from_onnx(model, shape_dict=shapes)
    exe = tvmamp.build(mod, params=params, level="O2", target="llvm", dtype="bfloat16")
    _check(exe, model, _feeds(model, 3, 4, rng), 3e-2)


def test_attention_cache_of_a_static_batch_and_new_positions_after_a_symbolic_cache(rng):
    """A static batch and ``seq`` after a symbolic ``past``: the keys' transpose over ``past +
    3`` stopped TVM's RewriteDataflowReshape ("The padding factor ... is not divisible")."""
    model = _attention_model("raw", 1)
    shapes = {"x": (2, 3, HIDDEN), "mask": (2, None), "past": (2, 2, HEADS, None, SIZE)}
    mod, params = tvmamp.from_onnx(model, shape_dict=shapes)
    exe = tvmamp.build(mod, params=params, level="O0", target="llvm")
    for past in (4, 1):
        _check(exe, model, _feeds(model, 3, past, rng), 1e-5)


def test_a_present_beside_keys_and_values_of_different_sizes_is_refused():
    """``qkv_hidden_sizes`` with values wider than the keys: no cache is computed for them, and
    TVM's "Missing outputs during conversion" said nothing of why."""
    rng = np.random.default_rng(0)
    node = h.make_node(
        "Attention",
        ["x", "w", "b"],
        ["y", "present"],
        domain="com.microsoft",
        num_heads=2,
        qkv_hidden_sizes=[8, 8, 16],
    )
    inits = [
        nh.from_array(rng.standard_normal((8, 32)).astype("float32"), "w"),
        nh.from_array(rng.standard_normal(32).astype("float32"), "b"),
    ]
    outputs = [
        h.make_tensor_value_info("y", TensorProto.FLOAT, (2, 5, 16)),
        h.make_tensor_value_info("present", TensorProto.FLOAT, None),
    ]
    x = h.make_tensor_value_info("x", TensorProto.FLOAT, (2, 5, 8))
    graph = h.make_graph([node], "g", [x], outputs, inits)
    opsets = [h.make_opsetid("", 14), h.make_opsetid("com.microsoft", 1)]
    model = h.make_model(graph, opset_imports=opsets)
    model.ir_version = 8
    with pytest.raises(
        tvmamp.frontends.UnsupportedOperatorError, match=r"keys \(8\) and values \(16\)"
    ):
        tvmamp.from_onnx(model)
