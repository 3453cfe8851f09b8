"""Expand ONNX ``LSTM``, ``GRU`` and ``RNN`` nodes into ops that TVM's ONNX importer converts.

TVM's Relax importer has no converter for the recurrent operators. :func:`expand_recurrent`
rewrites each of them, before import, into standard ONNX ops unrolled over the (static)
sequence length, following the ONNX operator specification:

* the input projection of all steps is one ``MatMul`` (``X @ W^T + Wb + Rb``), ``Split``
  into steps, each ``Reshape``'d to ``[batch, gates * hidden]``;
* each step is ``MatMul(H, R^T)``, ``Split`` into gates, the gate activations
  (Sigmoid, Tanh or Relu), ``Clip`` when ``clip`` is set, and the state update;
* ``Y`` is the ``Concat`` of the steps, ``Reshape``'d to ``[seq, num_directions, batch,
  hidden]`` (``Transpose``'d for ``layout=1``); ``Y_h`` and ``Y_c`` are the last states.

The transposed slices of ``W``/``R`` and the summed biases become new initializers named
after the node (``<node>.W_t.forward``...), so that they are still imported as parameters;
the original weights are dropped where nothing else reads them. An absent or all-zero initial
state (a zero initializer, or torch's ``ConstantOfShape`` of zeros) specializes the first step.
The batch may be symbolic; the sequence length must be static. ``sequence_lens`` is accepted
only where it is a constant equal to the sequence length. The activations may be Sigmoid,
Tanh or Relu (which take no ``activation_alpha``/``activation_beta``); ``clip`` bounds the
inputs of the gate activations, not that of ``h(C)`` (as onnxruntime does); ``input_forget``
makes the forget gate ``1 - i``. Anything else is refused with
:class:`~tvmamp.frontends.UnsupportedOperatorError`, naming the node.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from .common import UnsupportedOperatorError
from .onnx_fold import default_opset, inferred_shapes, node_reads, used_names

_COMPONENT = "tvmamp.from_onnx"

RECURRENT_OPS = frozenset({"LSTM", "GRU", "RNN"})

_GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}
_DEFAULT_ACTIVATIONS = {
    "LSTM": ("Sigmoid", "Tanh", "Tanh"),
    "GRU": ("Sigmoid", "Tanh"),
    "RNN": ("Tanh",),
}
_ACTIVATIONS = {"sigmoid": "Sigmoid", "tanh": "Tanh", "relu": "Relu"}
# Ops through which a zero tensor stays zero (data is input 0).
_ZERO_PRESERVING = {
    "Slice",
    "Gather",
    "Reshape",
    "Transpose",
    "Squeeze",
    "Unsqueeze",
    "Expand",
    "Identity",
    "Cast",
    "Tile",
}


def expand_recurrent(model, shape_dict: Mapping[str, tuple] | None = None, opset=None):
    """``model``, or a copy whose LSTM, GRU and RNN nodes are expanded into standard ops.

    Parameters
    ----------
    model : onnx.ModelProto
        A checked model; it is not modified.
    shape_dict : dict of str to tuple, optional
        Input shapes applied before shape inference (to make a sequence length static).
    opset : int, optional
        The opset the importer will use (the model's default-domain opset by default): it
        decides the form of the emitted ``Split`` and ``Clip`` nodes.
    """
    if not any(n.op_type in RECURRENT_OPS for n in model.graph.node):
        return model
    import onnx

    out = onnx.ModelProto()
    out.CopyFrom(model)
    if opset is None:
        opset = default_opset(model)
    graph = _Graph(onnx, out, shape_dict or {}, int(opset))
    nodes, replaced_inputs = [], set()
    for index, node in enumerate(out.graph.node):
        if node.op_type in RECURRENT_OPS and node.domain in ("", "ai.onnx"):
            nodes.extend(_expand(graph, node, index))
            replaced_inputs.update(i for i in node.input if i)
        else:
            nodes.append(node)
    nodes = _without_dead_producers(out.graph, nodes, replaced_inputs)
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    used = used_names(out.graph)
    dropped = {t.name for t in out.graph.initializer if t.name in replaced_inputs} - used
    kept = [t for t in out.graph.initializer if t.name not in dropped]
    del out.graph.initializer[:]
    out.graph.initializer.extend(kept + graph.new_initializers)
    inputs = [i for i in out.graph.input if i.name not in dropped]  # old IR lists them there
    del out.graph.input[:]
    out.graph.input.extend(inputs)
    return out


class _Graph:
    """What the rewrite knows about the model: constants, shapes, names in use."""

    def __init__(self, onnx, model, shape_dict, opset):
        self.onnx = onnx
        self.opset = opset
        self.new_initializers = []
        g = model.graph
        self.initializers = {t.name: t for t in g.initializer}
        self.producers = {o: n for n in g.node for o in n.output if o}
        self.taken = _all_names(g)
        self.shapes = inferred_shapes(onnx, model, shape_dict)

    def constant(self, name):
        """The value of ``name`` as a numpy array when it is an initializer or a Constant."""
        if not name:
            return None
        numpy_helper = self.onnx.numpy_helper
        if name in self.initializers:
            return numpy_helper.to_array(self.initializers[name])
        node = self.producers.get(name)
        if node is not None and node.op_type == "Constant":
            for a in node.attribute:
                if a.name == "value":
                    return numpy_helper.to_array(a.t)
        return None

    def is_zero(self, name, depth=0):
        """Whether ``name`` is all zeros whatever the inputs (a constant, ConstantOfShape...)."""
        value = self.constant(name)
        if value is not None:
            return not np.any(value)
        node = self.producers.get(name)
        if node is None or depth > 16:
            return False
        if node.op_type == "ConstantOfShape":
            for a in node.attribute:
                if a.name == "value":
                    return not np.any(self.onnx.numpy_helper.to_array(a.t))
            return True  # the default value is a float 0
        if node.op_type in _ZERO_PRESERVING and node.input:
            return self.is_zero(node.input[0], depth + 1)
        return False


def _all_names(graph):
    names = {t.name for t in graph.initializer}
    names.update(v.name for v in (*graph.input, *graph.output, *graph.value_info))
    for node in graph.node:
        names.update(node.output)
        names.update(node.input)
        names.add(node.name)
    return names


def _without_dead_producers(graph, nodes, candidates):
    """``nodes`` less the producers of the replaced nodes' inputs that nothing reads any more."""
    outputs = {o.name for o in graph.output}
    while True:
        used = set(outputs)
        for node in nodes:
            used.update(node_reads(node))
        dead = [
            n
            for n in nodes
            if any(o in candidates for o in n.output) and not any(o in used for o in n.output if o)
        ]
        if not dead:
            return nodes
        for n in dead:
            candidates.update(i for i in n.input if i)
        nodes = [n for n in nodes if not any(n is d for d in dead)]


class _Emitter:
    """Builds the replacement nodes of one recurrent node, with unique deterministic names."""

    def __init__(self, graph: _Graph, prefix: str, dtype):
        self.graph, self.prefix, self.dtype = graph, prefix, dtype
        self.helper = graph.onnx.helper
        self.nodes = []
        self._constants = {}

    def name(self, hint):
        base = f"{self.prefix}.{hint}"
        name, k = base, 1
        while name in self.graph.taken:
            name, k = f"{base}_{k}", k + 1
        self.graph.taken.add(name)
        return name

    def op(self, op_type, inputs, hint, output=None, n_outputs=1, **attrs):
        outputs = [output] if output else [self.name(f"{hint}_{k}") for k in range(n_outputs)]
        if output:
            self.graph.taken.add(output)
        self.nodes.append(
            self.helper.make_node(op_type, list(inputs), outputs, name=self.name(hint), **attrs)
        )
        return outputs[0] if n_outputs == 1 else outputs

    def const(self, value, hint):
        """A Constant node (imported as a constant, not a parameter), shared by value."""
        value = np.asarray(value)
        key = (value.dtype.str, value.shape, value.tobytes())
        if key not in self._constants:
            tensor = self.graph.onnx.numpy_helper.from_array(value, self.name(hint))
            self._constants[key] = self.op("Constant", [], hint, value=tensor)
        return self._constants[key]

    def initializer(self, value, hint):
        """A new initializer (imported as a parameter) named after the node."""
        name = self.name(hint)
        array = np.ascontiguousarray(value, dtype=self.dtype)
        self.graph.new_initializers.append(self.graph.onnx.numpy_helper.from_array(array, name))
        return name

    def split(self, x, sizes, hint, axis=1):
        if len(sizes) == 1:
            return [x]
        if self.graph.opset >= 13:
            split = self.const(np.array(sizes, "int64"), "split")
            return self.op("Split", [x, split], hint, n_outputs=len(sizes), axis=axis)
        return self.op("Split", [x], hint, n_outputs=len(sizes), axis=axis, split=list(sizes))

    def pieces(self, x, count, axis, width, hint):
        """``x`` split in ``count`` along ``axis``, each reshaped to ``[-1, width]``."""
        shape = self.const(np.array([-1, width], "int64"), "shape")
        parts = self.split(x, [1] * count, f"{hint}_split", axis=axis)
        return [self.op("Reshape", [p, shape], f"{hint}_{k}") for k, p in enumerate(parts)]

    def clip(self, x, bound):
        if bound is None:
            return x
        if self.graph.opset >= 11:
            low = self.const(np.array(-bound, self.dtype), "clip_min")
            high = self.const(np.array(bound, self.dtype), "clip_max")
            return self.op("Clip", [x, low, high], "clip")
        return self.op("Clip", [x], "clip", min=-float(bound), max=float(bound))

    def activate(self, function, x, bound):
        return self.op(function, [self.clip(x, bound)], function.lower())

    def add(self, a, b, hint="add"):
        return self.op("Add", [a, b], hint)

    def mul(self, a, b, hint="mul"):
        return self.op("Mul", [a, b], hint)


def _label(node):
    return f"{node.op_type} node {node.name!r}" if node.name else f"an unnamed {node.op_type} node"


def _refuse(node, what):
    return UnsupportedOperatorError(f"{_COMPONENT}: {_label(node)}: {what}", [node.op_type])


def _attributes(onnx, node):
    values = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    return {k: v.decode() if isinstance(v, bytes) else v for k, v in values.items()}


def _activations(node, attrs, num_directions):
    per_direction = len(_DEFAULT_ACTIVATIONS[node.op_type])
    given = attrs.get("activations")
    if given is None:
        return [list(_DEFAULT_ACTIVATIONS[node.op_type])] * num_directions
    given = [a.decode() if isinstance(a, bytes) else str(a) for a in given]
    if len(given) != per_direction * num_directions:
        raise _refuse(
            node,
            f"activations={given} should list {per_direction} function(s) per direction "
            f"({per_direction * num_directions} in all)",
        )
    unknown = [a for a in given if a.lower() not in _ACTIVATIONS]
    if unknown:
        raise _refuse(
            node,
            f"activations={given}: {', '.join(unknown)} is not supported; "
            f"tvmamp supports {', '.join(sorted(set(_ACTIVATIONS.values())))}",
        )
    names = [_ACTIVATIONS[a.lower()] for a in given]
    return [names[d * per_direction : (d + 1) * per_direction] for d in range(num_directions)]


def _expand(graph: _Graph, node, index):
    """The nodes that compute ``node`` (an LSTM, GRU or RNN)."""
    op = node.op_type
    attrs = _attributes(graph.onnx, node)
    direction = attrs.get("direction", "forward")
    if direction not in ("forward", "reverse", "bidirectional"):
        raise _refuse(node, f"direction={direction!r} is not forward, reverse or bidirectional")
    num_directions = 2 if direction == "bidirectional" else 1
    layout = int(attrs.get("layout", 0))
    if layout not in (0, 1):
        raise _refuse(node, f"layout={layout} is not 0 or 1")
    inputs = list(node.input) + [""] * (8 - len(node.input))
    x, w_name, r_name, b_name, lens_name, h0_name = inputs[:6]
    c0_name, p_name = (inputs[6], inputs[7]) if op == "LSTM" else ("", "")

    weights = {}
    for role, name in (("W", w_name), ("R", r_name), ("B", b_name), ("P", p_name)):
        value = graph.constant(name)
        if name and value is None:
            raise _refuse(node, f"input {role} ({name!r}) must be an initializer or a Constant")
        weights[role] = value
    w, r = weights["W"], weights["R"]
    gates = _GATES[op]
    if w is None or r is None:
        raise _refuse(node, "inputs W and R are required")
    if r.ndim != 3 or w.ndim != 3:
        raise _refuse(node, f"W and R must be 3-D, got shapes {w.shape} and {r.shape}")
    hidden = int(r.shape[-1])
    if int(attrs.get("hidden_size", hidden)) != hidden:
        raise _refuse(node, f"hidden_size={attrs['hidden_size']} but R has shape {r.shape}")
    expected = {
        "W": (num_directions, gates * hidden, w.shape[2]),
        "R": (num_directions, gates * hidden, hidden),
        "B": (num_directions, 2 * gates * hidden),
        "P": (num_directions, 3 * hidden),
    }
    for role, value in weights.items():
        if value is not None and tuple(value.shape) != expected[role]:
            raise _refuse(
                node,
                f"{role} has shape {tuple(value.shape)}, expected {expected[role]} "
                f"(direction={direction!r}, hidden_size={hidden})",
            )
    dtype = w.dtype
    activations = _activations(node, attrs, num_directions)
    clip = attrs.get("clip")
    input_forget = int(attrs.get("input_forget", 0))
    linear_before_reset = int(attrs.get("linear_before_reset", 0))

    shape = graph.shapes.get(x)
    seq_axis = 1 if layout else 0
    steps = shape[seq_axis] if shape is not None and len(shape) == 3 else None
    if not isinstance(steps, int) or steps <= 0:
        raise ValueError(
            f"{_COMPONENT}: {_label(node)} needs a static sequence length: its input "
            f"X {x!r} has shape {shape if shape is not None else 'unknown'} (layout={layout}, "
            f"sequence axis {seq_axis}); give the model inputs static shapes with shape_dict"
        )
    if lens_name:
        lens = graph.constant(lens_name)
        if lens is None or np.any(lens != steps):
            raise _refuse(
                node,
                f"sequence_lens ({lens_name!r}) must be absent or a constant equal to the "
                f"sequence length {steps} everywhere: variable lengths are not supported",
            )

    emit = _Emitter(graph, node.name or f"{op}_{index}", dtype)
    h0 = None if not h0_name or graph.is_zero(h0_name) else h0_name
    c0 = None if not c0_name or graph.is_zero(c0_name) else c0_name
    outputs = list(node.output) + [""] * (3 - len(node.output))
    cell = {"LSTM": _lstm_direction, "GRU": _gru_direction, "RNN": _rnn_direction}[op]
    options = {
        "clip": clip,
        "input_forget": input_forget,
        "linear_before_reset": linear_before_reset,
        "layout": layout,
        "steps": steps,
        "hidden": hidden,
    }
    h0 = _initial_states(emit, h0, num_directions, layout, hidden, "h")
    c0 = _initial_states(emit, c0, num_directions, layout, hidden, "c")
    results = []
    for d in range(num_directions):
        tag = "reverse" if direction == "reverse" or d == 1 else "forward"
        state = {"h": h0[d], "c": c0[d]}
        weights_d = {k: (v[d] if v is not None else None) for k, v in weights.items()}
        results.append(cell(emit, x, weights_d, state, activations[d], tag, options))

    y_name, yh_name, yc_name = outputs[:3]
    if y_name:
        pieces = [results[d][0][t] for t in range(steps) for d in range(num_directions)]
        flat = emit.op("Concat", pieces, "Y_concat", axis=0) if len(pieces) > 1 else pieces[0]
        dims = emit.const(np.array([steps, num_directions, -1, hidden], "int64"), "Y_shape")
        if layout:
            y = emit.op("Reshape", [flat, dims], "Y_reshape")
            emit.op("Transpose", [y], "Y", output=y_name, perm=[2, 0, 1, 3])
        else:
            emit.op("Reshape", [flat, dims], "Y", output=y_name)
    for k, out_name in ((1, yh_name), (2, yc_name)):
        if not out_name:
            continue
        last = [results[d][k] for d in range(num_directions)]
        flat = emit.op("Concat", last, "last_concat", axis=0) if len(last) > 1 else last[0]
        dims = emit.const(np.array([num_directions, -1, hidden], "int64"), "last_shape")
        if layout:
            state = emit.op("Reshape", [flat, dims], "last_reshape")
            emit.op("Transpose", [state], "last", output=out_name, perm=[1, 0, 2])
        else:
            emit.op("Reshape", [flat, dims], "last", output=out_name)
    return emit.nodes


def _initial_states(emit, initial, num_directions, layout, hidden, what):
    """The [batch, hidden] initial state of each direction (None for zeros)."""
    if initial is None:
        return [None] * num_directions
    return emit.pieces(initial, num_directions, 1 if layout else 0, hidden, f"{what}0")


def _input_projection(emit, x, w, bias, tag, options):
    """``X @ W^T + bias`` for all steps, as a list of steps ([batch, G*H] each)."""
    projected = emit.op("MatMul", [x, emit.initializer(w.T, f"W_t.{tag}")], f"xw.{tag}")
    if bias is not None and np.any(bias):
        projected = emit.add(projected, emit.initializer(bias, f"bias.{tag}"), f"xw_b.{tag}")
    axis = 1 if options["layout"] else 0
    return emit.pieces(projected, options["steps"], axis, w.shape[0], f"xw.{tag}.t")


def _order(options, tag):
    steps = range(options["steps"])
    return reversed(steps) if tag == "reverse" else steps


def _bias_halves(b, gates, hidden):
    if b is None:
        return None, None
    return b[: gates * hidden], b[gates * hidden :]


def _lstm_direction(emit, x, weights, state, acts, tag, options):
    hidden, clip = options["hidden"], options["clip"]
    f_act, g_act, h_act = acts
    wb, rb = _bias_halves(weights["B"], 4, hidden)
    step_input = _input_projection(
        emit, x, weights["W"], None if wb is None else wb + rb, tag, options
    )
    r_t = emit.initializer(weights["R"].T, f"R_t.{tag}")
    peep = weights["P"]
    if peep is not None and np.any(peep):
        p_i, p_o, p_f = (
            emit.initializer(peep[k * hidden : (k + 1) * hidden], f"P_{g}.{tag}")
            for k, g in enumerate("iof")
        )
    else:
        p_i = p_o = p_f = None
    one = emit.const(np.array(1, emit.dtype), "one") if options["input_forget"] else None
    h, c = state["h"], state["c"]
    ys = {}
    for t in _order(options, tag):
        gates = step_input[t]
        if h is not None:
            gates = emit.add(gates, emit.op("MatMul", [h, r_t], f"hr.{tag}"), f"gates.{tag}")
        i, o, f, g = emit.split(gates, [hidden] * 4, f"split.{tag}")
        if c is not None and p_i is not None:
            i = emit.add(i, emit.mul(c, p_i))
        i = emit.activate(f_act, i, clip)
        if options["input_forget"]:
            f = emit.op("Sub", [one, i], "forget")
        else:
            if c is not None and p_f is not None:
                f = emit.add(f, emit.mul(c, p_f))
            f = emit.activate(f_act, f, clip)
        g = emit.activate(g_act, g, clip)
        c = emit.mul(i, g) if c is None else emit.add(emit.mul(f, c), emit.mul(i, g), "c")
        if p_o is not None:
            o = emit.add(o, emit.mul(c, p_o))
        o = emit.activate(f_act, o, clip)
        h = emit.mul(o, emit.op(h_act, [c], h_act.lower()), "h")
        ys[t] = h
    return ys, h, c


def _gru_direction(emit, x, weights, state, acts, tag, options):
    hidden, clip = options["hidden"], options["clip"]
    f_act, g_act = acts
    linear = options["linear_before_reset"]
    wb, rb = _bias_halves(weights["B"], 3, hidden)
    r = weights["R"]
    if wb is None:
        bias, r_bias_h = None, None
    elif linear:  # Rbh is added inside r * (...), the other recurrent biases outside
        bias = wb + np.concatenate([rb[: 2 * hidden], np.zeros(hidden, rb.dtype)])
        r_bias_h = rb[2 * hidden :] if np.any(rb[2 * hidden :]) else None
    else:
        bias, r_bias_h = wb + rb, None
    step_input = _input_projection(emit, x, weights["W"], bias, tag, options)
    if r_bias_h is not None:
        r_bias_h = emit.initializer(r_bias_h, f"Rb_h.{tag}")
    if linear:
        r_all = emit.initializer(r.T, f"R_t.{tag}")
    else:
        r_zr = emit.initializer(r[: 2 * hidden].T, f"R_zr_t.{tag}")
        r_h = emit.initializer(r[2 * hidden :].T, f"R_h_t.{tag}")
    h = state["h"]
    ys = {}
    for t in _order(options, tag):
        xz, xr, xh = emit.split(step_input[t], [hidden] * 3, f"split_x.{tag}")
        if h is None:
            z = emit.activate(f_act, xz, clip)
            reset = emit.activate(f_act, xr, clip) if r_bias_h is not None else None
            candidate = xh if reset is None else emit.add(xh, emit.mul(reset, r_bias_h))
            candidate = emit.activate(g_act, candidate, clip)
            h = emit.op("Sub", [candidate, emit.mul(z, candidate)], "h")  # (1 - z) * h~
        else:
            if linear:
                hr = emit.op("MatMul", [h, r_all], f"hr.{tag}")
                hz, hrr, hh = emit.split(hr, [hidden] * 3, f"split_h.{tag}")
                if r_bias_h is not None:
                    hh = emit.add(hh, r_bias_h)
            else:
                hz, hrr = emit.split(
                    emit.op("MatMul", [h, r_zr], f"hr.{tag}"), [hidden] * 2, f"split_h.{tag}"
                )
            z = emit.activate(f_act, emit.add(xz, hz), clip)
            reset = emit.activate(f_act, emit.add(xr, hrr), clip)
            if linear:
                candidate = emit.add(xh, emit.mul(reset, hh))
            else:
                candidate = emit.add(xh, emit.op("MatMul", [emit.mul(reset, h), r_h], "rh"))
            candidate = emit.activate(g_act, candidate, clip)
            # (1 - z) * h~ + z * H = h~ + z * (H - h~)
            h = emit.add(candidate, emit.mul(z, emit.op("Sub", [h, candidate], "sub")), "h")
        ys[t] = h
    return ys, h, None


def _rnn_direction(emit, x, weights, state, acts, tag, options):
    hidden, clip = options["hidden"], options["clip"]
    wb, rb = _bias_halves(weights["B"], 1, hidden)
    step_input = _input_projection(
        emit, x, weights["W"], None if wb is None else wb + rb, tag, options
    )
    r_t = emit.initializer(weights["R"].T, f"R_t.{tag}")
    h = state["h"]
    ys = {}
    for t in _order(options, tag):
        pre = step_input[t]
        if h is not None:
            pre = emit.add(pre, emit.op("MatMul", [h, r_t], f"hr.{tag}"), f"pre.{tag}")
        h = emit.activate(acts[0], pre, clip)
        ys[t] = h
    return ys, h, None
