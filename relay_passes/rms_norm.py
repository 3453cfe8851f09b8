"""Recognise an RMSNorm written out in elementwise ops, as Llama, Mistral, Qwen2 and T5 write it.

``x * rsqrt(mean(x ** 2, axis=-1, keepdims=True) + eps)``, optionally times a per-channel
``weight``, becomes ``relax.nn.rms_norm(x, weight, axes=[-1], epsilon=eps)``. An RMSNorm is on
the black list (it runs in fp32, as torch autocast runs the ops of the written-out form), but
the written-out form is follow ops: at O2 its scaling and weight multiplies ran in bf16, each
rounding the normalised activations once more before the next matmul rounded them again, and
Llama-family models had 1.6-2.3x torch autocast's error. It is also one kernel instead of
several. Every value in between must have no other reader, ``x`` must be fp32, and ``eps`` a
scalar constant. Dead bindings are removed; the result keeps its binding's name.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax
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

_OPS = {name: tvm.ir.Op.get(f"relax.{name}") for name in "multiply mean add rsqrt".split()}


@tvm.transform.module_pass(opt_level=0, name="tvmamp.FuseRMSNorm")
class FuseRMSNorm:
    """Replace written-out RMSNorms by ``relax.nn.rms_norm``."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        """Rewrite every Relax function of ``mod``."""
        return rewrite_matches(mod, _Rewriter(mod))


def _call(value, name: str) -> relax.Call | None:
    return call_of(value, _OPS[name])


@relax.expr_functor.mutator
class _Rewriter(PyExprMutator):
    """Its ``values``, ``uses`` and ``readers`` are set per function by ``rewrite_matches``."""

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        norm = self._weighted(binding.value) or self._deferred_core(binding)
        if norm is None:
            super().visit_var_binding_(binding)
            return
        x, weight, eps = norm
        shape = static_shape(x.ty)
        if weight is None:
            weight = relax.const(np.ones(shape[-1], dtype="float32"))
        value = relax.op.nn.rms_norm(
            self.visit_expr(x), self.visit_expr(weight), axes=[-1], epsilon=eps
        )
        rebind(self, binding.var, value, binding.var.name)

    def _weighted(self, value):
        """``(x, weight, eps)`` for ``core(x) * weight`` (either order), ``weight`` one value
        per channel of ``x``'s last axis."""
        multiply = _call(value, "multiply")
        if multiply is None:
            return None
        for core, weight in (multiply.args, reversed(multiply.args)):
            found = self._core(core)
            if found is None or self.uses.get(core, 0) != 1:
                continue
            x, eps = found
            w_shape = static_shape(getattr(weight, "ty", None))
            channels = static_shape(x.ty)[-1]
            if w_shape == (channels,) and tensor_dtype(weight) == "float32":
                return x, weight, eps
        return None

    def _deferred_core(self, binding: relax.VarBinding):
        """``(x, None, eps)`` for a core whose only reader is not a weight multiply (that
        reader takes the whole norm, :meth:`_weighted`)."""
        found = self._core(binding.var)
        if found is None:
            return None
        (reader, *others) = self.readers.get(binding.var) or {None}
        value = self.values.get(reader)
        if self.uses.get(binding.var, 0) == 1 and not others and self._weighted(value) is not None:
            return None
        return found[0], None, found[1]

    def _core(self, var) -> tuple[relax.Expr, float] | None:
        """``(x, eps)`` when ``var`` is bound to ``x * rsqrt(mean(x ** 2, -1) + eps)``."""
        multiply = _call(self.values.get(var), "multiply")
        if multiply is None:
            return None
        for x, r in (multiply.args, reversed(multiply.args)):
            eps = self._inverse_rms(r, x)
            shape = static_shape(getattr(x, "ty", None))
            if eps is not None and shape and tensor_dtype(x) == "float32":
                return x, eps
        return None

    def _inverse_rms(self, r, x) -> float | None:
        """``eps`` when ``r`` is ``rsqrt(mean(x ** 2, axis=-1, keepdims=True) + eps)``."""
        chain = []
        for name in ("rsqrt", "add", "mean"):
            if not isinstance(r, relax.Var) or self.uses.get(r, 0) != 1:
                return None
            call = _call(self.values.get(r), name)
            if call is None:
                return None
            chain.append(call)
            r = call.args[0]
            if name == "add":
                eps = scalar_constant(call.args[1])
                if eps is None:
                    eps, r = scalar_constant(call.args[0]), call.args[1]
                if eps is None:
                    return None
        if not means_last_axis(chain[-1]):
            return None
        if not isinstance(r, relax.Var) or self.uses.get(r, 0) != 1:
            return None
        return eps if squares(self.values.get(r), x) else None


__all__ = ["FuseRMSNorm"]
