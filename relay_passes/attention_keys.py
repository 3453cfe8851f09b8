"""PadAttentionKeys: attention over a ragged number of keys runs on whole vectors of keys.

The CPU kernel that computes attention's scores and their softmax together
(``schedules/cpu/bf16_softmax.py``, merged by :class:`.gemm_softmax.FuseGemmSoftmax`) needs
rows of whole 16-lane vectors: Whisper's 1500 keys ran as two kernels, the fp32 scores
written out and read back (54 MB per Whisper layer). Paired, one thread, Zen5: the scores and
softmax of 6 heads of 1500 queries took 10.4 ms over 1500 keys and 7.2 ms over 1504.

:class:`PadAttentionKeys` pads the keys to the next multiple of 16 where that adds at most
:data:`MAX_KEY_PADDING` of them and the scores are too large to stay in the cache between two
kernels (:data:`MIN_SCORES_BYTES`; ViT's 197 keys are not padded):

    s = matmul(q, k_t)                         s = matmul(q, pad(k_t))       (zero keys)
    x = epilogue(s, side inputs)               x = epilogue(s, padded side inputs)
    p = softmax(x, axis=-1)          ->        p = softmax(x + [0 ... 0, -inf ...], axis=-1)
    o = matmul(astype(p), v)                   o = matmul(astype(p), pad(v))  (zero rows)

A padded key's score is ``-inf``, so its probability is 0 (the clamped fast exp gives 1e-38
against a row sum of at least 1) and it meets a zero row of ``v``: ``o`` is unchanged, and no
slice is needed. The epilogue may scale, add a mask, or take a ``where``; a side input with the
keys on its last axis is padded too (a divisor with ones). torch's safe softmax
(``scaled_dot_product_attention``, Hugging Face's default attention: zeros for a row all
``-inf``) is rebuilt over the padded scores; its padded keys are ``-inf``, so it zeroes the same
rows. Every value between the two GEMMs must have no other reader, and the shapes must be
static.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import tvm
from tvm import relax
from tvm.ir.expr import Constant
from tvm.relax import PyExprMutator

from tvmamp.tensors import np_dtype, static_shape, tensor_dtype

from .bindings import bound_values, call_of, rebind, use_counts
from .fast_math import safe_softmax_of
from .tensor_core_padding import round_up

# Most padded keys, as a fraction of the keys: 1500 -> 1504, 197 -> 208, 100 -> 112; not
# 50 -> 64, where the padding's work would outweigh the merge.
MAX_KEY_PADDING = 0.125
# Fewest bytes of fp32 scores (all heads) worth padding for: smaller scores stay in the cache
# between the two kernels, and the padded kernels were no faster. Paired, one thread, Zen5,
# 6 heads of 64, padded / unpadded time: 197 keys (0.9 MiB of scores) 1.03x, 300 (2.1 MiB)
# 1.06x, 577 (7.6 MiB) 0.88x, 801 (14.7 MiB) 0.66x, 1500 (51.5 MiB) 0.77x.
MIN_SCORES_BYTES = 4 << 20
LANES = 16  # the merged kernel's row vectors (``schedules/x86/bf16_intrin.LANES``)

_BINARY = ("multiply", "add", "subtract", "divide", "maximum", "minimum")
_OPS = {
    name: tvm.ir.Op.get(f"relax.{name}")
    for name in ("matmul", "nn.softmax", "astype", "where", *_BINARY)
}
_MAX_EPILOGUE = 8  # steps between the scores GEMM and the softmax
# Queries are padded to whole tiles of this many rows (the AMX tile's 32, a multiple of the
# vdpbf16ps tile's 8), so that neither GEMM copies its left operand to pad its rows: without,
# Whisper's 1500 x 1504 probabilities were copied to 1504 rows (7.8 of its 108 ms).
QUERY_TILE = 32


@tvm.transform.module_pass(opt_level=0, name="tvmamp.PadAttentionKeys")
class PadAttentionKeys:
    """Pad attention's keys to whole vectors where ``merges(extents)`` says the merged scores
    and softmax kernel takes ``[batch, queries, padded keys, head size]``."""

    def __init__(self, merges: Callable[[list[int]], bool]):
        self.merges = merges

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        """Rewrite every Relax function of ``mod``."""
        rewriter = _Rewriter(mod, self.merges)
        for gvar, func in mod.functions_items():
            if isinstance(func, relax.Function) and isinstance(func.body, relax.SeqExpr):
                rewriter.values, rewriter.uses = bound_values(func), use_counts(func)
                rewriter.builder_.update_func(gvar, rewriter.visit_expr(func))
        return relax.transform.DeadCodeElimination()(rewriter.builder_.get())


def _call(value, name: str) -> relax.Call | None:
    return call_of(value, _OPS[name])


@relax.expr_functor.mutator
class _Rewriter(PyExprMutator):
    def __init__(self, mod: tvm.IRModule, merges):
        super().__init__(mod)
        self.merges = merges
        self.values: dict = {}
        self.uses: dict = {}

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        found = self._attention(binding.value)
        if found is None:
            super().visit_var_binding_(binding)
            return
        rebind(self, binding.var, self._padded(binding.value, *found), binding.var.name)

    def _single(self, var, name: str) -> relax.Call | None:
        """The call of ``name`` bound to ``var`` when ``var`` has one reader."""
        if not isinstance(var, relax.Var) or self.uses.get(var, 0) != 1:
            return None
        return _call(self.values.get(var), name)

    def _attention(self, value):
        """``(probs, softmax, epilogue, scores, queries, keys)`` when ``value`` is the
        probabilities-times-values GEMM of an attention whose keys to pad, else None;
        ``probs`` is ``"safe"`` (torch's safe softmax), a cast, or None."""
        pv = _call(value, "matmul")
        if pv is None:
            return None
        probs, kind, readers = pv.args[0], None, 1
        where = self._single(probs, "where")
        safe = safe_softmax_of(where, self.values) if where is not None else None
        if safe is not None:
            # x is read by the softmax and by the row test of the all -inf rows
            kind, probs, readers = "safe", where.args[2], 2
            cast_call = _call(self.values.get(probs), "astype")
        else:
            cast_call = self._single(probs, "astype")
            kind = cast_call
        if cast_call is not None:
            probs = cast_call.args[0]
        softmax = _call(self.values.get(probs), "nn.softmax")
        if softmax is None or (safe is None and self.uses.get(probs, 0) != 1):
            return None
        chain = self._chain(softmax.args[0], readers=readers)
        if chain is None:
            return None
        epilogue, scores = chain
        shapes = [static_shape(getattr(e, "ty", None)) for e in (*scores.args, pv.args[1])]
        shapes.append(static_shape(softmax.ty))
        if any(s is None or len(s) < 2 for s in shapes):
            return None
        (*_, d, keys), (*_, keys_v, _), (*batch, queries, keys_p) = shapes[1:]
        axis = int(softmax.attrs.axis) % len(shapes[3])
        if axis != len(shapes[3]) - 1 or not keys == keys_v == keys_p or keys % LANES == 0:
            return None
        padded = round_up(keys, LANES)
        if padded - keys > MAX_KEY_PADDING * keys:
            return None
        if np.prod(batch) * queries * keys * 4 < MIN_SCORES_BYTES:
            return None
        rows = round_up(queries, QUERY_TILE)
        if rows - queries > MAX_KEY_PADDING * queries:
            rows = queries
        if not self.merges([int(np.prod(batch)), rows, padded, d]):
            return None
        return kind, softmax, epilogue, scores, (queries, rows), (keys, padded)

    def _chain(self, x, depth: int = 0, readers: int = 1):
        """``(steps, scores GEMM)``: the elementwise steps from the scores GEMM to ``x``, each
        ``(index of the chain's argument, call)``, every value read once (``x`` by
        ``readers``); else None."""
        if depth > _MAX_EPILOGUE or not isinstance(x, relax.Var):
            return None
        if self.uses.get(x, 0) != (readers if depth == 0 else 1):
            return None
        call = self.values.get(x)
        if _call(call, "matmul") is not None:
            return [], call
        for index in _chain_arguments(call):
            found = self._chain(call.args[index], depth + 1)
            if found is not None:
                return [*found[0], (index, call)], found[1]
        return None

    def _padded(self, pv, kind, softmax, epilogue, scores, queries, keys):
        """The attention of ``pv`` over ``keys = (keys, padded)`` keys, its ``queries =
        (queries, padded)`` queries padded too and sliced off the result."""
        (m, m_pad), (j, j_pad) = queries, keys
        q, k_t = (self.visit_expr(a) for a in scores.args)
        q = _pad_axis(q, -2, m_pad - m)
        x = relax.op.matmul(q, _pad_axis(k_t, -1, j_pad - j), out_dtype=scores.attrs.out_dtype)
        for index, call in epilogue:
            args = [self.visit_expr(a) for a in call.args]
            args[index] = x
            for side, arg in enumerate(args):
                if side != index:
                    one = call.op.same_as(_OPS["divide"]) and side == 1
                    args[side] = _pad_side(arg, queries, keys, 1.0 if one else 0.0)
            x = relax.Call(call.op, args, call.attrs)
        dtype = tensor_dtype(softmax.args[0])
        mask = np.concatenate([np.zeros(j), np.full(j_pad - j, -np.inf)])
        x = self.builder_.emit(relax.op.add(x, relax.const(mask.astype(np_dtype(dtype)), dtype)))
        probs = relax.op.nn.softmax(x, axis=-1)
        if kind == "safe":
            probs = _safe(self.builder_, x, probs, tensor_dtype(pv.args[0]))
        elif kind is not None:
            probs = relax.Call(kind.op, [probs], kind.attrs)
        v = _pad_axis(self.visit_expr(pv.args[1]), -2, j_pad - j)
        out = relax.Call(pv.op, [probs, v], pv.attrs)
        if m_pad == m:
            return out
        rank = len(static_shape(pv.ty))
        return relax.op.strided_slice(out, [rank - 2], [0], [m])


def _safe(builder, x, probs, dtype: str) -> relax.Expr:
    """torch's safe softmax of ``x`` from its ``probs`` (zeros for a row all ``-inf``), in
    the form FastMath makes one kernel of; padded keys are ``-inf``, so the rows it zeroes are
    the same."""
    if tensor_dtype(probs) != dtype:
        probs = relax.op.astype(probs, dtype)
    finite = relax.op.logical_not(relax.op.equal(x, relax.const(-np.inf, tensor_dtype(x))))
    row = relax.op.max(relax.op.astype(finite, "int8"), axis=[-1], keepdims=True)
    flag = relax.op.logical_not(relax.op.astype(row, "bool"))
    probs = builder.emit(probs)
    return relax.op.where(flag, relax.op.zeros_like(probs), probs)


def _chain_arguments(call) -> tuple[int, ...]:
    """The arguments of an epilogue step that may carry the scores (not a divisor: a padded
    zero there would give inf)."""
    if _call(call, "astype") is not None:
        return (0,)
    if _call(call, "divide") is not None:
        return (0,)
    if any(_call(call, name) is not None for name in _BINARY):
        return (0, 1)
    if _call(call, "where") is not None:
        return (1, 2)
    return ()


def _pad_axis(x: relax.Expr, axis: int, extra: int, value: float = 0.0) -> relax.Expr:
    if extra == 0:
        return x
    rank = len(static_shape(x.ty))
    widths = [0] * (2 * rank)
    widths[2 * (axis % rank) + 1] = extra
    return relax.op.nn.pad(x, widths, pad_value=value)


def _pad_side(x: relax.Expr, queries, keys, value: float) -> relax.Expr:
    """A side input of the epilogue with its last axis the keys (and the one before it the
    queries) padded like the scores; a broadcast axis of 1 stays."""
    shape = static_shape(getattr(x, "ty", None))
    if not shape:
        return x
    widths = [(0, 0)] * len(shape)
    for axis, (size, padded) in ((-1, keys), (-2, queries)):
        if len(shape) >= -axis and shape[axis] == size and padded > size:
            widths[axis] = (0, padded - size)
    if all(w == (0, 0) for w in widths):
        return x
    if isinstance(x, Constant):
        data = x.value.numpy()
        return relax.const(np.pad(data, widths, constant_values=value), str(data.dtype))
    flat = [w for pair in widths for w in pair]
    return relax.op.nn.pad(x, flat, pad_value=value)


__all__ = ["MAX_KEY_PADDING", "MIN_SCORES_BYTES", "PadAttentionKeys"]
