"""Import ONNX models with TVM's ONNX importer: checked model, validated shapes, params detached."""

from __future__ import annotations

import os
from collections.abc import Mapping

import numpy as np

from .common import UnsupportedOperatorError, require, split_params
from .onnx_converters import ADDED_OPS
from .onnx_converters import OVERRIDES as CONVERTERS
from .onnx_fold import (
    constant_initializers,
    default_opset,
    fold_shape_constants,
    in_default_domain,
    prepare_for_import,
)
from .onnx_rnn import RECURRENT_OPS, expand_recurrent
from .onnx_symbolic import permuted_shapes_as_tensors, split_shapes_as_slices, symbolic_converters
from .onnx_versions import graph_nodes, upgrade_old_ops

_COMPONENT = "tvmamp.from_onnx"


def from_onnx(
    model,
    shape_dict: Mapping[str, tuple] | None = None,
    dtype_dict: str | Mapping[str, str] = "float32",
    opset: int | None = None,
):
    """Import an ONNX model into Relax.

    Parameters
    ----------
    model : str, os.PathLike or onnx.ModelProto
        A ``.onnx`` file or a loaded model. It must pass ``onnx.checker.check_model``.
    shape_dict : dict of str to tuple, optional
        Shapes for graph inputs (needed where TVM cannot import a model's symbolic
        dimensions). Each dimension is a positive int, or None to leave it as the model
        declares it: ``{"input_ids": (None, 128)}`` fixes the length and keeps a symbolic
        batch. Every key must name a graph input: TVM would silently ignore one that does not.
    dtype_dict : str or dict of str to str
        Input dtypes, one for all or per input name (keys validated like ``shape_dict``).
    opset : int, optional
        Override the model's opset.

    Returns
    -------
    mod : tvm.IRModule
        ``main(*inputs, *params)`` with the ``num_input`` attribute.
    params : dict of str to numpy.ndarray
        The initializers by name, for ``tvmamp.build(params=...)``.

    Notes
    -----
    TVM's importer has no ``LSTM``, ``GRU`` or ``RNN`` converter: such nodes are first expanded
    into standard ops unrolled over the sequence (see :mod:`tvmamp.frontends.onnx_rnn`), so
    their sequence length must be static (from the model or ``shape_dict``). Their weights
    are imported as new parameters named after the node (``<node>.W_t.forward``...).

    Small integer initializers and those read as shapes, indices or scales (``Expand``
    shape, ``Slice`` bounds, ``Resize`` scales...) are imported as constants, not params (see
    :func:`tvmamp.frontends.onnx_fold.constant_initializers`): TVM needs them static.
    Negative ``axis`` attributes are made non-negative where the rank is known, empty
    ``Resize`` roi/scales/sizes become absent, and a ``Resize`` whose constant scales give a
    non-integer ``in * scale`` (which TVM would resize inexactly) is rewritten exactly as
    ``Pad(edge) -> Resize(sizes) -> Slice``, or raises :class:`UnsupportedOperatorError`
    where that is not possible (see :func:`tvmamp.frontends.onnx_fold.prepare_for_import`).
    Some of TVM's converters lose symbolic dimensions (``Range``, ``Slice`` to the end,
    ``Gather`` of a shape, ``Expand``, ``Pad`` with run-time pads); they are overridden
    during the import (see :mod:`tvmamp.frontends.onnx_symbolic`), and a ``Tile`` by repeats
    read off a shape at run time becomes ``Expand`` and ``Reshape`` before it (see
    :mod:`tvmamp.frontends.onnx_tile`). Where TVM's importer still
    fails on a model with symbolic input dimensions, the error (a ``ValueError`` chained to
    TVM's) names them and suggests a static ``shape_dict``.

    Static shape arithmetic (``Shape``, ``Size`` and small computations of constants, as
    ``torch.onnx.export`` emits for ``chunk``, ``view``...) is folded into ``Constant`` nodes
    first (see :mod:`tvmamp.frontends.onnx_fold`), so that TVM sees static shapes.
    """
    onnx = require("onnx", "onnx", _COMPONENT)
    model = read_model(onnx, model)
    inputs = graph_inputs(model)
    _check_keys(shape_dict, inputs, "shape_dict")
    if isinstance(dtype_dict, Mapping):
        _check_keys(dtype_dict, inputs, "dtype_dict")
    _check_ops(model)
    from tvm.relax.frontend.onnx import from_onnx as tvm_from_onnx

    shapes = _checked_shapes(shape_dict)
    _check_ranks(model, shapes)
    model = _without_initializer_inputs(onnx, model)
    if opset is None:
        model = upgrade_old_ops(onnx, model)
    model, shapes = _with_partial_shapes(onnx, model, shapes)
    model = split_shapes_as_slices(onnx, model)
    model = permuted_shapes_as_tensors(onnx, model)
    model = constant_initializers(model)
    model = fold_shape_constants(model, shapes)
    model = prepare_for_import(model, shapes)
    model = expand_recurrent(model, shapes, opset)
    try:
        with symbolic_converters(CONVERTERS, ADDED_OPS):
            mod = tvm_from_onnx(
                model, shapes or None, dtype_dict, opset=opset, keep_params_in_input=True
            )
    except Exception as err:
        symbolic = _symbolic_inputs(model, shapes)
        if symbolic:
            raise _symbolic_error(err, symbolic) from err
        if isinstance(err, ValueError):  # tvmamp's own, and converter failures (named)
            raise
        # TVM's importer asserts on what it cannot read ("Missing outputs during conversion.
        # Expected 4 but Got 3 in SkipLayerNormalization."): a ValueError that the CLI reports
        raise ValueError(
            f"{_COMPONENT}: TVM's ONNX importer failed: {type(err).__name__}: {_error_text(err)}"
        ) from err
    func = mod["main"]
    values = list(func.attrs["params"]) if "params" in func.attrs else []
    return split_params(mod, values, _COMPONENT)


def _checked_shapes(shape_dict) -> dict:
    """``shape_dict`` as name -> list of dims (int, or None for the model's dim)."""
    shapes = {}
    for name, shape in (shape_dict or {}).items():
        try:
            dims = None if isinstance(shape, (str, bytes)) else list(shape)
        except TypeError:
            dims = None
        bad = [shape] if dims is None else [d for d in dims if not _valid_dim(d)]
        if bad:
            raise ValueError(
                f"{_COMPONENT}: shape_dict[{name!r}] = {shape!r} is not a shape ({bad[0]!r}); "
                "give a tuple whose dimensions are positive ints, or None to keep the model's "
                "(symbolic) dimension"
            )
        shapes[name] = [None if d is None else int(d) for d in dims]
    return shapes


def _check_ranks(model, shapes: dict) -> None:
    """A ``shape_dict`` entry must have the rank its input declares: TVM took ``(4,)`` for a
    ``[batch, 4]`` input and built a model of another rank without a word."""
    for value in model.graph.input:
        dims = shapes.get(value.name)
        tensor = value.type.tensor_type
        if dims is None or not tensor.HasField("shape"):
            continue
        declared = [
            d.dim_value if d.HasField("dim_value") else d.dim_param or "?" for d in tensor.shape.dim
        ]
        if len(dims) != len(declared):
            raise ValueError(
                f"{_COMPONENT}: shape_dict[{value.name!r}] has {len(dims)} dimensions, but the "
                f"model's input has {len(declared)}: {tuple(declared)}"
            )


def _valid_dim(dim) -> bool:
    if dim is None:
        return True
    return isinstance(dim, (int, np.integer)) and not isinstance(dim, bool) and dim > 0


def _with_partial_shapes(onnx, model, shapes):
    """Write the shapes that keep some of the model's dims (None) into a copy of the model.

    Returns the model and the fully static shapes, which go on to TVM's ``shape_dict``.
    """
    partial = {k: v for k, v in shapes.items() if None in v}
    if not partial:
        return model, shapes
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    for value in copy.graph.input:
        dims = partial.get(value.name)
        if dims is None:
            continue
        tensor = value.type.tensor_type
        if not tensor.HasField("shape"):  # unknown rank: a None dim becomes an unnamed one
            tensor.shape.dim.extend(onnx.TensorShapeProto.Dimension() for _ in dims)
        # a declared rank was checked against the dims first (_check_ranks)
        for dim, size in zip(tensor.shape.dim, dims):
            if size is not None:
                dim.dim_value = size
    return copy, {k: v for k, v in shapes.items() if k not in partial}


def _symbolic_inputs(model, shapes):
    """Input name -> dims (int, or the symbol / "?" where not static) of the data inputs
    with a non-static dimension that ``shapes`` does not fix."""
    initializers = {t.name for t in model.graph.initializer}
    found = {}
    for value in model.graph.input:
        if value.name in initializers or value.name in shapes:
            continue
        tensor = value.type.tensor_type
        if not tensor.HasField("shape"):
            found[value.name] = None
            continue
        dims = [
            d.dim_value if d.HasField("dim_value") else (d.dim_param or "?")
            for d in tensor.shape.dim
        ]
        if any(not isinstance(d, int) for d in dims):
            found[value.name] = dims
    return found


def _error_text(err) -> str:
    """``err``'s message, or its type's name where it has none."""
    return str(err).strip() or type(err).__name__


def _symbolic_error(err, symbolic):
    if isinstance(err, UnsupportedOperatorError):
        cls = UnsupportedOperatorError
    else:
        cls = ValueError
    described = ", ".join(
        f"{name} {tuple(dims) if dims is not None else '(unknown rank)'}"
        for name, dims in symbolic.items()
    )
    example = ", ".join(
        f"{name!r}: ({', '.join(str(d) if isinstance(d, int) else '...' for d in dims or ['...'])})"
        for name, dims in symbolic.items()
    )
    text = _error_text(err)
    message = (
        f"{_COMPONENT}: TVM's ONNX importer failed on a model with symbolic input dimensions "
        f"({described}); TVM does not support every op with symbolic shapes. Pass static "
        f"shapes, e.g. shape_dict={{{example}}} with the '...' filled in. "
        f"The importer said: {type(err).__name__}: {text}"
    )
    if cls is UnsupportedOperatorError:
        return cls(message, err.operators)
    return cls(message)


def graph_inputs(model) -> list[str]:
    """Names of a model's data inputs (graph inputs that are not initializers)."""
    initializers = {t.name for t in model.graph.initializer}
    return [i.name for i in model.graph.input if i.name not in initializers]


def _without_initializer_inputs(onnx, model):
    """``model``, or a copy whose ``graph.input`` no longer lists its initializers.

    Old-IR files (IR version 3, the classic model zoo) and exports with
    ``keep_initializers_as_inputs=True`` list every initializer in ``graph.input`` as well.
    TVM's importer with ``keep_params_in_input=True`` then makes each of them a parameter twice.
    They are weights, so they are imported as params; the caller's model is left unchanged.
    The copy says IR version 4 at least, the first that allows initializers outside
    ``graph.input`` (so that ONNX's checker, which TVM runs, accepts it).
    """
    initializers = {t.name for t in model.graph.initializer}
    if not any(i.name in initializers for i in model.graph.input):
        return model
    stripped = onnx.ModelProto()
    stripped.CopyFrom(model)
    inputs = [i for i in stripped.graph.input if i.name not in initializers]
    del stripped.graph.input[:]
    stripped.graph.input.extend(inputs)
    stripped.ir_version = max(stripped.ir_version, 4)
    return stripped


def read_model(onnx, model):
    """A checked ``onnx.ModelProto`` from a path or a model (ValueError when it is invalid)."""
    where = "the model"
    if isinstance(model, (str, os.PathLike)):
        path = os.fspath(model)
        if os.path.isdir(path):
            raise ValueError(f"{_COMPONENT}: {path!r} is a directory, not an ONNX model file")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{_COMPONENT}: no such model file {path!r}")
        if os.path.getsize(path) == 0:
            raise ValueError(f"{_COMPONENT}: {path!r} is an empty file, not an ONNX model")
        try:
            model = onnx.load(path)  # external data: read from the model's directory
        except Exception as err:  # protobuf raises DecodeError and others
            raise ValueError(f"{_COMPONENT}: {path!r} is not a valid ONNX model: {err}") from err
        where = f"{path!r}"
    elif not isinstance(model, onnx.ModelProto):
        raise TypeError(
            f"{_COMPONENT}: expected a path or an onnx.ModelProto, got {type(model).__name__}"
        )
    else:
        _check_external_data_loaded(onnx, model)
    model = _in_topological_order(onnx, model)
    try:
        onnx.checker.check_model(_checkable(onnx, model))
    except onnx.checker.ValidationError as err:
        raise ValueError(f"{_COMPONENT}: {where} is not a valid ONNX model: {err}") from err
    return model


def _in_topological_order(onnx, model):
    """``model``, or a copy with its nodes in topological order. ONNX requires that order and
    its checker refuses a model without it, but onnxruntime sorts the nodes itself, and tools
    write such models (``onnxruntime.transformers.float16.convert_float_to_float16`` with
    ``keep_io_types``). A model whose nodes cannot be ordered is left to the checker."""
    graph = model.graph
    ready = {"", *(v.name for v in graph.input), *(t.name for t in graph.initializer)}
    order, pending = [], list(graph.node)
    while pending:
        waiting = []
        for node in pending:
            if _reads(node) <= ready:
                order.append(node)
                ready.update(node.output)
            else:
                waiting.append(node)
        if len(waiting) == len(pending):
            return model  # a cycle, or a value nothing produces: the checker names it
        pending = waiting
    if all(a is b for a, b in zip(order, graph.node, strict=True)):
        return model
    sorted_model = onnx.ModelProto()
    sorted_model.CopyFrom(model)
    del sorted_model.graph.node[:]
    sorted_model.graph.node.extend(order)
    return sorted_model


def _reads(node) -> set:
    """The values ``node`` reads: its inputs, and the outer values its subgraphs read."""
    reads = set(node.input)
    for attr in node.attribute:
        for sub in [attr.g] if attr.HasField("g") else list(attr.graphs):
            inner = {v.name for v in sub.input} | {t.name for t in sub.initializer}
            for inner_node in sub.node:
                reads |= _reads(inner_node) - inner
                inner.update(inner_node.output)
    return reads


def _check_external_data_loaded(onnx, model) -> None:
    """Refuse a model whose initializers still point to external files: ONNX resolves their
    paths against the working directory, so another file of the same name there would be read
    as its weights (a model loaded with ``load_external_data=False`` gave an error of 201)."""
    external = [
        t.name
        for t in model.graph.initializer
        if t.data_location == onnx.TensorProto.EXTERNAL and not t.HasField("raw_data")
    ]
    if external:
        named = ", ".join(external[:3]) + (", ..." if len(external) > 3 else "")
        raise ValueError(
            f"{_COMPONENT}: the data of {len(external)} initializers ({named}) is in external "
            "files that were not loaded with the model; pass the model's path, or load it with "
            "onnx.load(path) (which reads them from the model's directory)"
        )


def _checkable(onnx, model):
    """``model``, or one copy of it for ONNX's checker, with

    - an empty shape for graph inputs and outputs without one (unknown rank): the checker
      requires the field, onnxruntime and TVM's importer do not (an input's rank then comes
      from ``shape_dict``);
    - the nodes of :data:`_CONTRIB_IN_ONNX_DOMAIN` below their ONNX version in onnxruntime's
      domain, where the checker takes them as they are (tvmamp converts them by op type).

    A model may hold gigabytes of weights: it is copied at most once."""
    unshaped = {
        v.name
        for v in [*model.graph.input, *model.graph.output]
        if v.type.HasField("tensor_type") and not v.type.tensor_type.HasField("shape")
    }
    contrib = _contrib_in_onnx_domain(default_opset(model))
    moved = any(contrib(n) for n in graph_nodes(model.graph))
    if not unshaped and not moved:
        return model
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    for value in [*copy.graph.input, *copy.graph.output]:
        if value.name in unshaped and value.type.HasField("tensor_type"):
            value.type.tensor_type.shape.SetInParent()
    for node in graph_nodes(copy.graph) if moved else ():
        if contrib(node):
            node.domain = "com.microsoft"
    if moved and not any(o.domain == "com.microsoft" for o in copy.opset_import):
        copy.opset_import.append(onnx.helper.make_opsetid("com.microsoft", 1))
    return copy


# onnxruntime registers some of its contrib ops in ONNX's own domain: op -> the ONNX version
# from which the op is ONNX's (None: never). Its transformer optimiser writes them there
# (LayerNormalization in opset-14 BERT and ViT files, SimplifiedLayerNormalization in T5 and
# LLaMA ones), and ONNX's checker refused them as "No Op registered".
_CONTRIB_IN_ONNX_DOMAIN = {"LayerNormalization": 17, "SimplifiedLayerNormalization": None}


def _contrib_in_onnx_domain(opset: int):
    """Whether a node is one of :data:`_CONTRIB_IN_ONNX_DOMAIN` in a model of ``opset``."""

    def contrib(node) -> bool:
        if not in_default_domain(node) or node.op_type not in _CONTRIB_IN_ONNX_DOMAIN:
            return False
        since = _CONTRIB_IN_ONNX_DOMAIN[node.op_type]
        return since is None or opset < since

    return contrib


# the domains of the ops TVM's importer converts: ONNX's, and onnxruntime's contrib ops that it
# has converters for (Attention, SkipLayerNormalization, FastGelu...)
_DOMAINS = ("", "ai.onnx", "com.microsoft")


def _known(node, known: set) -> bool:
    return node.domain in _DOMAINS and node.op_type in known


def _qualified(node) -> str:
    """``node``'s op type, with its domain where that is not ONNX's."""
    return node.op_type if in_default_domain(node) else f"{node.domain}::{node.op_type}"


def _check_keys(mapping, inputs, what):
    unknown = sorted(set(mapping or {}) - set(inputs))
    if unknown:
        raise ValueError(
            f"{_COMPONENT}: {what} keys {unknown} name no input of the model; "
            f"its inputs are {inputs}"
        )


def _check_ops(model):
    from tvm.relax.frontend.onnx.onnx_frontend import _get_convert_map

    # LSTM, GRU and RNN have no converter: expand_recurrent rewrites them before the import.
    known = set(_get_convert_map()) | {"Constant", "If"} | RECURRENT_OPS | set(ADDED_OPS)
    # TVM's importer reads a node by its op type alone: one in another domain (a custom op
    # named Relu) would be converted as the standard op of that name
    missing = sorted({_qualified(n) for n in graph_nodes(model.graph) if not _known(n, known)})
    if missing:
        raise UnsupportedOperatorError(
            f"{_COMPONENT}: TVM's ONNX importer does not support the operators "
            f"{', '.join(missing)}",
            missing,
        )
    packed = _packed_tensors(model)
    if packed:
        raise UnsupportedOperatorError(
            f"{_COMPONENT}: TVM's ONNX importer cannot read 4-bit tensors: "
            + ", ".join(f"{name!r} ({dtype})" for name, dtype in packed[:3])
            + (", ..." if len(packed) > 3 else ""),
            sorted({dtype for _, dtype in packed}),
        )
    for op, (index, what, computes) in _UNCOMPUTED_OUTPUTS.items():
        nodes = [
            n.name or n.output[0]
            for n in graph_nodes(model.graph)
            if n.op_type == op and len(n.output) > index and n.output[index]
        ]
        if nodes:
            raise UnsupportedOperatorError(
                f"{_COMPONENT}: {op} with {what} (nodes {', '.join(nodes)}) is not supported; "
                f"TVM's importer computes {computes} only",
                [op],
            )


def _packed_tensors(model) -> list:
    """``(name, dtype)`` of the initializers and graph inputs stored two to a byte (INT4,
    UINT4, FLOAT4E2M1): TVM reads them as one value a byte (an INT4 DequantizeLinear failed
    with "TensorCopyFromBytes: size mismatch")."""
    from onnx import TensorProto

    packed = {getattr(TensorProto, n, -1): n for n in ("INT4", "UINT4", "FLOAT4E2M1")}
    graph = model.graph
    found = [(t.name, packed[t.data_type]) for t in graph.initializer if t.data_type in packed]
    found += [
        (v.name, packed[v.type.tensor_type.elem_type])
        for v in graph.input
        if v.type.tensor_type.elem_type in packed
    ]
    return found


# Outputs that TVM's converters do not compute: (index, the output, what they compute). The
# MaxPool converter fails on a graph that names its Indices with an internal assertion.
# (Attention's present key/value cache, a scalar 0 from TVM's converter, is computed by
# tvmamp's: onnx_converters._attention.)
_UNCOMPUTED_OUTPUTS = {
    "MaxPool": (1, "an Indices output", "the pooled values"),
}
