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

from .onnx_tile import tile_as_expand

_MAX_FLOATS = 1024
_MAX_INTS = 1 << 16
# Shape inference is re-run after a round that folded, while Shape nodes are left: a chain of
# run-time "same" pads (timm's tf_* models: each strided conv's pads computed from the size
# its input came out of the previous pad) resolves one pad a round: 5 for EfficientNet-B0.
_ROUNDS = 64

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
    names.update(
        n.output[0] for n in graph.node if n.op_type == "Constant" and in_default_domain(n)
    )
    return names


def in_default_domain(node) -> bool:
    """Whether ``node`` is an op of ONNX's own domain ("" or "ai.onnx")."""
    return node.domain in ("", "ai.onnx")


def default_opset(model) -> int:
    """The model's opset of the default ONNX domain (1 when it declares none)."""
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 1)


def _worth_trying(graph):
    """Whether a node might fold: a Shape or Size, or a node of constant inputs (cheap)."""
    constants = None
    for node in graph.node:
        if not in_default_domain(node):
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
        self.opset = default_opset(model)
        inputs = {i.name for i in graph.input}
        # name -> (element count, TensorProto) of initializers and Constant values, read lazily
        self.sources = {
            t.name: (_count(t.dims), t) for t in graph.initializer if t.name not in inputs
        }
        for node in graph.node:
            if node.op_type == "Constant" and in_default_domain(node) and node.output:
                source = constant_source(node)
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
            self._shapes = inferred_shapes(self.onnx, self.model, self.shape_dict)
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
            if not in_default_domain(node) or node.op_type in _NEVER:
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


def constant_source(node):
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


def inferred_shapes(onnx, model, shape_dict):
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
            tensor = numpy_helper.from_array(np.array(value, order="C"), name)
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
        live.update(node_reads(node))
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


def used_names(graph):
    """Every name ``graph`` and its subgraphs read (node inputs and graph outputs)."""
    used = {o.name for o in graph.output}
    for node in graph.node:
        used.update(node_reads(node))
    return used


def node_reads(node) -> set:
    """Every name ``node`` reads: its inputs and what its subgraphs (If, Loop, Scan) read."""
    reads = set(node.input)
    for a in node.attribute:
        for sub in ([a.g] if a.HasField("g") else []) + list(a.graphs):
            reads.update(used_names(sub))
    return reads


# ----------------------------------------------------------------- before TVM's import

# Inputs that TVM's importer reads as static values (shapes, indices, scales...), by op: an
# initializer there must be a Constant, not a run-time parameter.
_SHAPE_SLOTS = {
    "Expand": (1,),
    "Reshape": (1,),
    "Tile": (1,),
    "Slice": (1, 2, 3, 4),
    "Pad": (1, 2, 3),
    "Resize": (1, 2, 3),
    "Upsample": (1,),
    "Clip": (1, 2),  # scalar bounds: a constant clip (ReLU6) stays one op, not two TE calls
    "ConstantOfShape": (0,),
    "TopK": (1,),
    "Unsqueeze": (1,),
    "Squeeze": (1,),
    "Split": (1,),
    "Range": (0, 1, 2),
    "OneHot": (1, 2),
    "CumSum": (1,),
    "Trilu": (1,),
    "CenterCropPad": (1, 2),
    "Col2Im": (1, 2, 3),
    "MaxUnpool": (2,),
    "NonMaxSuppression": (2, 3, 4),
    "DFT": (1, 2),
    "STFT": (1, 3),
    "ReduceSum": (1,),
    "ReduceMean": (1,),
    "ReduceMax": (1,),
    "ReduceMin": (1,),
    "ReduceProd": (1,),
    "ReduceL1": (1,),
    "ReduceL2": (1,),
    "ReduceLogSum": (1,),
    "ReduceLogSumExp": (1,),
    "ReduceSumSquare": (1,),
}
_SMALL_INTS = 1024  # integer and bool initializers up to this size become Constants

# Ops whose ``axis``/``axes`` attribute counts in the rank of input 0 (negative: from the end).
_AXIS_OPS = frozenset(
    {
        "Split",
        "Concat",
        "Softmax",
        "LogSoftmax",
        "Hardmax",
        "Gather",
        "GatherElements",
        "ArgMax",
        "ArgMin",
        "Flatten",
        "TopK",
        "LayerNormalization",
        "Squeeze",
        "ReduceSum",
        "ReduceMean",
        "ReduceMax",
        "ReduceMin",
        "ReduceProd",
        "ReduceL1",
        "ReduceL2",
        "ReduceLogSum",
        "ReduceLogSumExp",
        "ReduceSumSquare",
        "Compress",
        "ScatterElements",
        "LpNormalization",
    }
)
# Resize coordinate modes whose mapping uses the scale, not in/out sizes.
_SCALE_MODES = frozenset({"half_pixel", "pytorch_half_pixel", "asymmetric", "half_pixel_symmetric"})


def constant_initializers(model):
    """``model``, or a copy where the initializers TVM must see as constants are Constant nodes.

    ``tvm_from_onnx(keep_params_in_input=True)`` makes every initializer a run-time parameter,
    but its converters need static values for shapes and indices (an ``Expand`` shape that is
    a parameter builds into an impure ``vm.builtin.tensor_to_shape`` call, which fails). The
    rule: an initializer that is not a graph input becomes a ``Constant`` node of the same
    name when

    * it is an integer or bool tensor of at most ``_SMALL_INTS`` (1024) elements (shapes,
      indices, axes, pads... are integers; integer weights bigger than that stay parameters), or
    * any node reads it at an input that TVM's importer takes as a static value
      (``_SHAPE_SLOTS``: ``Expand``/``Reshape`` shape, ``Tile`` repeats, ``Slice`` bounds,
      ``Pad`` pads, ``Resize`` roi/scales/sizes, ``TopK`` k, ``Range`` bounds, ``OneHot``
      depth, axes inputs...), of any dtype, with at most ``_MAX_INTS`` elements.

    Float weights stay parameters. The caller's model is not modified.
    """
    import onnx

    graph = model.graph
    inputs = {i.name for i in graph.input}
    slots = set()
    for node in graph.node:
        if in_default_domain(node):
            for k in _SHAPE_SLOTS.get(node.op_type, ()):
                if k < len(node.input) and node.input[k]:
                    slots.add(node.input[k])

    def wanted(t):
        if t.name in inputs or t.data_location == onnx.TensorProto.EXTERNAL:
            return False
        count = _count(t.dims)
        if t.name in slots:
            return count <= _MAX_INTS
        return t.data_type in _INT_TYPES and count <= _SMALL_INTS

    picked = [k for k, t in enumerate(graph.initializer) if wanted(t)]
    if not picked:
        return model
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    constants = [
        onnx.helper.make_node(
            "Constant",
            [],
            [graph.initializer[k].name],
            name=f"{graph.initializer[k].name}_const",
            value=graph.initializer[k],
        )
        for k in picked
    ]
    nodes = constants + list(graph.node)
    del graph.node[:]
    graph.node.extend(nodes)
    for k in reversed(picked):
        del graph.initializer[k]
    return out


def prepare_for_import(model, shape_dict: Mapping[str, tuple] | None = None):
    """``model``, or a copy adjusted for TVM's importer (after :func:`fold_shape_constants`).

    * ``Resize`` inputs ``roi``/``scales``/``sizes`` that are empty constants become absent
      (``""``): ONNX allows an empty tensor for an unused input, TVM then sees both scales and
      sizes.
    * ``Resize`` with constant ``scales`` is checked: TVM turns scales into sizes
      ``floor(in * scale)`` and maps coordinates with ``in / out``; where that differs from
      ``1 / scale`` (``in * scale`` not an integer) under a coordinate mode that uses the
      scale, the node is rewritten exactly (``Pad(edge) -> Resize(sizes) -> Slice``, see
      :func:`_check_resize_scales`), or :class:`UnsupportedOperatorError` is raised where the
      rewrite does not apply (symbolic dims, ``cubic`` with ``exclude_outside``, ``axes``...).
    * ``Tile`` by repeats computed at run time (``x.repeat(batch, 1, 1)``), which TVM's
      importer refuses with symbolic shapes, becomes Unsqueeze, Expand and Reshape per
      repeated axis (:mod:`.onnx_tile`).
    * Negative ``axis``/``axes`` attributes of the ``_AXIS_OPS`` become non-negative where
      shape inference gives the rank of input 0 (TVM mishandles some, e.g. ``Split(axis=-1)``
      with a symbolic dimension).
    """
    import onnx

    shapes = None
    values = {}
    graph = model.graph
    for t in graph.initializer:
        values[t.name] = t
    for node in graph.node:
        if node.op_type == "Constant" and in_default_domain(node) and node.output:
            source = constant_source(node)
            if source is not None:
                values[node.output[0]] = source[1]

    def array(name):
        v = values.get(name)
        if v is None:
            return None
        if isinstance(v, np.ndarray):
            return v
        try:
            return onnx.numpy_helper.to_array(v)
        except Exception:
            return None

    producers = {out: node for node in graph.node for out in node.output}
    edits = []  # (node index, new inputs or None, new attributes or None, nodes or None)
    for index, node in enumerate(graph.node):
        if not in_default_domain(node):
            continue
        new_inputs = new_attrs = replacement = None
        if node.op_type == "Resize":
            ins = list(node.input)
            for k in (1, 2, 3):
                if k < len(ins) and ins[k]:
                    a = array(ins[k])
                    if a is not None and a.size == 0:
                        ins[k] = ""
            while len(ins) > 1 and not ins[-1]:
                ins.pop()
            if ins != list(node.input):
                new_inputs = ins
            if len(ins) > 2 and ins[2] and (len(ins) < 4 or not ins[3]):
                scales = array(ins[2])
                if scales is not None:
                    if shapes is None:
                        shapes = inferred_shapes(onnx, model, shape_dict or {})
                    replacement = _check_resize_scales(
                        onnx, node, scales, shapes.get(node.input[0])
                    )
        if node.op_type == "Tile" and len(node.input) == 2 and array(node.input[1]) is None:
            if shapes is None:
                shapes = inferred_shapes(onnx, model, shape_dict or {})
            replacement = _tile(onnx, model, node, producers, array, shapes)
        if node.op_type in _AXIS_OPS:
            attrs = {a.name: a for a in node.attribute}
            negative = ("axis" in attrs and attrs["axis"].i < 0) or (
                "axes" in attrs and any(v < 0 for v in attrs["axes"].ints)
            )
            if negative and node.input:
                if shapes is None:
                    shapes = inferred_shapes(onnx, model, shape_dict or {})
                dims = shapes.get(node.input[0])
                if dims is not None:
                    rank = len(dims)
                    new_attrs = []
                    for a in node.attribute:
                        if a.name == "axis" and a.i < 0:
                            a = onnx.helper.make_attribute("axis", a.i + rank)
                        elif a.name == "axes" and any(v < 0 for v in a.ints):
                            a = onnx.helper.make_attribute(
                                "axes", [v + rank if v < 0 else v for v in a.ints]
                            )
                        new_attrs.append(a)
        if new_inputs is not None or new_attrs is not None or replacement is not None:
            edits.append((index, new_inputs, new_attrs, replacement))
    if not edits:
        return model
    out = onnx.ModelProto()
    out.CopyFrom(model)
    replaced = {}
    for index, new_inputs, new_attrs, replacement in edits:
        node = out.graph.node[index]
        if new_inputs is not None:
            del node.input[:]
            node.input.extend(new_inputs)
        if new_attrs is not None:
            del node.attribute[:]
            node.attribute.extend(new_attrs)
        if replacement is not None:
            replaced[index] = replacement
    if replaced:
        nodes = []
        for index, node in enumerate(out.graph.node):
            nodes.extend(replaced.get(index, [node]))
        del out.graph.node[:]
        out.graph.node.extend(nodes)
    _drop_unread_constants(out.graph)
    return out


def _tile(onnx, model, node, producers, array, shapes):
    """The nodes of a ``Tile`` by run-time repeats that TVM imports with symbolic shapes
    (:func:`.onnx_tile.tile_as_expand`), where its repeats are a ``Concat`` of one-element
    int64 parts; else None (TVM's converter)."""
    concat = producers.get(node.input[1])
    if concat is None or concat.op_type != "Concat" or not in_default_domain(concat):
        return None
    for part in concat.input:
        value = array(part)
        one = value.size == 1 if value is not None else shapes.get(part) == [1]
        kind = value.dtype if value is not None else shapes.get(f"{part}:type")
        if not one or (kind is not None and np.dtype(kind) != np.int64):
            return None
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 13)
    return tile_as_expand(onnx, node, list(concat.input), array, opset)


def _check_resize_scales(onnx, node, scales, dims):
    """None where TVM's Resize is exact for these constant ``scales``, else the nodes of an
    exact rewrite; raises UnsupportedOperatorError where there is none.

    TVM resizes to ``floor(in * scale)`` and maps coordinates with ``in / out``, which is
    ``1 / scale`` only where ``in * scale`` is an integer. Otherwise the input is padded at
    the end of each such axis (``edge`` mode) to the least ``in'`` with an integer
    ``in' * scale``, resized to ``sizes`` (now exact) and sliced back to ``floor(in * scale)``:
    the kept outputs read the same input points, and the replicated border equals the
    clamping of ``nearest``, ``linear`` and ``cubic`` (not ``cubic`` with ``exclude_outside``).
    """
    from .common import UnsupportedOperatorError

    attrs = {a.name: a for a in node.attribute}
    ctm = (
        attrs["coordinate_transformation_mode"].s.decode()
        if "coordinate_transformation_mode" in attrs
        else "half_pixel"
    )
    if ctm not in _SCALE_MODES or dims is None:
        return None
    scales = scales.reshape(-1).astype(np.float32)
    axes = list(attrs["axes"].ints) if "axes" in attrs else list(range(len(scales)))
    if len(axes) != len(scales):
        return None
    bad = []  # (axis, in, scale, in*scale, out)
    for axis, scale in zip(axes, scales.tolist()):
        axis = axis + len(dims) if axis < 0 else axis
        size = dims[axis] if 0 <= axis < len(dims) else None
        if not isinstance(size, int) or size == 0:
            continue
        product = float(np.float32(scale) * np.float32(size))
        out = int(np.floor(product))
        if out > 0 and _exact(size, scale, out):
            continue
        bad.append((axis, size, scale, product, out))
    if not bad:
        return None
    rewrite = _padded_resize(onnx, node, attrs, dims, axes, scales, bad)
    if rewrite is not None:
        return rewrite
    axis, size, scale, product, out = bad[0]
    label = node.name or node.output[0]
    raise UnsupportedOperatorError(
        f"tvmamp.from_onnx: Resize node {label!r} ({ctm}) on axis {axis}: in={size}, "
        f"scale={scale:g}, in*scale={product:g} is not an integer; TVM would resize to "
        f"{out} and map coordinates with in/out={size / max(out, 1):g} instead of "
        f"1/scale={1 / scale:g}, a silently wrong result. Export the model with `sizes` "
        "(e.g. F.interpolate(size=...)) or with scales whose in*scale are integers.",
        ["Resize"],
    )


def _exact(size, scale, out):
    return abs(out / (size * scale) - 1.0) <= 1e-6


def _padded_resize(onnx, node, attrs, dims, axes, scales, bad):
    """Pad(edge) -> Resize(sizes) -> Slice nodes equal to ``node``, or None."""
    mode = attrs["mode"].s.decode() if "mode" in attrs else "nearest"
    if mode == "cubic" and "exclude_outside" in attrs and attrs["exclude_outside"].i:
        return None
    if "axes" in attrs or not all(isinstance(d, int) for d in dims) or len(dims) != len(axes):
        return None
    if "antialias" in attrs and attrs["antialias"].i:
        return None
    rank = len(dims)
    pads = [0] * (2 * rank)
    sizes = [int(np.floor(np.float32(s) * np.float32(d))) for s, d in zip(scales, dims)]
    padded_sizes = list(sizes)
    for axis, size, scale, _product, out in bad:
        if out < 2:
            return None
        for padded in range(size + 1, 2 * size + 9):
            target = int(round(float(np.float32(scale) * np.float32(padded))))
            if target > 0 and _exact(padded, scale, target):
                break
        else:
            return None
        pads[rank + axis] = padded - size
        padded_sizes[axis] = target
    helper, numpy_helper = onnx.helper, onnx.numpy_helper
    base = node.output[0]

    def constant(suffix, values):
        name = f"{base}__tvmamp_{suffix}"
        value = numpy_helper.from_array(np.array(values, dtype=np.int64), name)
        return name, helper.make_node("Constant", [], [name], name=name, value=value)

    pads_name, pads_node = constant("pads", pads)
    sizes_name, sizes_node = constant("sizes", padded_sizes)
    cut = [a for a, *_ in bad]
    starts_name, starts_node = constant("starts", [0] * len(cut))
    ends_name, ends_node = constant("ends", [sizes[a] for a in cut])
    axes_name, axes_node = constant("axes", cut)
    padded_x, resized = f"{base}__tvmamp_padded", f"{base}__tvmamp_resized"
    label = node.name or base
    pad = helper.make_node(
        "Pad", [node.input[0], pads_name], [padded_x], name=f"{label}__pad", mode="edge"
    )
    resize = helper.make_node("Resize", [padded_x, "", "", sizes_name], [resized], name=label)
    resize.attribute.extend(a for a in node.attribute if a.name != "axes")
    cut_node = helper.make_node(
        "Slice",
        [resized, starts_name, ends_name, axes_name],
        [base],
        name=f"{label}__slice",
    )
    return [pads_node, sizes_node, starts_node, ends_node, axes_node, pad, resize, cut_node]


def _drop_unread_constants(graph):
    """Remove the Constant nodes of the main graph that nothing reads any more."""
    used = used_names(graph)
    kept = [
        n
        for n in graph.node
        if not (
            n.op_type == "Constant"
            and in_default_domain(n)
            and not any(o in used for o in n.output)
        )
    ]
    if len(kept) != len(graph.node):
        del graph.node[:]
        graph.node.extend(kept)
