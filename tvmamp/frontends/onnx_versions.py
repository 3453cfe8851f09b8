"""Old versions of ONNX ops that TVM's importer misreads, brought to opset 13 first.

TVM's importer converts each op with the newest converter it has for the model's opset, and
with its oldest one where the opset is older still. Where an op's inputs or meaning changed in
between, that fallback fails or computes something else:

- ``Upsample`` (opsets 7-9): TVM rounds a nearest sample to the nearest source pixel, where
  onnxruntime takes the one below (relative error 0.91 on a 2x upsampling: silently wrong); and
  an ``Upsample-9`` (scales as an input) failed with "object of type 'NoneType' has no len()".
- ``Resize`` at opset 10 (two inputs) failed with "Type <class 'NoneType'> for size is
  currently unsupported", ``Slice`` before opset 10 (bounds as attributes) with "Cannot cast
  <class 'NoneType'> to list of Expr". torch still exports all three at opsets 9 and 10.
- Before opset 7, binary ops broadcast a smaller operand along an ``axis`` attribute; numpy
  broadcasting reads it differently. Before opsets 4-6, ``Concat``, ``Reshape``, ``Cast``,
  ``Tile`` and ``Pad`` took other attributes.

:func:`upgrade_old_ops` converts a model with such a node to opset 13 with
``onnx.version_converter``, whose adapters rewrite them (the other models are left as they
are). Its ``Upsample``/``Resize-10`` to ``Resize-11`` adapter keeps the op's coordinate mapping
implicit, so that ``Resize-13`` would read it as ``half_pixel``: the mapping (``asymmetric``)
and onnxruntime's nearest rounding (floor when enlarging, ceil when shrinking) are written
onto the converted nodes.
"""

from __future__ import annotations

from .common import UnsupportedOperatorError
from .onnx_fold import constant_source, default_opset, in_default_domain

_COMPONENT = "tvmamp.from_onnx"
UPGRADED_OPSET = 13

# op -> the last opset at which TVM misreads it
_MISREAD = {
    "Upsample": 10,
    "Resize": 10,
    "Slice": 9,
    "Concat": 3,
    "Reshape": 4,
    "Cast": 5,
    "Tile": 5,
    "Pad": 1,
}
# ops that broadcast along an ``axis`` attribute before opset 7 (``broadcast=1``)
_LEGACY_BROADCAST = {"Add", "Sub", "Mul", "Div", "Pow", "And", "Or", "Xor", "Equal", "Greater"}
_LEGACY_BROADCAST |= {"Less", "Gemm", "PRelu"}
# ops whose converted Resize needs its coordinate mapping restored
_RESAMPLERS = {"Upsample", "Resize"}


def upgrade_old_ops(onnx, model):
    """``model``, or a copy converted to opset 13 where one of its nodes is an op version that
    TVM's importer misreads (see the module docstring)."""
    opset = default_opset(model)
    old = [n for n in graph_nodes(model.graph) if _misread(n, opset)]
    if not old:
        return model
    mappings = {
        n.output[0]: _resample_attributes(onnx, model, n) for n in old if n.op_type in _RESAMPLERS
    }
    try:
        upgraded = onnx.version_converter.convert_version(model, UPGRADED_OPSET)
    except Exception as err:  # the converter raises RuntimeError, ValidationError...
        ops = sorted({f"{n.op_type} (opset {opset})" for n in old})
        raise UnsupportedOperatorError(
            f"{_COMPONENT}: the model's opset {opset} has op versions TVM's importer misreads "
            f"({', '.join(ops)}), and onnx.version_converter could not bring it to opset "
            f"{UPGRADED_OPSET}: {err}. Export the model at opset {UPGRADED_OPSET} or later.",
            ops,
        ) from err
    for node in graph_nodes(upgraded.graph):
        attrs = mappings.get(node.output[0]) if node.op_type == "Resize" else None
        for name, value in (attrs or {}).items():
            _set_attribute(onnx, node, name, value)
    return upgraded


def graph_nodes(graph):
    """The nodes of ``graph`` and of its subgraphs (``If`` branches, ``Loop`` bodies)."""
    for node in graph.node:
        yield node
        for attr in node.attribute:
            for sub in [attr.g] if attr.HasField("g") else list(attr.graphs):
                yield from graph_nodes(sub)


def _misread(node, opset: int) -> bool:
    if not in_default_domain(node):
        return False
    if opset <= _MISREAD.get(node.op_type, 0):
        return True
    return opset < 7 and node.op_type in _LEGACY_BROADCAST and _attribute(node, "broadcast")


def _attribute(node, name):
    from onnx import helper

    found = [a for a in node.attribute if a.name == name]
    return helper.get_attribute_value(found[0]) if found else None


def _set_attribute(onnx, node, name: str, value: str) -> None:
    kept = [a for a in node.attribute if a.name != name]
    del node.attribute[:]
    node.attribute.extend(kept)
    node.attribute.append(onnx.helper.make_attribute(name, value))


def _resample_attributes(onnx, model, node) -> dict[str, str]:
    """The attributes that make the ``Resize`` converted from ``node`` (an ``Upsample`` or a
    ``Resize-10``) sample as ``node`` does in onnxruntime."""
    attrs = {"coordinate_transformation_mode": "asymmetric"}
    mode = _attribute(node, "mode")
    mode = mode.decode() if isinstance(mode, bytes) else (mode or "nearest")
    if mode != "nearest":
        return attrs
    scales = _scales(onnx, model, node)
    spatial = [s for s in scales[2:] if s != 1.0] if scales is not None else None
    if spatial is None or (any(s > 1 for s in spatial) and any(s < 1 for s in spatial)):
        what = "are not constant" if spatial is None else f"{list(scales)} both enlarge and shrink"
        raise UnsupportedOperatorError(
            f"{_COMPONENT}: {node.op_type} node {node.name or node.output[0]!r} (opset "
            f"{default_opset(model)}, nearest mode): its scales {what}, and onnxruntime's "
            "rounding of such a node is not known to tvmamp. Export the model at opset 11 or "
            "later (a Resize with an explicit nearest_mode).",
            [node.op_type],
        )
    attrs["nearest_mode"] = "ceil" if spatial and spatial[0] < 1 else "floor"
    return attrs


def _scales(onnx, model, node) -> list[float] | None:
    """The constant scales of an ``Upsample`` or ``Resize-10`` node, or None."""
    if node.op_type == "Upsample" and len(node.input) < 2:
        return [float(s) for s in _attribute(node, "scales")]
    name = node.input[1]
    for tensor in model.graph.initializer:
        if tensor.name == name:
            return [float(s) for s in onnx.numpy_helper.to_array(tensor).ravel()]
    for source in model.graph.node:
        found = constant_source(source) if source.op_type == "Constant" else None
        if found is not None and list(source.output) == [name]:
            value = found[1]
            if isinstance(value, onnx.TensorProto):
                value = onnx.numpy_helper.to_array(value)
            return [float(s) for s in value.ravel()]
    return None
