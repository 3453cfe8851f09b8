"""ONNX LSTM, GRU and RNN: expanded before TVM's import, checked against onnxruntime and torch."""

import io
import warnings

import numpy as np
import pytest

import tvmamp
from tvmamp.frontends import UnsupportedOperatorError, from_onnx

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

TARGET = "llvm -num-cores=1"
TOL = {"rtol": 1e-5, "atol": 1e-5}
LOW_TOL = {"rtol": 5e-2, "atol": 5e-2}
GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}


def _reference(model, inputs):
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    return session.run(None, dict(zip(names, inputs)))


def _run(model, inputs, level="O0", shape_dict=None):
    mod, params = from_onnx(model, shape_dict=shape_dict)
    out = tvmamp.build(mod, level, TARGET, params=params)(*inputs)
    return list(out) if isinstance(out, tuple) else [out]


def _check(model, inputs, level="O0", tol=TOL, want=None):
    snapshot = model.SerializeToString()
    got = _run(model, inputs, level)
    want = _reference(model, inputs) if want is None else want
    assert model.SerializeToString() == snapshot  # the caller's model is not modified
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, **tol)


def _node_model(
    rng,
    op,
    *,
    steps=3,
    batch=2,
    size=4,
    hidden=5,
    direction="forward",
    layout=0,
    bias=True,
    states=False,
    peepholes=False,
    outputs=("Y", "Y_h", "Y_c"),
    batch_dim=None,
    steps_dim=None,
    opset=14,
    **attrs,
):
    """One ``op`` node with random initializer weights; returns (model, inputs)."""
    dirs = 2 if direction == "bidirectional" else 1
    gates = GATES[op]

    def normal(*shape):
        return rng.standard_normal(shape).astype("float32") * 0.5

    inits = [
        numpy_helper.from_array(normal(dirs, gates * hidden, size), "W"),
        numpy_helper.from_array(normal(dirs, gates * hidden, hidden), "R"),
    ]
    node_inputs = ["x", "W", "R", ""]
    if bias:
        inits.append(numpy_helper.from_array(normal(dirs, 2 * gates * hidden), "B"))
        node_inputs[3] = "B"
    b_dim, s_dim = batch_dim or batch, steps_dim or steps
    x_shape = [b_dim, s_dim, size] if layout else [s_dim, b_dim, size]
    state_shape = [b_dim, dirs, hidden] if layout else [dirs, b_dim, hidden]
    graph_inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)]
    x = normal(batch, steps, size) if layout else normal(steps, batch, size)
    inputs = [x]
    state_names = ["h0", "c0"] if op == "LSTM" else ["h0"]
    if states:
        node_inputs += [""]  # sequence_lens
        for name in state_names:
            graph_inputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, state_shape))
            node_inputs.append(name)
            inputs.append(normal(batch, dirs, hidden) if layout else normal(dirs, batch, hidden))
    if peepholes:
        node_inputs += [""] * (7 - len(node_inputs))
        inits.append(numpy_helper.from_array(normal(dirs, 3 * hidden), "P"))
        node_inputs.append("P")
    names = list(outputs if op == "LSTM" else [o for o in outputs if o != "Y_c"])
    node = helper.make_node(
        op,
        node_inputs,
        names,
        name=f"my_{op.lower()}",
        hidden_size=hidden,
        direction=direction,
        **({"layout": layout} if layout else {}),  # an attribute since opset 14
        **attrs,
    )
    y_shape = [b_dim, s_dim, dirs, hidden] if layout else [s_dim, dirs, b_dim, hidden]
    graph_outputs = [
        helper.make_tensor_value_info(n, TensorProto.FLOAT, y_shape if k == 0 else state_shape)
        for k, n in enumerate(names)
        if n
    ]
    graph = helper.make_graph([node], "rnn", graph_inputs, graph_outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model, inputs


@pytest.mark.parametrize("op", ["LSTM", "GRU", "RNN"])
@pytest.mark.parametrize("direction", ["forward", "reverse", "bidirectional"])
def test_node_matches_onnxruntime(rng, op, direction):
    _check(*_node_model(rng, op, direction=direction))


def _check_layout_1(op, **kwargs):
    """A ``layout=1`` node against the same node with ``layout=0`` on onnxruntime (which only
    supports layout 0): inputs and outputs swap their batch and sequence (or direction) axes."""
    model, inputs = _node_model(np.random.default_rng(7), op, layout=1, **kwargs)
    model0, _ = _node_model(np.random.default_rng(7), op, layout=0, **kwargs)
    want = _reference(model0, [np.swapaxes(a, 0, 1) for a in inputs])
    want = [w.transpose(2, 0, 1, 3) if w.ndim == 4 else w.transpose(1, 0, 2) for w in want]
    _check(model, inputs, want=want)


@pytest.mark.parametrize("op", ["LSTM", "GRU", "RNN"])
def test_initial_states_without_bias(rng, op):
    _check(*_node_model(rng, op, direction="reverse", states=True, bias=False))


@pytest.mark.parametrize("op", ["LSTM", "GRU", "RNN"])
def test_layout_1(op):
    _check_layout_1(op, direction="bidirectional", states=True)


@pytest.mark.parametrize("linear_before_reset", [0, 1])
def test_gru_linear_before_reset(rng, linear_before_reset):
    # The first step starts from zeros or from h0; the later ones from the previous step.
    states = linear_before_reset == 0
    _check(*_node_model(rng, "GRU", states=states, linear_before_reset=linear_before_reset))


@pytest.mark.parametrize(
    "attrs",
    [{"direction": "bidirectional"}, {"clip": 0.5}, {"input_forget": 1}],
    ids=["bidirectional", "clip", "input_forget"],
)
def test_lstm_peepholes_clip_and_input_forget(rng, attrs):
    model, inputs = _node_model(rng, "LSTM", states=True, peepholes=True, **attrs)
    if "clip" in attrs:
        inputs[2] = inputs[2] * 8  # |c| beyond the clip: it bounds the gates' inputs, not h(c)'s
    _check(model, inputs)


@pytest.mark.parametrize(
    "op, direction, activations",
    [
        ("RNN", "forward", ["Relu"]),
        ("GRU", "bidirectional", ["Relu", "Sigmoid", "Sigmoid", "Tanh"]),
        ("LSTM", "reverse", ["Tanh", "Relu", "Sigmoid"]),
    ],
)
def test_other_activations_and_clip(rng, op, direction, activations):
    _check(*_node_model(rng, op, direction=direction, activations=activations, clip=1.5))


@pytest.mark.parametrize("outputs", [("Y",), ("", "Y_h"), ("", "", "Y_c"), ("Y", "", "Y_c")])
def test_any_subset_of_outputs(rng, outputs):
    _check(*_node_model(rng, "LSTM", outputs=outputs, direction="bidirectional"))
    if outputs == ("Y", "", "Y_c"):
        _check_layout_1("LSTM", outputs=outputs, direction="bidirectional")


def test_symbolic_batch_runs_two_batch_sizes(rng):
    model, _ = _node_model(rng, "LSTM", direction="bidirectional", batch_dim="batch", states=True)
    mod, params = from_onnx(model)
    exe = tvmamp.build(mod, "O0", TARGET, params=params)
    for batch in (1, 3):
        inputs = [rng.standard_normal((3, batch, 4)).astype("float32")]
        inputs += [rng.standard_normal((2, batch, 5)).astype("float32") for _ in range(2)]
        for got, want in zip(exe(*inputs), _reference(model, inputs)):
            np.testing.assert_allclose(got, want, **TOL)


def test_symbolic_sequence_length_is_refused_unless_shape_dict_fixes_it(rng):
    model, inputs = _node_model(rng, "GRU", steps_dim="time", linear_before_reset=1)
    with pytest.raises(
        ValueError,
        match=r"GRU node 'my_gru' needs a static sequence length.*"
        r"\['time', 2, 4\].*shape_dict",
    ):
        from_onnx(model)
    mod, params = from_onnx(model, shape_dict={"x": (3, 2, 4)})
    got = tvmamp.build(mod, "O0", TARGET, params=params)(*inputs)
    for g, w in zip(got, _reference(model, inputs)):
        np.testing.assert_allclose(g, w, **TOL)


def test_unsupported_activation_is_named(rng):
    model, _ = _node_model(rng, "RNN", activations=["Softsign"])
    message = (
        r"RNN node 'my_rnn': activations=\['Softsign'\]: Softsign is not supported; "
        r"tvmamp supports Relu, Sigmoid, Tanh"
    )
    with pytest.raises(UnsupportedOperatorError, match=message) as err:
        from_onnx(model)
    assert err.value.operators == ["RNN"]


def test_sequence_lens(rng):
    model, inputs = _node_model(rng, "RNN")
    lens = numpy_helper.from_array(np.full(2, 3, "int32"), "lens")
    model.graph.initializer.append(lens)
    model.graph.node[0].input.extend(["lens"])
    _check(model, inputs)  # equal to the sequence length everywhere: ignored
    model.graph.initializer[-1].CopyFrom(numpy_helper.from_array(np.array([3, 2], "int32"), "lens"))
    with pytest.raises(UnsupportedOperatorError, match="sequence_lens .* variable lengths"):
        from_onnx(model)


@pytest.mark.parametrize("op, opset", [("GRU", 9), ("LSTM", 12)])
def test_old_opsets_split_and_clip_attributes(rng, op, opset):
    """Before opset 13 Split takes its sizes as an attribute, before opset 11 Clip its bounds."""
    _check(*_node_model(rng, op, direction="bidirectional", states=True, clip=0.8, opset=opset))


def test_weights_must_be_constants(rng):
    model, _ = _node_model(rng, "RNN")
    weight = model.graph.initializer[0]
    model.graph.input.append(helper.make_tensor_value_info("W", TensorProto.FLOAT, weight.dims))
    del model.graph.initializer[0]
    with pytest.raises(UnsupportedOperatorError, match=r"input W \('W'\) must be an initializer"):
        from_onnx(model)


def test_other_missing_ops_are_still_refused(rng):
    model, _ = _node_model(rng, "RNN", outputs=("Y",))
    model.graph.node.append(helper.make_node("Det", ["Y"], ["d"]))
    model.graph.output[0].CopyFrom(helper.make_tensor_value_info("d", TensorProto.FLOAT, []))
    with pytest.raises(UnsupportedOperatorError, match="the operators Det$"):
        from_onnx(model)


def test_weights_become_params_named_after_the_node(rng):
    model, _ = _node_model(rng, "GRU", direction="bidirectional", linear_before_reset=1)
    _, params = from_onnx(model)
    assert "W" not in params and "R" not in params  # replaced by their slices
    assert params["my_gru.W_t.forward"].shape == (4, 15)
    np.testing.assert_array_equal(
        params["my_gru.R_t.reverse"], numpy_helper.to_array(model.graph.initializer[1])[1].T
    )


@pytest.mark.parametrize("op", ["LSTM", "GRU", "RNN"])
def test_node_at_o2(rng, op):
    _check(*_node_model(rng, op, direction="bidirectional", states=True), "O2", LOW_TOL)


# ---- torch exports -------------------------------------------------------------------------

torch = pytest.importorskip("torch")


def _export(module, args, dynamic_batch=False):
    names = ["x", "h0", "c0"][: len(args)]
    axes = {n: {0 if n == "x" else 1: "batch"} for n in names} if dynamic_batch else None
    buffer = io.BytesIO()
    with warnings.catch_warnings():  # torch warns about batch sizes and its own deprecations
        warnings.simplefilter("ignore")
        torch.onnx.export(module, args, buffer, dynamo=False, input_names=names, dynamic_axes=axes)
    return onnx.load_from_string(buffer.getvalue())


def _torch_outputs(module, args):
    with torch.no_grad():
        out = module(*args)
    flat = []
    for o in out:
        flat.extend(o if isinstance(o, tuple) else (o,))
    return [o.numpy() for o in flat]


@pytest.mark.parametrize(
    "kind, kwargs",
    [
        ("LSTM", {"num_layers": 2, "bidirectional": True, "batch_first": True}),
        ("GRU", {"num_layers": 2}),
        ("RNN", {"nonlinearity": "relu", "bidirectional": True, "batch_first": True}),
    ],
)
def test_torch_export_matches_torch(rng, kind, kwargs):
    torch.manual_seed(0)
    module = getattr(torch.nn, kind)(4, 6, **kwargs).eval()
    layers = kwargs.get("num_layers", 1) * (2 if kwargs.get("bidirectional") else 1)
    x = torch.from_numpy(rng.standard_normal((2, 3, 4)).astype("float32"))
    batch = 2 if kwargs.get("batch_first") else 3
    h0 = torch.from_numpy(rng.standard_normal((layers, batch, 6)).astype("float32"))
    args = (x, (h0, h0 * 0.5)) if kind == "LSTM" else (x, h0)
    flat_args = (x, h0, h0 * 0.5) if kind == "LSTM" else (x, h0)
    want = _torch_outputs(module, args)
    model = _export(module, args)
    got = _run(model, [a.numpy() for a in flat_args])
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, **TOL)
    if kind == "LSTM":
        low = _run(model, [a.numpy() for a in flat_args], "O2")
        for g, w in zip(low, want):
            np.testing.assert_allclose(g, w, **LOW_TOL)


def test_torch_export_with_dynamic_batch(rng):
    torch.manual_seed(1)
    module = torch.nn.LSTM(4, 6, batch_first=True).eval()
    x = torch.from_numpy(rng.standard_normal((2, 3, 4)).astype("float32"))
    model = _export(module, (x,), dynamic_batch=True)
    mod, params = from_onnx(model)
    exe = tvmamp.build(mod, "O0", TARGET, params=params)
    for batch in (1, 3):
        xb = torch.from_numpy(rng.standard_normal((batch, 3, 4)).astype("float32"))
        for g, w in zip(exe(xb.numpy()), _torch_outputs(module, (xb,))):
            np.testing.assert_allclose(g, w, **TOL)
