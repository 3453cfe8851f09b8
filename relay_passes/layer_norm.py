"""Recognise a LayerNorm written out in elementwise ops over the last axis, as I-BERT writes it.

``(x - u) / sqrt(mean((x - u) ** 2, -1) + eps)`` with ``u = mean(x, -1)`` (or ``* rsqrt(...)``),
optionally times a per-channel ``weight`` and plus a per-channel ``bias``, becomes
``relax.nn.layer_norm(x, weight, bias, axes=[-1], epsilon=eps)``. A LayerNorm is on the black
list (it runs in fp32, as torch autocast runs the written-out ops on its fp32 residual stream),
but the written-out form is mostly follow ops: at O2 the centring, the division and the affine
ran in bf16, and the residual stream that feeds them could not stay fp32 (the rule that keeps it
fp32 up to a black-list op never met one). A 2-layer I-BERT had 15x torch autocast's error at
O2. It is also one kernel instead of seven.

Every value in between must have no other reader (``x - u`` exactly two: the square and the
division), ``x`` must be fp32 with a static last axis (its other axes may be symbolic: a
dynamic batch and sequence), ``eps`` a scalar constant, and the weight and bias constants of one
value per channel. Dead bindings are removed; the result keeps its
binding's name. A training graph's adjoint reads the intermediate values, so it is left alone.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax
from tvm.ir.expr import Constant
from tvm.relax import PyExprMutator

from tvmamp.tensors import static_shape, tensor_dtype

from .bindings import (
    call_of,
    means_last_axis,
    rebind,
    rewrite_matches,
    scalar_constant,
    squares,
)

_OPS = {
    name: tvm.ir.Op.get(f"relax.{name}")
    for name in "add subtract multiply divide mean sqrt rsqrt".split()
}


@tvm.transform.module_pass(opt_level=0, name="tvmamp.FuseLayerNorm")
class FuseLayerNorm:
    """Replace written-out LayerNorms over the last axis by ``relax.nn.layer_norm``."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        """Rewrite every Relax function of ``mod``."""
        return rewrite_matches(mod, _Rewriter(mod))


def _call(value, name: str) -> relax.Call | None:
    return call_of(value, _OPS[name])


@relax.expr_functor.mutator
class _Rewriter(PyExprMutator):
    """Its ``values``, ``uses`` and ``readers`` are set per function by ``rewrite_matches``."""

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        norm = self._affine(binding.value) or self._deferred_core(binding)
        if norm is None:
            super().visit_var_binding_(binding)
            return
        x, weight, bias, eps = norm
        channels = _channels(x)
        if weight is None:
            weight = relax.const(np.ones(channels, dtype="float32"))
        if bias is None:
            bias = relax.const(np.zeros(channels, dtype="float32"))
        value = relax.op.nn.layer_norm(self.visit_expr(x), weight, bias, axes=[-1], epsilon=eps)
        rebind(self, binding.var, value, binding.var.name)

    def _single(self, var) -> bool:
        return isinstance(var, relax.Var) and self.uses.get(var, 0) == 1

    def _affine(self, value):
        """``(x, weight, bias, eps)`` for ``core * weight + bias`` or ``core * weight`` (either
        order of each), the weight and bias constants of one value per channel."""
        bias = None
        add = _call(value, "add")
        if add is not None:
            for product, b in (add.args, reversed(add.args)):
                if self._single(product) and _channel_constant(b, product):
                    value, bias = self.values.get(product), b
                    break
            else:
                return None
        multiply = _call(value, "multiply")
        if multiply is None:
            return None
        for core, weight in (multiply.args, reversed(multiply.args)):
            found = self._core(core) if self._single(core) else None
            if found is not None and _channel_constant(weight, core):
                return found[0], weight, bias, found[1]
        return None

    def _deferred_core(self, binding: relax.VarBinding):
        """``(x, None, None, eps)`` for a core whose only reader is not an affine that takes
        the whole norm (:meth:`_affine`)."""
        found = self._core(binding.var)
        if found is None:
            return None
        readers = self.readers.get(binding.var, set())
        if self._single(binding.var) and len(readers) == 1:
            (reader,) = readers
            if reader is not None and self._affine(self.values.get(reader)) is not None:
                return None
        return found[0], None, None, found[1]

    def _core(self, var) -> tuple[relax.Expr, float] | None:
        """``(x, eps)`` when ``var`` is bound to ``y / sqrt(v + eps)`` or ``y * rsqrt(v + eps)``
        with ``y = x - mean(x, -1)`` and ``v = mean(y ** 2, -1)``."""
        value = self.values.get(var)
        divide, multiply = _call(value, "divide"), _call(value, "multiply")
        if divide is not None:
            candidates = [(divide.args[0], divide.args[1], "sqrt")]
        elif multiply is not None:
            candidates = [(a, b, "rsqrt") for a, b in (multiply.args, reversed(multiply.args))]
        else:
            return None
        for y, root, name in candidates:
            eps = self._root_of_variance(root, name, y)
            x = self._centred(y, var) if eps is not None else None
            if x is not None:
                return x, eps
        return None

    def _root_of_variance(self, root, name: str, y) -> float | None:
        """``eps`` when ``root`` is ``sqrt``/``rsqrt`` of ``mean(y ** 2, -1) + eps``."""
        if not self._single(root) or _call(self.values.get(root), name) is None:
            return None
        total = self.values[root].args[0]
        add = _call(self.values.get(total), "add") if self._single(total) else None
        if add is None:
            return None
        for variance, constant in (add.args, reversed(add.args)):
            eps = scalar_constant(constant)
            if eps is not None and self._mean_last(variance) is not None:
                square = self._mean_last(variance)
                if self._single(square) and squares(self.values.get(square), y):
                    return eps
        return None

    def _mean_last(self, var):
        """The input of ``var = mean(input, axis=-1, keepdims=True)`` when ``var`` has one
        reader, else None."""
        mean = _call(self.values.get(var), "mean") if self._single(var) else None
        return mean.args[0] if mean is not None and means_last_axis(mean) else None

    def _centred(self, y, core) -> relax.Expr | None:
        """``x`` when ``y = x - mean(x, -1)`` is read by the square and ``core`` only, and
        ``x`` is an fp32 tensor with a static last axis."""
        subtract = _call(self.values.get(y), "subtract")
        if subtract is None or len(self.readers.get(y, ())) != 2 or core not in self.readers[y]:
            return None
        x, centre = subtract.args
        if self._mean_last(centre) is None or not self._mean_last(centre).same_as(x):
            return None
        return x if _channels(x) and tensor_dtype(x) == "float32" else None


def _channels(value) -> int | None:
    """The static size of ``value``'s last axis (its channels), else None."""
    ty = getattr(value, "ty", None)
    if not isinstance(ty, relax.TensorType) or not isinstance(ty.shape, relax.ShapeExpr):
        return None
    dims = list(ty.shape.values)
    return int(dims[-1]) if dims and isinstance(dims[-1], tvm.tirx.IntImm) else None


def _channel_constant(expr, like) -> bool:
    """Whether ``expr`` is an fp32 constant of one value per channel (last axis) of ``like``."""
    channels = _channels(like)
    return (
        isinstance(expr, Constant)
        and tensor_dtype(expr) == "float32"
        and channels is not None
        and static_shape(expr.ty) == (channels,)
    )


__all__ = ["FuseLayerNorm"]
