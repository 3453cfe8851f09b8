"""DecomposeAttention: ``relax.nn.attention`` as the GEMMs and the softmax it stands for.

TVM legalizes ``relax.nn.attention`` (onnxruntime's fused ``Attention`` and
``MultiHeadAttention`` import as it) into one TE function of two batch matmuls, a scale, a bias
and a softmax. No CPU rule schedules such a kernel well: a 2-layer BERT file optimised by
onnxruntime spent 80 % of its time there at 2 % of peak, 3x onnxruntime's time. In bf16 its
batch matmuls also add up in bf16. Written out, the parts take the bf16 GEMM kernels, the
merged scores-and-softmax kernel (:mod:`.gemm_softmax`) and the padded keys
(:mod:`.attention_keys`), as attention written out by Hugging Face models does::

    attention(q, k, v, bias)                s = matmul(permute(q), permute(k), out fp32)
    q: [B, S, H, D]               ->        p = softmax(s * scale (+ bias) (causal: -inf above))
    k, v: [B, T, H, D]                      o = permute(matmul(astype(p), permute(v), out fp32))

The scores, their softmax and the GEMMs' sums are fp32, the inputs and the output keep their
dtype. A causal mask needs static lengths (a constant mask); a sliding window is left to TVM.

With one query (a decoder's step, :mod:`.decode_step`) the two GEMMs are written as products
summed over the head dim and over the keys (:func:`_dots`): ``FuseOps`` fuses the key-value
cache's slices and casts into those kernels, which read the cache in place, where a GEMM's
operands were copies (the keys' a transposed one) packed again in the kernel. One query's
attention already written out as matmuls (optimum's and torch.export's decoders) is rewritten
the same way (:func:`_one_query_matmul`).
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax
from tvm.ir.expr import Constant
from tvm.relax import PyExprMutator

from tvmamp.tensors import shape_dims, static_shape, tensor_dtype

_ATTENTION = {tvm.ir.Op.get("relax.nn.attention"), tvm.ir.Op.get("relax.nn.attention_bias")}


@tvm.transform.module_pass(opt_level=0, name="tvmamp.DecomposeAttention")
class DecomposeAttention:
    """Replace ``relax.nn.attention`` by its GEMMs and softmax."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        """Rewrite every Relax function of ``mod``."""
        rewriter = _Rewriter(mod)
        for gvar, func in mod.functions_items():
            if isinstance(func, relax.Function):
                rewriter.builder_.update_func(gvar, rewriter.visit_expr(func))
        return rewriter.builder_.get()


@relax.expr_functor.mutator
class _Rewriter(PyExprMutator):
    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = self.visit_expr_post_order(call)
        if call.op.same_as(_MATMUL):
            dots = _one_query_matmul(call, self.lookup_binding)
            return call if dots is None else dots
        if not any(call.op.same_as(op) for op in _ATTENTION):
            return call
        written = _written_out(call, self.lookup_binding)
        return call if written is None else written


def _one_query_matmul(call: relax.Call, lookup) -> relax.Expr | None:
    """One query's attention written out as matmuls, as the products of :func:`_dots`; None
    for any other matmul.

    - The scores ``q[..., 1, d] @ permute(k)[..., d, T]`` (a cast and a scalar factor on the
      way allowed) become products summed over ``d`` of ``k[..., T, d]`` itself. Exported
      decoders (optimum's, torch.export's) transpose the whole key cache for this matmul, and
      scale it, or cast it at O2: a kernel that wrote every key again on every step, before the
      GEMM packed them once more.
    - The weighed values ``p[..., 1, T] @ v[..., T, d]``, ``p`` a softmax's output or ``v`` a
      cast over a symbolic ``T`` (optimum's GPT-2 guards ``p`` against NaN), become products
      summed over ``T``, so a cast of the values (O2) fuses into the kernel that reads them.

    The products and sums are fp32 whatever the operands' dtype (exact products of bf16 values;
    the matmul's own sums are fp32 too), and the result takes the matmul's dtype."""
    a, b = call.args
    shape = shape_dims(a.ty)
    if isinstance(a, Constant) or shape is None or len(shape) < 3 or not _is_one(shape[-2]):
        return None
    if isinstance(b, Constant) or getattr(b.ty, "ndim", -1) != len(shape):
        return None
    ndim = len(shape)
    keys, scale = _transposed_keys(b, ndim, lookup)
    if keys is not None:
        out = _dots(a, keys, ndim - 1)  # [..., T]
        if scale is not None:
            out = relax.op.multiply(out, relax.op.astype(scale, "float32"))
    elif _is_probabilities(a, lookup) or _cast_of_rows(b, ndim, lookup):
        weights = relax.op.permute_dims(a, [*range(ndim - 2), ndim - 1, ndim - 2])
        out = _dots(weights, _uncast(b, lookup), ndim - 2)  # [..., d]
    else:
        return None
    out = relax.op.expand_dims(out, ndim - 2)
    dtype = tensor_dtype(call)
    return out if dtype == "float32" else relax.op.astype(out, dtype)


def _transposed_keys(b: relax.Expr, ndim: int, lookup) -> tuple:
    """``(k, scale)`` where ``b`` is ``permute(k)`` over its last two axes, with a cast before
    or after and a scalar constant factor allowed (``scale`` that factor, or None); else
    ``(None, None)``. A cast is dropped: :func:`_dots` reads ``k`` in fp32."""
    value, scale = _value(b, lookup), None
    if isinstance(value, relax.Call) and value.op.same_as(_MULTIPLY):
        scale = next((x for x in value.args if _is_scalar(x)), None)
        rest = [x for x in value.args if x is not scale]
        value = _value(rest[0], lookup) if scale is not None else None
    if isinstance(value, relax.Call) and value.op.same_as(_ASTYPE):
        value = _value(value.args[0], lookup)
    swapped = [*range(ndim - 2), ndim - 1, ndim - 2]
    if not (isinstance(value, relax.Call) and value.op.same_as(_PERMUTE_DIMS)):
        return None, None
    axes = value.attrs.axes
    if axes is None or [int(x) for x in axes] != swapped or isinstance(value.args[0], Constant):
        return None, None
    return _uncast(value.args[0], lookup), scale


def _value(x: relax.Expr, lookup):
    """The call bound to ``x``, or ``x`` where it is not a bound var."""
    bound = lookup(x) if isinstance(x, relax.Var) else None
    return bound if bound is not None else x


def _uncast(x: relax.Expr, lookup) -> relax.Expr:
    """The input of the cast bound to ``x``, or ``x``."""
    value = lookup(x) if isinstance(x, relax.Var) else None
    if isinstance(value, relax.Call) and value.op.same_as(_ASTYPE):
        return value.args[0]
    return x


def _is_probabilities(x: relax.Expr, lookup) -> bool:
    """Whether ``x`` is a softmax's output, cast or not."""
    value = _value(x, lookup)
    if isinstance(value, relax.Call) and value.op.same_as(_ASTYPE):
        value = _value(value.args[0], lookup)
    return isinstance(value, relax.Call) and value.op.same_as(_SOFTMAX)


def _cast_of_rows(b: relax.Expr, ndim: int, lookup) -> bool:
    """Whether ``b`` is a cast of a tensor whose rows (axis ``ndim - 2``) are symbolic."""
    value = _value(b, lookup)
    shape = getattr(b.ty, "shape", None)
    rows = shape.values[ndim - 2] if isinstance(shape, relax.ShapeExpr) else None
    cast = isinstance(value, relax.Call) and value.op.same_as(_ASTYPE)
    return cast and rows is not None and not isinstance(rows, tvm.tirx.IntImm)


def _is_one(dim) -> bool:
    return isinstance(dim, int) and dim == 1


def _is_scalar(x: relax.Expr) -> bool:
    """Whether ``x`` is a constant of one value (a scale)."""
    shape = static_shape(x.ty) if isinstance(x, Constant) else None
    return shape is not None and int(np.prod(shape, dtype=np.int64)) == 1


def _written_out(call: relax.Call, lookup) -> relax.Expr | None:
    """The ops ``call`` stands for, or None where it is left to TVM. ``lookup(var)``: the
    value bound to ``var``, or None (a permuted operand's permutation is composed with the
    decomposition's own, :func:`_permuted`)."""
    attrs = call.attrs
    if attrs.window_size is not None:
        return None
    q, k, v = call.args[:3]
    bias = call.args[3] if len(call.args) > 3 else None
    dims = [getattr(x.ty, "shape", None) for x in (q, k, v)]
    if any(not isinstance(d, relax.ShapeExpr) or len(d.values) != 4 for d in dims):
        return None
    head_dim = dims[0].values[3]
    if attrs.scale is not None:
        scale = float(attrs.scale.value)
    elif isinstance(head_dim, tvm.tirx.IntImm):
        scale = 1.0 / float(np.sqrt(int(head_dim)))
    else:
        return None
    causal = attrs.causal_mask
    if causal == "BottomRight" and _one_query(q):
        causal = None  # the last query sees every key
    if causal is not None and (static_shape(q.ty) is None or static_shape(k.ty) is None):
        return None
    dtype = tensor_dtype(q)
    low = dtype != "float32"
    out_dtype = "float32"
    one = _one_query(q) and causal is None
    if one:
        scores = _dots(_permuted(q, [0, 2, 1, 3], lookup), _permuted(k, [0, 2, 1, 3], lookup), 3)
        scores = relax.op.expand_dims(scores, 2)  # [B, H, 1, T], as the matmul's
    else:
        scores = relax.op.matmul(
            _permuted(q, [0, 2, 1, 3], lookup),
            _permuted(k, [0, 2, 3, 1], lookup),
            out_dtype=out_dtype,
        )
    scores = relax.op.multiply(scores, relax.const(scale, "float32"))
    if bias is not None:
        bias = relax.op.astype(bias, "float32") if tensor_dtype(bias) != "float32" else bias
        scores = relax.op.add(scores, bias)
    if causal is not None:
        scores = relax.op.add(scores, _causal_mask(q, k, causal))
    probs = relax.op.nn.softmax(scores, axis=-1)
    if low:
        probs = relax.op.astype(probs, dtype)
    if one:  # [B, H, 1, T] -> [B, H, T, 1], times the values [B, H, T, D], summed over T
        weights = relax.op.permute_dims(probs, [0, 1, 3, 2])
        out = _dots(weights, _permuted(v, [0, 2, 1, 3], lookup), 2)
        out = relax.op.expand_dims(out, 2)
    else:
        out = relax.op.matmul(probs, _permuted(v, [0, 2, 1, 3], lookup), out_dtype=out_dtype)
    if low:
        out = relax.op.astype(out, dtype)
    return relax.op.permute_dims(out, [0, 2, 1, 3])


def _one_query(q: relax.Expr) -> bool:
    """Whether ``q`` (``[batch, queries, heads, dim]``) holds one query: a decoder's step
    (``relay_passes/decode_step.py`` builds one for a symbolic query length)."""
    queries = q.ty.shape.values[1]
    return isinstance(queries, tvm.tirx.IntImm) and queries.value == 1


def _dots(a: relax.Expr, b: relax.Expr, axis: int) -> relax.Expr:
    """``sum(a * b, axis)`` in fp32: for one query, its scores against the keys (``axis`` 3,
    the head dim) or its values weighed by its probabilities (``axis`` 2, the keys).

    Written as a product and a sum, not a matmul, ``FuseOps`` fuses the cache's slices, casts
    and (composed away) permutations into the kernel, which reads the cache in place: a
    matmul's operands are kernels of their own, the keys' a transposed copy. The products of
    low inputs are exact in fp32, and add up in fp32, as in the matmul with ``out_dtype``."""
    if tensor_dtype(a) != "float32":
        a = relax.op.astype(a, "float32")
    if tensor_dtype(b) != "float32":
        b = relax.op.astype(b, "float32")
    return relax.op.sum(relax.op.multiply(a, b), axis=[axis])


def _permuted(x: relax.Expr, axes: list[int], lookup) -> relax.Expr:
    """``permute_dims(x, axes)``, composed with ``x``'s own permutation where ``x`` is bound to
    one (a key-value cache read as ``(batch, heads, total, head_size)`` and permuted to
    attention's ``(batch, total, heads, head_size)``): the values then take one permutation,
    or none, instead of two copies. A cast between the two (AMP's low copy of an fp32 cache,
    ``relay_passes/auto_mixed_precision.py``) is moved after the composed permutation."""
    value = lookup(x) if isinstance(x, relax.Var) else None
    dtype = None
    if isinstance(value, relax.Call) and value.op.same_as(_ASTYPE):
        cast_of = value.args[0]
        inner = lookup(cast_of) if isinstance(cast_of, relax.Var) else None
        if isinstance(inner, relax.Call) and inner.op.same_as(_PERMUTE_DIMS):
            value, dtype = inner, str(value.attrs.dtype)
    if not (isinstance(value, relax.Call) and value.op.same_as(_PERMUTE_DIMS)):
        return relax.op.permute_dims(x, axes)
    inner = value.attrs.axes
    if inner is None:  # a reversal
        inner = list(range(len(axes)))[::-1]
    composed = [int(inner[a]) for a in axes]
    out = value.args[0]
    if composed != list(range(len(axes))):
        out = relax.op.permute_dims(out, composed)
    return out if dtype is None else relax.op.astype(out, dtype)


_ASTYPE = tvm.ir.Op.get("relax.astype")
_PERMUTE_DIMS = tvm.ir.Op.get("relax.permute_dims")
_MATMUL = tvm.ir.Op.get("relax.matmul")
_MULTIPLY = tvm.ir.Op.get("relax.multiply")
_SOFTMAX = tvm.ir.Op.get("relax.nn.softmax")


def _causal_mask(q, k, causal: str) -> relax.Constant:
    """``0`` where query ``i`` may see key ``j``, ``-inf`` above the diagonal (shifted by the
    difference of the lengths for ``BottomRight``), as TVM's legalization masks."""
    queries, keys = static_shape(q.ty)[1], static_shape(k.ty)[1]
    offset = 0 if causal == "TopLeft" else abs(queries - keys)
    visible = np.tril(np.ones((queries, keys), bool), k=offset)
    return relax.const(np.where(visible, 0.0, -np.inf).astype("float32"))


__all__ = ["DecomposeAttention"]
