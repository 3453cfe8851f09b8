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
``QuickGelu`` (``x * sigmoid(alpha * x)``, CLIP); :data:`ADDED_OPS` converts them. Its
fused ``Attention`` and ``EmbedLayerNormalization``, the default output of its BERT optimiser,
are converted here too: TVM's converters take static shapes only and few mask forms, and no
key/value cache (the ``past`` and ``present`` of its GPT-2 decoders). All are
installed with the symbolic overrides (:func:`tvmamp.frontends.onnx_symbolic.
symbolic_converters`).
"""

from __future__ import annotations

import numpy as np
import tvm
import tvm_ffi
from tvm import relax
from tvm.sym import Analyzer

from .common import UnsupportedOperatorError
from .onnx_symbolic import constant_input


def _optional(inputs, count: int) -> list:
    """``inputs`` padded with None to ``count`` (absent trailing optional inputs)."""
    return [inputs[i] if len(inputs) > i else None for i in range(count)]


def _norm_axes(data, axis: int):
    """``(axes, normalised shape)`` of a norm over the axes of ``data`` from ``axis`` on, or
    None where ``data``'s shape is unknown."""
    ty = data.ty
    if not isinstance(ty, relax.TensorType) or not isinstance(ty.shape, relax.ShapeExpr):
        return None
    dims = list(ty.shape.values)
    axis = axis + len(dims) if axis < 0 else axis
    return list(range(axis, len(dims))), relax.ShapeExpr(dims[axis:])


def _statistics(data, stash_fp32: bool):
    """``(data, its dtype)``, in fp32 for a low-precision input with stash_type 1 (the
    default): Mean and InvStdDev are float32 then."""
    if stash_fp32:
        return relax.op.astype(data, "float32"), "float32"
    return data, _dtype(data)


def _layer_norm_outputs(data, scale, bias, axis: int, epsilon: float, stash_fp32: bool):
    """``(Y, Mean, InvStdDev)`` of ONNX ``LayerNormalization`` over the axes from ``axis``
    on, or None where ``data``'s shape is unknown."""
    found = _norm_axes(data, axis)
    if found is None:
        return None
    axes, normalized = found
    scale = _broadcast(scale, normalized)
    bias = relax.op.zeros_like(scale) if bias is None else _broadcast(bias, normalized)
    y = relax.op.nn.layer_norm(data, scale, bias, axes, epsilon)
    stats, dtype = _statistics(data, stash_fp32)
    mean = relax.op.mean(stats, axes, keepdims=True)
    eps = relax.const(epsilon, dtype)
    inv_std = relax.op.rsqrt(relax.op.variance(stats, axes, keepdims=True) + eps)
    return y, mean, inv_std


def _rms_norm_outputs(data, scale, axis: int, epsilon: float, stash_fp32: bool):
    """``(Y, InvStdDev)`` of onnxruntime's ``SimplifiedLayerNormalization`` (RMSNorm) over the
    axes from ``axis`` on, or None where ``data``'s shape is unknown."""
    found = _norm_axes(data, axis)
    if found is None:
        return None
    axes, normalized = found
    y = relax.op.nn.rms_norm(data, _broadcast(scale, normalized), axes, epsilon)
    stats, dtype = _statistics(data, stash_fp32)
    squares = relax.op.power(stats, relax.const(2.0, dtype))
    mean_square = relax.op.mean(squares, axes, keepdims=True)
    return y, relax.op.rsqrt(mean_square + relax.const(epsilon, dtype))


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


def _skip_sum(bb, data, skip, bias):
    """``data + skip (+ bias)``, bound: the residual sum of the skip norms (their last output)."""
    total = relax.op.add(data, skip)
    return bb.normalize(total if bias is None else relax.op.add(total, bias))


def _layer_norm(bb, inputs, attr, params, fallback):
    data, scale, bias = _optional(inputs, 3)
    axis, epsilon = int(attr.get("axis", -1)), float(attr.get("epsilon", 1e-5))
    outputs = _layer_norm_outputs(data, scale, bias, axis, epsilon, _stash_fp32(data, attr))
    return None if outputs is None else relax.Tuple(list(outputs))


def _skip_layer_norm(bb, inputs, attr, params, fallback):
    """onnxruntime's ``SkipLayerNormalization``: ``input + skip (+ bias)``, normalised over
    the last axis; outputs ``Y``, ``Mean``, ``InvStdDev`` and that sum."""
    data, skip, gamma, beta, bias = _optional(inputs, 5)
    total = _skip_sum(bb, data, skip, bias)
    epsilon = float(attr.get("epsilon", 1e-12))
    outputs = _layer_norm_outputs(total, gamma, beta, -1, epsilon, _stash_fp32(data, {}))
    return None if outputs is None else relax.Tuple([*outputs, total])


def _simplified_layer_norm(bb, inputs, attr, params, fallback):
    """onnxruntime's ``SimplifiedLayerNormalization`` (RMSNorm, T5 and LLaMA files): outputs
    ``Y`` and ``InvStdDev``."""
    data, scale = inputs[:2]
    axis, epsilon = int(attr.get("axis", -1)), float(attr.get("epsilon", 1e-5))
    outputs = _rms_norm_outputs(data, scale, axis, epsilon, _stash_fp32(data, attr))
    return None if outputs is None else relax.Tuple(list(outputs))


def _skip_simplified_layer_norm(bb, inputs, attr, params, fallback):
    """onnxruntime's ``SkipSimplifiedLayerNormalization``: ``input + skip (+ bias)``, RMS-
    normalised over the last axis; outputs ``Y``, ``Mean`` (zeros, as onnxruntime has it: an
    RMSNorm has none), ``InvStdDev`` (float32) and the sum."""
    data, skip, gamma, bias = _optional(inputs, 4)
    total = _skip_sum(bb, data, skip, bias)
    epsilon = float(attr.get("epsilon", 1e-12))
    outputs = _rms_norm_outputs(total, gamma, -1, epsilon, _stash_fp32(data, {}))
    if outputs is None:
        return None
    y, inv_std = outputs
    inv_std = relax.op.astype(inv_std, "float32")
    return relax.Tuple([y, relax.op.zeros_like(inv_std), inv_std, total])


def _attention(bb, inputs, attr, params, fallback):
    """onnxruntime's fused ``Attention`` (its BERT and GPT-2 optimisers' output): the QKV
    projection, the heads, and ``relax.nn.attention`` over a mask of any of the forms the
    optimisers write, causal or not, with the key/value cache of its GPT-2 decoders (TVM's
    converter took a 2-D or 3-D mask with an attention bias only, static shapes only, and no
    cache: a 1-D ``mask_index`` of sequence ends failed with "mask index should be in shape of
    (batch_size, seq_len)", a raw 2-D mask alone with "The bias should have 4 dimensions", and
    the ``present`` output was a scalar 0). ``past`` ``(2, batch, heads, past, head_size)``
    holds the keys and values of the earlier positions; ``present`` is it with the new ones
    appended, and the queries see all of them (the causal mask shifted by ``past``).

    Rotary embeddings, a shared past/present buffer, and a 4-D or ``(2 * batch,)`` mask are
    left to TVM's converter, which refuses them: every None returned here is an error there,
    never its placeholder ``present``."""
    if "do_rotary" in attr or "past_present_share_buffer" in attr:
        return None
    data, weight, bias, mask, past, attention_bias, past_length = _optional(inputs, 7)
    dims, sizes = (getattr(x.ty, "shape", None) for x in (data, weight))
    if past_length is not None or not all(isinstance(d, relax.ShapeExpr) for d in (dims, sizes)):
        return None
    batch, seq, _ = dims.values
    heads = int(attr["num_heads"])
    hidden, hidden_v = _qkv_sizes(attr, int(sizes.values[1]))
    earlier = _past_length(past, hidden, hidden_v)
    if hidden % heads or hidden_v % heads or earlier is None or not _mask_handled(mask, batch):
        return None
    if hidden != hidden_v and attr.get("tvm_custom", {}).get("num_outputs", 1) > 1:
        raise UnsupportedOperatorError(
            f"tvmamp.from_onnx: Attention with qkv_hidden_sizes whose keys ({hidden}) and values "
            f"({hidden_v}) differ, and a present output: the key-value cache is supported for "
            "keys and values of one size",
            ["Attention"],
        )
    q, k, v = _heads(bb, data, weight, bias, (hidden, hidden_v), heads)
    total = Analyzer().simplify(seq + earlier)
    k, v, present = _with_cache(bb, past, k, v, total) if hidden == hidden_v else (k, v, None)
    k, v = (_match_dim(bb, x, 1, total) for x in (k, v))
    static = all(isinstance(d, tvm.tirx.IntImm) for d in (batch, seq, total))
    causal = bool(int(attr.get("unidirectional", 0)))
    masks, lengths = (mask, attention_bias), (batch, seq, total)
    scores_bias = _scores_bias(bb, attr, masks, lengths, causal and not static)
    scale = float(attr["scale"]) if "scale" in attr else None
    # static lengths: a constant mask; the last query is the last key (sees past + i keys)
    mask_kind = ("TopLeft" if past is None else "BottomRight") if causal and static else None
    out = relax.op.nn.attention(q, k, v, scores_bias, scale=scale, causal_mask=mask_kind)
    out = relax.op.reshape(out, [batch, seq, hidden_v])
    return out if present is None else relax.Tuple([out, present])


def _past_length(past, hidden: int, hidden_v: int):
    """The number of cached positions in ``past`` (0 without one), or None for a cache of
    unknown shape or beside keys and values of different sizes."""
    if past is None:
        return tvm.tirx.IntImm("int64", 0)
    dims = getattr(past.ty, "shape", None)
    if not isinstance(dims, relax.ShapeExpr) or len(dims.values) != 5 or hidden != hidden_v:
        return None
    return dims.values[3]


def _mask_handled(mask, batch) -> bool:
    """Whether ``mask`` is absent or of a form :func:`_mask_bias` reads: 1-D of ``batch``
    sequence ends (not ``(2 * batch,)``: ends and starts), 2-D or 3-D of ones and zeros."""
    dims = getattr(mask.ty, "shape", None) if mask is not None else None
    if mask is None or not isinstance(dims, relax.ShapeExpr):
        return mask is None
    rank = len(dims.values)
    return rank in (2, 3) or rank == 1 and Analyzer().can_prove_equal(dims.values[0], batch)


def _heads(bb, data, weight, bias, sizes: tuple[int, int], heads: int):
    """Q, K and V of ``data`` projected by ``weight`` (and ``bias``), each
    ``(batch, seq, heads, head_size)``."""
    batch, seq, _ = data.ty.shape.values
    hidden, hidden_v = sizes
    qkv = relax.op.matmul(data, weight)
    if bias is not None:
        qkv = relax.op.add(qkv, bias)
    qkv = bb.normalize(qkv)
    bounds = ((0, hidden), (hidden, 2 * hidden), (2 * hidden, 2 * hidden + hidden_v))
    q, k, v = (bb.normalize(relax.op.strided_slice(qkv, [2], [b], [e])) for b, e in bounds)
    q, k = (relax.op.reshape(x, [batch, seq, heads, hidden // heads]) for x in (q, k))
    return q, k, relax.op.reshape(v, [batch, seq, heads, hidden_v // heads])


def _with_cache(bb, past, k, v, total):
    """The keys and values of the cached and the new positions, each ``(batch, total, heads,
    head_size)``, and the ``present`` cache ``(2, batch, heads, total, head_size)``: ``past``
    followed by the new keys and values ``k``, ``v`` (``(batch, seq, heads, head_size)``).
    Without ``past``, ``k``, ``v`` and their ``present``.

    The attention reads its keys and values from ``present`` (views of it, permuted back to
    ``(batch, total, heads, head_size)``, which ``DecomposeAttention`` composes with its own
    permutation): one concatenation per step. Concatenating the cached keys and values again
    for the attention cost a GPT-2 decoder (4 layers of 768, 512 cached positions, O2) two
    slices and a concatenation per layer, 0.3 of 4.0 ms."""
    new = relax.op.stack([relax.op.permute_dims(x, [0, 2, 1, 3]) for x in (k, v)], axis=0)
    if past is None:
        return k, v, new  # present: emitted only where the graph reads it
    present = _match_dim(bb, relax.op.concat([past, new], axis=3), 3, total)
    halves = [relax.op.strided_slice(present, [0], [i], [i + 1]) for i in (0, 1)]
    k, v = (relax.op.permute_dims(relax.op.squeeze(x, [0]), [0, 2, 1, 3]) for x in halves)
    return k, v, present


def _match_dim(bb, value, axis: int, dim):
    """``value`` whose dim ``axis`` is written ``dim``: a reshape where TVM proves them equal
    but they are written otherwise, a ``match_cast`` (checked at run time) where it cannot.
    FuseTIR matches shapes term by term: keys of ``6 + seq`` (a concat's) beside scores of
    ``seq + 6`` failed it ("Parameter expression T.int64(6) expected an integer argument with
    value 6"). A reshape to the same shape is a view, and keeps the value's dtype at O1-O3 (a
    match_cast to float32 made a bf16 value fp32 again)."""
    value = bb.normalize(value)
    dims = list(value.ty.shape.values)
    if tvm_ffi.structural_equal(dims[axis], dim):
        return value
    proven = Analyzer().can_prove_equal(dims[axis], dim)
    dims[axis] = dim
    if proven:
        return relax.op.reshape(value, dims)
    return bb.match_cast(value, relax.TensorType(dims, value.ty.dtype))


def _scores_bias(bb, attr, masks, lengths, symbolic_causal: bool):
    """The fp32 bias added to the scores ``(batch, heads, seq, total)``: that of the mask (as
    :func:`_mask_bias`) and of the causal mask over symbolic lengths (:func:`_causal_bias`),
    and the ``attention_bias`` input, summed; None for none."""
    mask, attention_bias = masks
    _, seq, total = lengths
    filter_value = float(attr.get("mask_filter_value", -10000.0))
    bias = None if mask is None else _mask_bias(bb, mask, lengths, filter_value)
    if symbolic_causal:
        bias = _added(bias, _causal_bias(seq, total))
    if attention_bias is not None:  # in the model's dtype (fp16 after onnxruntime's converter)
        bias = _added(bias, relax.op.astype(attention_bias, "float32"))
    return bias


def _added(total, term):
    return term if total is None else relax.op.add(total, term)


def _causal_bias(seq, total):
    """``(1, 1, seq, total)``: 0 where query ``i`` may see key ``j`` (``j <= total - seq +
    i``), -inf elsewhere (onnxruntime sets the lowest float there: no weight either way)."""
    first = Analyzer().simplify(total - seq)  # past: (seq + 6) - seq failed at run time
    queries = relax.op.reshape(relax.op.arange(first, total, dtype="int64"), [seq, 1])
    keys = relax.op.reshape(relax.op.arange(0, total, dtype="int64"), [1, total])
    visible = relax.op.less_equal(keys, queries)
    hidden = relax.op.where(visible, relax.const(0.0, "float32"), relax.const(-np.inf, "float32"))
    return relax.op.reshape(hidden, [1, 1, seq, total])


def _embed_layer_norm(bb, inputs, attr, params, fallback):
    """onnxruntime's ``EmbedLayerNormalization``: word, position (and segment) embeddings
    added, layer-normalised; outputs ``output``, ``mask_index`` (the mask's sum per sequence,
    int32) and ``embedding_sum``. TVM's converter needs static shapes ("'Var' object has no
    attribute 'value'" under a dynamic batch or length) and returns no ``embedding_sum``."""
    ids, segments, words, positions, segment_table, gamma, beta, mask, position_ids = _optional(
        inputs, 9
    )
    dims = getattr(ids.ty, "shape", None)
    if not isinstance(dims, relax.ShapeExpr) or (segments is None) != (segment_table is None):
        return None
    batch, seq = dims.values
    if position_ids is None:
        steps = relax.op.arange(0, seq, dtype="int64")
        position_ids = relax.op.broadcast_to(relax.op.reshape(steps, [1, seq]), [batch, seq])
    total = relax.op.add(
        relax.op.take(words, ids, axis=0), relax.op.take(positions, position_ids, axis=0)
    )
    if segments is not None:
        total = relax.op.add(total, relax.op.take(segment_table, segments, axis=0))
    total = bb.normalize(total)
    normed = relax.op.nn.layer_norm(total, gamma, beta, [-1], float(attr.get("epsilon", 1e-12)))
    if mask is None:
        mask_index = relax.op.zeros([batch], "int32")
    else:
        mask_index = relax.op.astype(relax.op.sum(mask, axis=[1]), "int32")
    return relax.Tuple([normed, mask_index, total])


def _qkv_sizes(attr, total: int) -> tuple[int, int]:
    """The hidden size of Q (and K) and of V."""
    if "qkv_hidden_sizes" in attr:
        q, _, v = (int(x) for x in attr["qkv_hidden_sizes"])
        return q, v
    return total // 3, total // 3


def _mask_bias(bb, mask, lengths, filter_value: float):
    """The fp32 scores bias ``(1 - visible) * filter_value`` of an ``Attention`` mask over
    ``total`` keys (the cached ones first), shaped ``(batch, 1, 1 or seq, total)``: a 1-D mask
    holds each sequence's end, a 2-D or 3-D one is 1 where a key is visible
    (:func:`_mask_handled`)."""
    batch, seq, total = lengths
    rank = len(mask.ty.shape.values)
    if rank == 1:
        keys = relax.op.arange(0, total, dtype=_dtype(mask))
        visible = relax.op.less(relax.op.reshape(keys, [1, total]), relax.op.reshape(mask, [-1, 1]))
    else:  # the model's name for the keys' count (total_seq) is past + seq
        visible = _match_dim(bb, mask, rank - 1, total)
    hidden = relax.op.subtract(relax.const(1.0, "float32"), relax.op.astype(visible, "float32"))
    shape = [batch, 1, 1, total] if rank in (1, 2) else [batch, 1, seq, total]
    return relax.op.reshape(relax.op.multiply(hidden, relax.const(filter_value, "float32")), shape)


def _quick_gelu(bb, inputs, attr, params, fallback):
    """onnxruntime's ``QuickGelu``: ``x * sigmoid(alpha * x)``, alpha 1.702 by default."""
    data = inputs[0]
    alpha = relax.const(float(attr.get("alpha", 1.702)), _dtype(data))
    return relax.op.multiply(data, relax.op.sigmoid(relax.op.multiply(data, alpha)))


def _dropout(bb, inputs, attr, params, fallback, opset: int):
    """``Dropout`` at inference: the input, and its mask (``bool`` True from opset 10; before,
    zeros of the input's dtype, as onnxruntime gives them). A node in training mode with a
    non-zero ratio drops values at random at run time, which a compiled inference model does
    not reproduce: refused."""
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
    # onnxruntime, measured: Dropout-10 and later give True (kept), Dropout-7 to 9 give 0.0
    fill = relax.const(True, "bool") if opset >= 10 else relax.const(0, _dtype(data))
    mask = relax.op.full_like(data, fill, dtype=str(fill.ty.dtype))
    return relax.Tuple([data, mask])


OVERRIDES = {
    "Attention": _attention,
    "EmbedLayerNormalization": _embed_layer_norm,
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
