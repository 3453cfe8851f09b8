"""Legalization of instance and layer norms for CPUs: sums in whole SIMD vectors, and a
variance that does not cancel.

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

The LLVM target entry gives :data:`LEGALIZE_MAP` to ``LegalizeOps`` (its ``legalize_rules``).
It applies to static shapes whose normalised axes are the trailing ones; other norms
(symbolic shapes, leading axes) keep TVM's rule.
"""

from __future__ import annotations

import math

import tvm
from tvm import relax, te, tirx

from tvmamp.tensors import static_shape

from .fast_math import row_reduce

_OPS = ("relax.nn.instance_norm", "relax.nn.layer_norm")


def _rows(call: relax.Call) -> tuple[list[int], int] | None:
    """``(leading shape, row length)`` when ``call``'s norm takes this legalization."""
    shape = static_shape(call.args[0].ty)
    if not shape:
        return None
    axes = sorted(int(a) % len(shape) for a in call.attrs.axes)
    if axes != list(range(len(shape) - len(axes), len(shape))):
        return None  # not the trailing axes: rows would not be contiguous
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


LEGALIZE_MAP = dict.fromkeys(_OPS, legalize_norm)

__all__ = ["LEGALIZE_MAP", "legalize_norm"]
