"""Elementwise ops, per-channel broadcasts and inference batch-norm rewritten on NHWC rows."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import tvm
from tvm import relax, tirx

# Ops whose first argument is the only tensor and whose result has its shape.
UNARY_OPS = tuple(
    tvm.ir.Op.get(f"relax.{name}")
    for name in (
        "astype",
        "nn.relu",
        "nn.gelu",
        "nn.gelu_tanh",
        "nn.silu",
        "nn.leakyrelu",
        "sigmoid",
        "tanh",
        "clip",
    )
)
# Broadcasting binary ops: rewritten when one side is rows and the other per-channel or rows.
BINARY_OPS = tuple(
    tvm.ir.Op.get(f"relax.{name}")
    for name in ("add", "subtract", "multiply", "divide", "maximum", "minimum")
)
_BATCH_NORM = tvm.ir.Op.get("relax.nn.batch_norm")


@dataclass(frozen=True)
class Rows:
    """An NCHW value ``[n, c, h, w]`` held as the rows ``var[n*h*w, c]`` (NHWC, flattened).

    ``extras`` holds the other fields of a batch-norm tuple (moving mean and variance), whose
    first field is the rows.
    """

    var: relax.Expr
    n: int
    h: int
    w: int
    c: int
    extras: tuple = ()

    def same_layout(self, other: Rows) -> bool:
        """Whether ``other`` holds a value of the same shape (and is not a tuple)."""
        return (self.n, self.h, self.w, self.c, self.extras) == (
            other.n,
            other.h,
            other.w,
            other.c,
            (),
        )

    def with_var(self, var: relax.Expr, extras: tuple = ()) -> Rows:
        """The same shape held in ``var``."""
        return Rows(var, self.n, self.h, self.w, self.c, extras)

    def to_nchw(self, bb: relax.BlockBuilder, var: relax.Var | None = None) -> relax.Var:
        """Emit the NCHW value (a tuple for a batch-norm result), bound to ``var`` if given."""
        nhwc = bb.emit(relax.op.reshape(self.var, (self.n, self.h, self.w, self.c)))
        value = relax.op.permute_dims(nhwc, (0, 3, 1, 2))
        if self.extras:
            value = relax.Tuple([bb.emit(value), *self.extras])
        if var is None:
            return bb.emit(value)
        bb.emit_normalized(relax.VarBinding(var, bb.normalize(value)))
        return var


def rows_call(
    bb: relax.BlockBuilder, value: relax.Expr, rows: dict, visit: Callable
) -> Rows | None:
    """Emit ``value`` on rows when its tensor input is rows; return ``None`` when it is not.

    Parameters
    ----------
    bb : relax.BlockBuilder
        Where the rewritten bindings go.
    value : relax.Expr
        The original bound value.
    rows : dict
        Original dataflow variable -> :class:`Rows`.
    visit : callable
        Maps an original argument that is not rows to its rewritten expression.
    """
    held = lambda e: rows.get(e) if isinstance(e, relax.DataflowVar) else None  # noqa: E731
    if isinstance(value, relax.TupleGetItem):
        source = held(value.tuple_value)
        if source is not None and source.extras and value.index == 0:
            return source.with_var(source.var)
        return None
    if not isinstance(value, relax.Call):
        return None
    if value.op in BINARY_OPS and len(value.args) == 2:
        return _binary(bb, value, held, visit)
    first = held(value.args[0]) if value.args else None
    if first is None or first.extras:
        return None
    if value.op in UNARY_OPS:
        rest = [visit(arg) for arg in value.args[1:]]
        return first.with_var(bb.emit(relax.Call(value.op, [first.var, *rest], value.attrs)))
    if value.op == _BATCH_NORM:
        return _batch_norm(bb, value, first, visit)
    return None


def _binary(bb, call: relax.Call, held: Callable, visit: Callable) -> Rows | None:
    """``a op b`` with one side rows and the other rows of the same shape or per-channel."""
    lhs, rhs = (held(arg) for arg in call.args)
    if lhs is not None and rhs is not None:
        if lhs.extras or not lhs.same_layout(rhs):
            return None
        return lhs.with_var(bb.emit(relax.Call(call.op, [lhs.var, rhs.var], call.attrs)))
    side, other = (lhs, call.args[1]) if lhs is not None else (rhs, call.args[0])
    if side is None or side.extras:
        return None
    vector = per_channel(visit(other), side.c)
    if vector is None:
        return None
    args = [side.var, vector] if lhs is not None else [vector, side.var]
    return side.with_var(bb.emit(relax.Call(call.op, args, call.attrs)))


def per_channel(expr: relax.Expr, channels: int) -> relax.Expr | None:
    """``expr`` reshaped to broadcast over rows ``[*, channels]``, if it broadcasts per channel.

    Shapes that right-align with ``[n, c, h, w]`` as ``[1, c or 1, 1, 1]`` qualify; the result
    has shape ``[c]`` or ``[1]`` (a scalar stays a scalar). Anything else returns ``None``.
    """
    shape = expr.ty.shape if isinstance(expr.ty, relax.TensorType) else None
    if shape is None or len(shape) > 4 or not all(isinstance(s, tirx.IntImm) for s in shape):
        return None
    dims = [1] * (4 - len(shape)) + [int(s) for s in shape]
    if dims[0] != 1 or dims[2:] != [1, 1] or dims[1] not in (1, channels):
        return None
    return expr if not shape else relax.op.reshape(expr, (dims[1],))


def _batch_norm(bb, call: relax.Call, data: Rows, visit: Callable) -> Rows | None:
    """fp32 inference batch-norm as ``x * scale + shift`` with per-channel ``scale``/``shift``.

    ``scale = gamma / sqrt(var + eps)`` and ``shift = beta - mean * scale`` are computed from the
    parameters (folded at compile time when they are constants), so the epilogue is two ops.
    """
    attrs = call.attrs
    axis = int(attrs.axis)
    if bool(attrs.training) or axis not in (1, -3):
        return None
    if str(call.args[0].ty.dtype) != "float32":
        return None
    gamma, beta, mean, var = (visit(arg) for arg in call.args[1:])
    eps = relax.const(float(attrs.epsilon), "float32")
    scale = relax.op.divide(relax.const(1.0, "float32"), relax.op.sqrt(relax.op.add(var, eps)))
    scale = bb.emit(relax.op.multiply(scale, gamma) if bool(attrs.scale) else scale)
    shift = relax.op.negative(relax.op.multiply(mean, scale))
    shift = bb.emit(relax.op.add(shift, beta) if bool(attrs.center) else shift)
    out = bb.emit(relax.op.add(bb.emit(relax.op.multiply(data.var, scale)), shift))
    return data.with_var(out, extras=(mean, var))
