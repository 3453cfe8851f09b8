"""Legalization of instance and layer norms (and of row sums, means and variances) for CPUs:
sums in whole SIMD vectors, and a variance that does not cancel.

- The CPU row-reduction schedule (``schedules/cpu/reduction.py``) keeps one SIMD register of
  partial sums per row, which needs rows of whole vectors (TVM 0.27's ``compute_at`` drops the
  predicate of a partial chunk). TVM's legalization reduces the whole row at once, so a row of
  3199 values (wav2vec 2.0's group norm over 3199 frames) fell back to a scalar reduction: 1.6
  ms against 0.15 ms for 3200 frames. Here each sum is split into a body of whole vectors and
  a short tail, the form the fast softmax has (``fast_math.row_reduce``).
- TVM's rule takes the variance as ``mean(x^2) - mean^2`` over fp32 sums of ``x``. A row far
  from zero cancels: values 0.01 apart around 1000 (a layer norm of 512) came out with a
  relative error of 2.4e-2 at O0 (torch, which sums pairwise: 1.8e-2). Here the sums are of
  ``x - x[0]`` (the row's first value) and the variance is ``mean((x - mean)^2)``: 1.7e-7.
  It costs about 12 % of the norm's time (0.22 against 0.19 ms for 2048 x 768 at one thread)
  and nothing measurable on BERT.

- A ``sum``, ``mean`` or ``variance`` of fp32 values over trailing axes (not all of them) is
  split the same way, also over a symbolic row length: wav2vec 2.0's exported group norm is a
  ``mean`` and a ``variance`` over 3199 frames, which took 1.36 of the model's 3.36 ms at O2
  (one thread, Zen5) as one scalar reduction a row, and take 0.06 ms split.

The LLVM target entry gives :data:`LEGALIZE_MAP` to ``LegalizeOps`` (its ``legalize_rules``).
The norms take static shapes whose normalised axes are the trailing ones; other norms
(symbolic shapes, leading axes) keep TVM's rule. Other statistics keep the rule beneath:
``low_reductions``' (fp32 sums of a low input, which then come back here) or TVM's.
"""

from __future__ import annotations

import math

import tvm
from tvm import relax, te, tirx

from tvmamp.tensors import static_shape

from . import low_reductions
from .fast_math import row_reduce

_OPS = ("relax.nn.instance_norm", "relax.nn.layer_norm")


def _trailing(axes, rank: int) -> list[int] | None:
    """``axes`` (of a tensor of ``rank``) as sorted non-negative ints when they are its last
    ones (rows that are contiguous), else None."""
    found = sorted(int(a) % rank for a in axes)
    return found if found == list(range(rank - len(found), rank)) else None


def _rows(call: relax.Call) -> tuple[list[int], int] | None:
    """``(leading shape, row length)`` when ``call``'s norm takes this legalization."""
    shape = static_shape(call.args[0].ty)
    if not shape:
        return None
    axes = _trailing(call.attrs.axes, len(shape))
    if axes is None:
        return None
    return list(shape[: len(shape) - len(axes)]), math.prod(shape[a] for a in axes)


def _norm(x, gamma, beta, epsilon: float, channel: int | None, center: bool, scale: bool):
    """``(x - mean) / sqrt(var + eps) * gamma + beta`` over the last axis of ``x`` (fp32),
    ``gamma``/``beta`` indexed by leading axis ``channel`` (instance norm) or by the row
    position (layer norm)."""
    length = int(x.shape[-1])
    axis = len(x.shape) - 1
    # sums of x - x[..., 0]: a row far from zero loses its spread in fp32 sums of x itself
    shift = te.compute(x.shape, lambda *i: x(*i) - x(*i[:-1], 0), name="shift")
    total = row_reduce(shift, axis, te.sum, tirx.Add)
    mean = te.compute(total.shape, lambda *i: total(*i) / float(length), name="mean")
    centred = te.compute(x.shape, lambda *i: shift(*i) - mean(*i[:-1]), name="centred")
    square = te.compute(x.shape, lambda *i: centred(*i) * centred(*i), name="square")
    spread = row_reduce(square, axis, te.sum, tirx.Add)
    rstd = te.compute(
        spread.shape, lambda *i: tirx.rsqrt(spread(*i) / float(length) + epsilon), name="rstd"
    )

    def param(p, i):
        return p(i[channel]) if channel is not None else p(i[-1])

    def value(*i):
        out = centred(*i) * rstd(*i[:-1])
        if scale:
            out = out * param(gamma, i)
        if center:
            out = out + param(beta, i)
        return out

    return te.compute(x.shape, value, name="norm")


def legalize_norm(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    """Legalize an instance or layer norm over trailing axes: split, shifted sums."""
    default = tvm.ir.Op.get(call.op.name).get_attr("FLegalize")
    found = _rows(call)
    if found is None:
        return default(bb, call)
    lead, length = found
    x, gamma, beta = call.args
    dtype = str(x.ty.dtype)
    shape = list(static_shape(x.ty))
    rows = x if shape == [*lead, length] else bb.emit(relax.op.reshape(x, [*lead, length]))
    if dtype != "float32":
        rows = bb.emit(relax.op.astype(rows, "float32"))
    instance = call.op.name == "relax.nn.instance_norm"
    channel = int(call.attrs.channel_axis) % len(call.args[0].ty.shape) if instance else None
    if not instance:  # layer norm: gamma and beta over the row, flattened
        gamma, beta = (
            p if static_shape(p.ty) == (length,) else bb.emit(relax.op.reshape(p, [length]))
            for p in (gamma, beta)
        )
    gamma, beta = (
        bb.emit(relax.op.astype(p, "float32")) if str(p.ty.dtype) != "float32" else p
        for p in (gamma, beta)
    )
    out = bb.emit_te(
        _norm,
        rows,
        gamma,
        beta,
        float(call.attrs.epsilon),
        channel,
        bool(call.attrs.center),
        bool(call.attrs.scale),
        primfunc_name_hint=call.op.name.split(".")[-1],
    )
    if dtype != "float32":
        out = bb.emit(relax.op.astype(out, dtype))
    return out if shape == [*lead, length] else relax.op.reshape(out, call.args[0].ty.shape)


def _trailing_axes(call: relax.Call) -> int | None:
    """How many trailing axes an fp32 ``mean``/``variance``/``sum``/``max``/``min`` reduces (the
    rows may be symbolic), or None: other axes, all axes (the full-reduction rule's), other
    dtypes."""
    x = call.args[0]
    shape = getattr(x.ty, "shape", None)
    if str(getattr(x.ty, "dtype", "")) != "float32" or not isinstance(shape, relax.ShapeExpr):
        return None
    rank = len(shape.values)
    axes = None if call.attrs.axis is None else _trailing(call.attrs.axis, rank)
    if axes is None or len(axes) == rank:
        return None
    return len(axes)


def _row_statistic(x, kind: str, trailing: int, keepdims: bool):
    """The ``kind`` (sum, mean, variance, max or min) of ``x`` over its ``trailing`` last axes,
    each reduction a body of whole vectors and a tail (:func:`.fast_math.row_reduce`). Several
    axes are read as one row in the kernel itself (a reshape kernel of their own was left in
    the module). A row maximum of a ragged length was left as a scalar loop: the row-reduction
    rule takes only whole vectors."""
    lead, dims = list(x.shape[: len(x.shape) - trailing]), list(x.shape[len(x.shape) - trailing :])
    rows = x
    if trailing > 1:

        def flat(*i):
            index, at = [], i[-1]
            for d in reversed(dims):
                index.insert(0, at % d)
                at = at // d
            return x(*i[:-1], *index)

        rows = te.compute([*lead, math.prod(dims)], flat, name="rows")
    axis = len(lead)
    out = _row_reduced(rows, axis, kind)
    if not keepdims:
        return out
    return te.compute([*lead, *[1] * trailing], lambda *i: out(*i[:axis]), name=kind)


def _row_reduced(rows, axis: int, kind: str):
    """The ``kind`` of ``rows`` over its last axis (``axis``), each reduction a body and a tail."""
    if kind in _EXTREMA:
        return row_reduce(rows, axis, *_EXTREMA[kind])
    total = row_reduce(rows, axis, te.sum, tirx.Add)
    count = tirx.Cast("float32", rows.shape[-1])
    if kind == "sum":
        return total
    mean = te.compute(total.shape, lambda *i: total(*i) / count, name="mean")
    if kind == "mean":
        return mean

    def square(*i):
        return (rows(*i) - mean(*i[:-1])) * (rows(*i) - mean(*i[:-1]))

    spread = row_reduce(te.compute(rows.shape, square), axis, te.sum, tirx.Add)
    return te.compute(spread.shape, lambda *i: spread(*i) / count, name="variance")


def _legalize_row_statistic(kind: str):
    op_name = f"relax.{kind}"

    def legalize(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
        """A ``sum``/``mean``/``variance``/``max``/``min`` over trailing axes as reductions of
        whole vectors and a tail; others as the rule beneath (fp32 sums of a low input, TVM's)."""
        trailing = _trailing_axes(call)
        if trailing is None:
            below = low_reductions.LEGALIZE_MAP.get(op_name)
            return (below or tvm.ir.Op.get(op_name).get_attr("FLegalize"))(bb, call)
        keepdims = bool(call.attrs.keepdims)
        return bb.call_te(_row_statistic, call.args[0], kind, trailing, keepdims)

    return legalize


# The extrema among the row statistics: (reducer, combiner of a body and a tail).
_EXTREMA = {"max": (te.max, tirx.max), "min": (te.min, tirx.min)}

LEGALIZE_MAP = {
    **dict.fromkeys(_OPS, legalize_norm),
    **{
        f"relax.{kind}": _legalize_row_statistic(kind)
        for kind in ("sum", "mean", "variance", *_EXTREMA)
    },
}

__all__ = ["LEGALIZE_MAP", "legalize_norm"]
