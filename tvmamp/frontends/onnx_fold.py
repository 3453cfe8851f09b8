"""Fold the shape arithmetic of ONNX exports into constants before TVM's import.

``torch.onnx.export(dynamo=False)`` computes many static values at run time: ``x.chunk(2)``
becomes a ``Slice`` whose bounds come from ``Shape -> Gather -> Div -> Mul``, a ``TopK``'s
``k`` or a ``Reshape``'s target from ``Shape -> Gather -> Unsqueeze -> Concat``. TVM's importer
does not always see through them: the result gets an unknown shape, and later converters
refuse it (``Einsum``, ``TopK k must be a constant``...). :func:`fold_shape_constants`
replaces such values by ``Constant`` nodes (which TVM imports as constants):

* ``Shape`` and ``Size`` of a tensor whose shape ONNX's shape inference finds static (with
  the user's ``shape_dict`` applied to the graph inputs) become constants;
* where a dimension is symbolic, the positions of a ``Shape`` are tracked, and a ``Gather``,
  ``Slice``, ``Squeeze``, ``Unsqueeze``, ``Reshape``, ``Flatten`` or ``Identity`` of it that
  picks static dimensions only becomes a constant (the op is run on the positions);
* then every node whose inputs are all constants is evaluated with ONNX's reference
  evaluator (:class:`onnx.reference.ReferenceEvaluator`) and replaced by ``Constant`` nodes
  of the same output names, in graph order (so that folding goes on downstream).

Only small values fold: a node folds only if each of its constant inputs and outputs has at
most ``_MAX_FLOATS`` elements (``_MAX_INTS`` for integer and bool tensors), so that weight
computations stay with the weights (parameters) and are neither duplicated nor evaluated.
Ops whose output size depends on input values (``ConstantOfShape``, ``Expand``, ``Tile``,
``Range``) fold only where that size is checked to be small first; others of the kind
(``Resize``, ``Pad``...) never fold, nor do random ops, ops with subgraphs (``If``, ``Loop``,
``Scan``), ops of other domains, or initializers that are also graph inputs (they may be fed).
The nodes that only fed folded nodes are removed, as are the initializers that nothing reads
any more. The caller's model is not modified.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

_MAX_FLOATS = 1024
_MAX_INTS = 1 << 16
_ROUNDS = 3  # re-infer shapes after a round that folded, while Shape nodes are left

_INT_TYPES = frozenset({2, 3, 4, 5, 6, 7, 9, 12, 13})  # TensorProto (U)INT8..64 and BOOL
_NEVER = frozenset(
    {
        "Constant",  # already one
        "RandomNormal",
        "RandomNormalLike",
        "RandomUniform",
        "RandomUniformLike",
        "Multinomial",
        "Bernoulli",
        "Dropout",
    }
)
# Ops whose output size depends on input values, and which have no size estimate below.
_VALUE_SIZED = frozenset(
    {
        "Resize",
        "Upsample",
        "Pad",
        "OneHot",
        "CenterCropPad",
        "Col2Im",
        "MaxUnpool",
        "AffineGrid",
        "MelWeightMatrix",
        "BlackmanWindow",
        "HannWindow",
        "HammingWindow",
        "DFT",
        "STFT",
    }
)
# Ops whose output elements are input 0's elements, moved: run on positions of a shape.
_MOVERS = frozenset({"Gather", "Slice", "Squeeze", "Unsqueeze", "Reshape", "Flatten", "Identity"})


def fold_shape_constants(model, shape_dict: Mapping[str, tuple] | None = None):
    """``model``, or a copy whose static shape computations are ``Constant`` nodes.

    Parameters
    ----------
    model : onnx.ModelProto
        A checked model (its main graph in topological order); it is not modified.
    shape_dict : dict of str to tuple, optional
        Static shapes of graph inputs, applied before shape inference.

    Returns
    -------
    onnx.ModelProto
        ``model`` itself when nothing folds, else a folded copy.
    """
    import onnx

    shape_dict = shape_dict or {}
    out = model
    for _ in range(_ROUNDS):
        if not _worth_trying(out.graph):
            break
        folder = _Folder(onnx, out, shape_dict)
        folder.run()
        if not folder.folded:
            break
        out = _rewrite(onnx, out, folder, in_place=out is not model)
        if not folder.unresolved_shapes:
            break
    return out


def _constant_names(graph):
    inputs = {i.name for i in graph.input}
    names = {t.name for t in graph.initializer if t.name not in inputs}
    names.update(n.output[0] for n in graph.node if n.op_type == "Constant" and _default(n))
    return names


def _default(node):
    return node.domain in ("", "ai.onnx")


def _worth_trying(graph):
    """Whether a node might fold: a Shape or Size, or a node of constant inputs (cheap)."""
    constants = None
    for node in graph.node:
        if not _default(node):
            continue
        if node.op_type in ("Shape", "Size"):
            return True
        if node.op_type in _NEVER or not node.input:
            continue
        if constants is None:
            constants = _constant_names(graph)
        if all(not i or i in constants for i in node.input):
            return True
    return False


class _Folder:
    """One forward pass over the main graph: which node outputs are constants, and their values."""

    def __init__(self, onnx, model, shape_dict):
        self.onnx = onnx
        self.model = model
        self.shape_dict = shape_dict
        graph = model.graph
        self.opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 1)
        inputs = {i.name for i in graph.input}
        # name -> (element count, TensorProto) of initializers and Constant values, read lazily
        self.sources = {
            t.name: (_count(t.dims), t) for t in graph.initializer if t.name not in inputs
        }
        for node in graph.node:
            if node.op_type == "Constant" and _default(node) and node.output:
                source = _constant_source(node)
                if source is not None:
                    self.sources[node.output[0]] = source
        self.values = {}  # name -> numpy array, of folded and of read constants
        self.positions = {}  # name -> list of dims (int or None), for partly static shapes
        self.folded = {}  # node index -> output values (None for an absent optional output)
        self.unresolved_shapes = False
        self._shapes = None
        self._symbols = None

    # ----------------------------------------------------------------- shapes and values

    @property
    def shapes(self):
        if self._shapes is None:
            self._shapes = _inferred_shapes(self.onnx, self.model, self.shape_dict)
        return self._shapes

    def value(self, name):
        """The value of ``name`` when it is a small constant, else None."""
        if name in self.values:
            return self.values[name]
        source = self.sources.get(name)
        if source is None:
            return None
        count, proto = source
        if isinstance(proto, np.ndarray):
            array = proto
        else:
            if count > _MAX_INTS or (count > _MAX_FLOATS and proto.data_type not in _INT_TYPES):
                return None
            try:
                array = self.onnx.numpy_helper.to_array(proto)
            except Exception:  # external data not loaded, odd types...
                return None
        if not _small(array):
            return None
        self.values[name] = array
        return array

    def _unresolved(self, dims):
        """Whether ``dims`` has a dim that another round of inference might find: one that is
        unknown, or named by inference (``unk__0``) rather than by a graph input."""
        if self._symbols is None:
            self._symbols = {
                d.dim_param
                for i in self.model.graph.input
                if i.name not in self.shape_dict
                for d in i.type.tensor_type.shape.dim
                if d.dim_param
            }
        return any(not isinstance(d, int) and d not in self._symbols for d in dims)

    # ----------------------------------------------------------------- the pass

    def run(self):
        for index, node in enumerate(self.model.graph.node):
            if not _default(node) or node.op_type in _NEVER:
                continue
            if any(a.type in (5, 10) or a.HasField("g") or len(a.graphs) for a in node.attribute):
                continue  # GRAPH/GRAPHS attributes: If, Loop, Scan...
            if node.op_type in ("Shape", "Size"):
                self._fold_shape(index, node)
            elif node.op_type in _MOVERS and node.input and node.input[0] in self.positions:
                self._fold_positions(index, node)
            else:
                self._fold_values(index, node)

    def _fold_shape(self, index, node):
        dims = self.shapes.get(node.input[0]) if node.input else None
        if dims is None:
            self.unresolved_shapes = True
            return
        if node.op_type == "Size":
            if all(isinstance(d, int) for d in dims):
                self._fold(index, node, [np.array(_count(dims), dtype=np.int64)])
            self.unresolved_shapes |= self._unresolved(dims)
            return
        attrs = {a.name: a.i for a in node.attribute}
        dims = dims[attrs.get("start", 0) : attrs["end"] if "end" in attrs else None]
        if all(isinstance(d, int) for d in dims):
            self._fold(index, node, [np.array(dims, dtype=np.int64)])
        else:
            self.positions[node.output[0]] = dims
            self.unresolved_shapes |= self._unresolved(dims)

    def _fold_positions(self, index, node):
        """A mover of a partly static shape: run on its positions, fold what is static."""
        dims = self.positions[node.input[0]]
        feeds = {node.input[0]: np.arange(len(dims), dtype=np.int64)}
        for name in node.input[1:]:
            if name:
                value = self.value(name)
                if value is None:
                    return
                feeds[name] = value
        result = self._evaluate(node, feeds)
        if result is None or len(result) != 1 or result[0].dtype != np.int64:
            return
        picked = [dims[p] for p in result[0].reshape(-1).tolist()]
        if all(isinstance(d, int) for d in picked):
            value = np.array(picked, dtype=np.int64).reshape(result[0].shape)
            self._fold(index, node, [value])
        elif result[0].ndim == 1:
            self.positions[node.output[0]] = picked

    def _fold_values(self, index, node):
        if not node.input:
            return
        feeds = {}
        for name in node.input:
            if name:
                value = self.value(name)
                if value is None:
                    return
                feeds[name] = value
        if node.op_type in _VALUE_SIZED or not _small_output(node, feeds):
            return
        result = self._evaluate(node, feeds)
        if result is None or not all(_small(r) for r in result):
            return
        types = [self.shapes.get(f"{o}:type") for o in node.output] if self._shapes else []
        self._fold(index, node, result, types)

    def _fold(self, index, node, results, types=()):
        values = []
        for k, (name, result) in enumerate(zip(node.output, results)):
            if not name:
                values.append(None)
                continue
            if k < len(types) and types[k] is not None and types[k] != result.dtype:
                result = result.astype(types[k])
            self.values[name] = result
            values.append(result)
        self.folded[index] = values

    def _evaluate(self, node, feeds):
        """The outputs of ``node`` on ``feeds`` by ONNX's reference evaluator, or None."""
        from onnx.reference import ReferenceEvaluator

        helper = self.onnx.helper
        typeless = self.onnx.TypeProto
        graph = helper.make_graph(
            [node],
            "fold",
            [helper.make_value_info(n, typeless()) for n in feeds],
            [helper.make_value_info(n, typeless()) for n in node.output if n],
        )
        try:
            with np.errstate(all="ignore"):
                results = ReferenceEvaluator(graph, opsets={"": self.opset}).run(None, feeds)
        except Exception:  # an op or a case the reference does not cover: leave the node
            return None
        arrays = []
        for r in results:
            if not isinstance(r, (np.ndarray, np.generic)):
                return None  # sequences, optionals
            arrays.append(np.asarray(r))
        if len(arrays) != len([n for n in node.output if n]):
            return None
        it = iter(arrays)
        return [next(it) if n else None for n in node.output]


def _constant_source(node):
    """(element count, TensorProto or array) of a Constant node's value, or None."""
    for a in node.attribute:
        if a.name == "value":
            return _count(a.t.dims), a.t
        if a.name == "value_int":
            return 1, np.array(a.i, dtype=np.int64)
        if a.name == "value_ints":
            return len(a.ints), np.array(list(a.ints), dtype=np.int64)
        if a.name == "value_float":
            return 1, np.array(a.f, dtype=np.float32)
        if a.name == "value_floats":
            return len(a.floats), np.array(list(a.floats), dtype=np.float32)
    return None  # strings, sparse values


def _count(dims):
    n = 1
    for d in dims:
        n *= int(d)
    return n


def _small(array):
    if array is None:
        return True  # an absent optional output
    if array.dtype == np.bool_ or array.dtype.kind in "iu":
        return array.size <= _MAX_INTS
    return array.dtype.kind in "fc" and array.size <= _MAX_FLOATS


def _small_output(node, feeds):
    """For ops sized by input values, whether the output is checked small before evaluating."""
    op, args = node.op_type, [feeds.get(n) if n else None for n in node.input]
    try:
        if op == "ConstantOfShape":
            return _count(args[0].reshape(-1)) <= _MAX_INTS
        if op == "Expand":
            shape = np.broadcast_shapes(args[0].shape, tuple(int(d) for d in args[1].reshape(-1)))
            return _count(shape) <= _MAX_INTS
        if op == "Tile":
            return _count(np.multiply(args[0].shape, args[1].reshape(-1))) <= _MAX_INTS
        if op == "Range":
            start, limit, delta = (float(a) for a in args)
            return delta != 0 and (limit - start) / delta <= _MAX_INTS
    except Exception:  # malformed: leave it to the importer's error
        return False
    return True


def _inferred_shapes(onnx, model, shape_dict):
    """Name -> dims (int, symbolic str or unknown None) by shape inference; ``name:type`` -> dtype.

    Inference runs on a light copy: big initializers become typed graph inputs (so they are
    not copied), the declared ``value_info`` and output shapes are dropped (they may disagree
    with ``shape_dict``), and ``shape_dict`` is applied to the inputs.
    """
    light = onnx.ModelProto()
    light.ir_version = model.ir_version
    light.opset_import.extend(model.opset_import)
    light.functions.extend(model.functions)
    g, src = light.graph, model.graph
    g.name = src.name
    g.node.extend(src.node)
    g.input.extend(src.input)
    for output in src.output:
        kept = g.output.add()
        kept.name = output.name
        kept.type.tensor_type.elem_type = output.type.tensor_type.elem_type
    listed = {i.name for i in src.input}
    for t in src.initializer:
        if _count(t.dims) <= _MAX_INTS:
            g.initializer.add().CopyFrom(t)
        if t.name not in listed and _count(t.dims) > _MAX_INTS:
            g.input.append(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
    for value in g.input:
        if value.name in shape_dict:
            tensor = value.type.tensor_type
            tensor.shape.Clear()
            for d in shape_dict[value.name]:
                tensor.shape.dim.add().dim_value = int(d)
    try:
        light = onnx.shape_inference.infer_shapes(light, data_prop=True)
    except Exception:  # best effort: without it the shapes are unknown and nothing folds
        pass
    shapes = {}
    for t in src.initializer:
        shapes[t.name] = [int(d) for d in t.dims]
    for value in (*light.graph.input, *light.graph.value_info, *light.graph.output):
        tensor = value.type.tensor_type
        if tensor.elem_type:
            try:
                shapes[f"{value.name}:type"] = onnx.helper.tensor_dtype_to_np_dtype(
                    tensor.elem_type
                )
            except Exception:
                pass
        if tensor.HasField("shape"):
            shapes[value.name] = [
                d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                for d in tensor.shape.dim
            ]
    return shapes


def _rewrite(onnx, model, folder, in_place=False):
    """A copy of ``model`` (or ``model``, our own copy already) with the folded nodes as
    Constants, less the nodes and initializers that only fed them."""
    out = model
    if not in_place:
        out = onnx.ModelProto()
        out.CopyFrom(model)
    graph = out.graph
    numpy_helper, helper = onnx.numpy_helper, onnx.helper
    nodes, fed = [], set()
    replaced = set()
    for index, node in enumerate(graph.node):
        values = folder.folded.get(index)
        if values is None:
            nodes.append(node)
            continue
        fed.update(i for i in node.input if i)
        for k, (name, value) in enumerate(zip(node.output, values)):
            if value is None:
                continue
            label = node.name if len(node.output) == 1 else f"{node.name}_{k}"
            tensor = numpy_helper.from_array(np.ascontiguousarray(value), name)
            constant = helper.make_node("Constant", [], [name], name=label, value=tensor)
            replaced.add(id(constant))
            nodes.append(constant)
    live = {o.name for o in graph.output}
    kept = []
    for node in reversed(nodes):
        outputs = [o for o in node.output if o]
        removable = id(node) in replaced or any(o in fed for o in outputs)
        if removable and not any(o in live for o in outputs):
            fed.update(i for i in node.input if i)
            continue
        kept.append(node)
        live.update(node.input)
        for a in node.attribute:
            if a.HasField("g"):
                live.update(_used_names(a.g))
            for sub in a.graphs:
                live.update(_used_names(sub))
    kept.reverse()
    del graph.node[:]
    graph.node.extend(kept)
    listed = {i.name for i in graph.input}
    unread = [
        k
        for k, t in enumerate(graph.initializer)
        if t.name in fed and t.name not in live and t.name not in listed
    ]
    for k in reversed(unread):  # deleted in place: the kept weights are not copied
        del graph.initializer[k]
    produced = {o for n in kept for o in n.output} | listed | {t.name for t in graph.initializer}
    infos = [v for v in graph.value_info if v.name in produced]
    if len(infos) != len(graph.value_info):
        del graph.value_info[:]
        graph.value_info.extend(infos)
    return out


def _used_names(graph):
    used = set()
    stack = [graph]
    while stack:
        g = stack.pop()
        used.update(o.name for o in g.output)
        for node in g.node:
            used.update(node.input)
            for a in node.attribute:
                if a.HasField("g"):
                    stack.append(a.g)
                stack.extend(a.graphs)
    return used
