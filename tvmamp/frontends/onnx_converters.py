"""Converters of tvmamp's own: ONNX ops whose optional outputs TVM's importer fills with
placeholders, and onnxruntime contrib ops it has no converter for.

TVM's converters for these ops compute the main output only and return a scalar ``0`` for the
others, so a graph that outputs or reads them gets a wrong value without an error:

* ``LayerNormalization``'s ``Mean`` and ``InvStdDev``. TVM also takes the normalised axes
  from the scale's rank, where ONNX normalises every axis from ``axis`` on and broadcasts the
  scale and bias to them: a scale of shape ``(4,)`` with ``axis=1`` over ``(2, 4, 4)``
  normalised one axis instead of two (error 0.72 against onnxruntime);
* onnxruntime's ``SkipLayerNormalization``, whose fourth output (the sum ``input + skip +
  bias``, which optimised BERT graphs feed to the next layer's residual) TVM does not return,
  and whose optional ``beta`` and ``bias`` it requires;
* ``Dropout``'s ``mask``, which TVM's ``relax.op.nn.dropout`` makes a float tensor (ONNX's is
  ``bool``: a ``Not`` of it failed to import).

The overrides here compute every output, leaving the main one to the same Relax op
(``relax.op.nn.layer_norm``) so that the AMP op lists treat it as before. An output a graph
does not read is never emitted. onnxruntime's transformer optimiser writes ops TVM has no
converter for: its RMSNorms (``SimplifiedLayerNormalization``,
``SkipSimplifiedLayerNormalization``: ``relax.op.nn.rms_norm``, T5 and LLaMA files) and
``QuickGelu`` (``x * sigmoid(alpha * x)``, CLIP); :data:`ADDED_OPS` converts them. All are
installed with the symbolic overrides (:func:`tvmamp.frontends.onnx_symbolic.
symbolic_converters`).
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.sym import Analyzer

from .common import UnsupportedOperatorError
from .onnx_symbolic import constant_input


def _layer_norm_outputs(data, scale, bias, axis: int, epsilon: float, stash_fp32: bool):
    """``(Y, Mean, InvStdDev)`` of ONNX ``LayerNormalization`` over the axes from ``axis``
    on, or None where ``data``'s shape is unknown."""
    ty = data.ty
    if not isinstance(ty, relax.TensorType) or not isinstance(ty.shape, relax.ShapeExpr):
        return None
    dims = list(ty.shape.values)
    axis = axis + len(dims) if axis < 0 else axis
    axes = list(range(axis, len(dims)))
    normalized = relax.ShapeExpr(dims[axis:])
    scale = _broadcast(scale, normalized)
    bias = relax.op.zeros_like(scale) if bias is None else _broadcast(bias, normalized)
    y = relax.op.nn.layer_norm(data, scale, bias, axes, epsilon)
    # Mean and InvStdDev are float32 for a low-precision input with stash_type 1 (the default)
    stats = relax.op.astype(data, "float32") if stash_fp32 else data
    mean = relax.op.mean(stats, axes, keepdims=True)
    eps = relax.const(epsilon, "float32" if stash_fp32 else _dtype(data))
    inv_std = relax.op.rsqrt(relax.op.variance(stats, axes, keepdims=True) + eps)
    return y, mean, inv_std


def _broadcast(value, shape: relax.ShapeExpr):
    """``value`` broadcast to ``shape`` (ONNX's unidirectional broadcasting), where it differs."""
    dims = getattr(value.ty, "shape", None)
    if isinstance(dims, relax.ShapeExpr) and len(dims.values) == len(shape.values):
        analyzer = Analyzer()
        if all(analyzer.can_prove_equal(a, b) for a, b in zip(dims.values, shape.values)):
            return value
    return relax.op.broadcast_to(value, shape)


def _dtype(value) -> str:
    return str(value.ty.dtype)


def _stash_fp32(data, attr) -> bool:
    return int(attr.get("stash_type", 1)) == 1 and _dtype(data) != "float32"


def _layer_norm(bb, inputs, attr, params, fallback):
    outputs = _layer_norm_outputs(
        inputs[0],
        inputs[1],
        inputs[2] if len(inputs) > 2 else None,
        int(attr.get("axis", -1)),
        float(attr.get("epsilon", 1e-5)),
        _stash_fp32(inputs[0], attr),
    )
    return None if outputs is None else relax.Tuple(list(outputs))


def _skip_layer_norm(bb, inputs, attr, params, fallback):
    """onnxruntime's ``SkipLayerNormalization``: ``input + skip (+ bias)``, normalised over
    the last axis; outputs ``Y``, ``Mean``, ``InvStdDev`` and that sum."""
    data, skip, gamma = inputs[:3]
    beta, bias = (inputs[i] if len(inputs) > i else None for i in (3, 4))
    total = relax.op.add(data, skip)
    if bias is not None:
        total = relax.op.add(total, bias)
    total = bb.normalize(total)
    outputs = _layer_norm_outputs(
        total, gamma, beta, -1, float(attr.get("epsilon", 1e-12)), _stash_fp32(data, {})
    )
    return None if outputs is None else relax.Tuple([*outputs, total])


def _rms_norm_outputs(data, scale, axis: int, epsilon: float, stash_fp32: bool):
    """``(Y, InvStdDev)`` of onnxruntime's ``SimplifiedLayerNormalization`` (RMSNorm) over the
    axes from ``axis`` on, or None where ``data``'s shape is unknown."""
    ty = data.ty
    if not isinstance(ty, relax.TensorType) or not isinstance(ty.shape, relax.ShapeExpr):
        return None
    dims = list(ty.shape.values)
    axis = axis + len(dims) if axis < 0 else axis
    axes = list(range(axis, len(dims)))
    scale = _broadcast(scale, relax.ShapeExpr(dims[axis:]))
    y = relax.op.nn.rms_norm(data, scale, axes, epsilon)
    stats = relax.op.astype(data, "float32") if stash_fp32 else data
    eps = relax.const(epsilon, "float32" if stash_fp32 else _dtype(data))
    two = relax.const(2.0, "float32" if stash_fp32 else _dtype(data))
    squares = relax.op.mean(relax.op.power(stats, two), axes, keepdims=True)
    return y, relax.op.rsqrt(squares + eps)


def _simplified_layer_norm(bb, inputs, attr, params, fallback):
    """onnxruntime's ``SimplifiedLayerNormalization`` (RMSNorm, T5 and LLaMA files): outputs
    ``Y`` and ``InvStdDev``."""
    outputs = _rms_norm_outputs(
        inputs[0],
        inputs[1],
        int(attr.get("axis", -1)),
        float(attr.get("epsilon", 1e-5)),
        _stash_fp32(inputs[0], attr),
    )
    return None if outputs is None else relax.Tuple(list(outputs))


def _skip_simplified_layer_norm(bb, inputs, attr, params, fallback):
    """onnxruntime's ``SkipSimplifiedLayerNormalization``: ``input + skip (+ bias)``, RMS-
    normalised over the last axis; outputs ``Y``, ``Mean`` (of the sum), ``InvStdDev`` and the
    sum."""
    data, skip, gamma = inputs[:3]
    bias = inputs[3] if len(inputs) > 3 else None
    total = relax.op.add(data, skip)
    if bias is not None:
        total = relax.op.add(total, bias)
    total = bb.normalize(total)
    outputs = _rms_norm_outputs(
        total, gamma, -1, float(attr.get("epsilon", 1e-12)), _stash_fp32(data, {})
    )
    if outputs is None:
        return None
    y, inv_std = outputs
    return relax.Tuple([y, relax.op.mean(total, [-1], keepdims=True), inv_std, total])


def _quick_gelu(bb, inputs, attr, params, fallback):
    """onnxruntime's ``QuickGelu``: ``x * sigmoid(alpha * x)``, alpha 1.702 by default."""
    data = inputs[0]
    alpha = relax.const(float(attr.get("alpha", 1.702)), _dtype(data))
    return relax.op.multiply(data, relax.op.sigmoid(relax.op.multiply(data, alpha)))


def _dropout(bb, inputs, attr, params, fallback):
    """``Dropout`` at inference: the input, and a ``bool`` mask of ones. A node in training
    mode with a non-zero ratio drops values at random at run time, which a compiled inference
    model does not reproduce: refused."""
    data = inputs[0]
    training = constant_input(params, inputs, 2)
    if training is not None:
        constant = isinstance(training, tvm.ir.GenericConst)
        if not constant or bool(training.value.numpy().reshape(-1)[0]):
            ratio = constant_input(params, inputs, 1)
            constant = isinstance(ratio, tvm.ir.GenericConst)
            if ratio is None or not constant or float(ratio.value.numpy().reshape(-1)[0]) != 0:
                raise UnsupportedOperatorError(
                    "tvmamp.from_onnx: Dropout with training_mode set (or computed at run time) "
                    "drops values at random; export the model in eval mode",
                    ["Dropout"],
                )
    mask = relax.op.full_like(data, relax.const(True, "bool"), dtype="bool")
    return relax.Tuple([data, mask])


OVERRIDES = {
    "LayerNormalization": _layer_norm,
    "SkipLayerNormalization": _skip_layer_norm,
    "Dropout": _dropout,
}
# Ops TVM's importer has no converter for, converted here alone.
ADDED_OPS = {
    "SimplifiedLayerNormalization": _simplified_layer_norm,
    "SkipSimplifiedLayerNormalization": _skip_simplified_layer_norm,
    "QuickGelu": _quick_gelu,
}
