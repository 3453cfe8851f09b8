"""Fast transcendental functions for ops that run in fp16/bf16 on the CPU.

LLVM has no vector ``erf``, and TVM's ``exp``/``erf``/``tanh`` on bf16 widen to fp32 and call
the scalar libm routine per element: a GELU epilogue took 17 ms of a 35 ms transformer layer,
whatever the precision of its matmul. TVM's fast approximations (``topi.fast_exp``,
``fast_erf``, ``fast_tanh``: polynomials that vectorise) exist only for fp32, so an op that the
AMP pass made low is rewritten to compute in fp32 inside its kernel with the fast function and
round back to its dtype: the approximation error (about 1e-7 relative) is far below the
rounding of the low dtype (about 4e-3 for bf16, 5e-4 for fp16). Ops that run in fp32 are left
exact, so an fp32 build, the reference of every accuracy tool, is unchanged.
"""

from __future__ import annotations

import math

import tvm
from tvm import relax, topi

LOW_DTYPES = ("float16", "bfloat16")


def _widened(fast):
    """Return a TE function: widen to fp32, apply ``fast``, round back."""

    def compute(x, *args):
        wide = topi.cast(x, "float32")
        return topi.cast(fast(wide, *args), x.dtype)

    return compute


def _gelu(x):
    """``0.5 * x * (1 + erf(x / sqrt(2)))`` with the fast erf."""
    return 0.5 * x * (1.0 + topi.fast_erf(x * (1.0 / math.sqrt(2.0))))


def _gelu_tanh(x):
    """``0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 x^3)))`` with the fast tanh."""
    inner = math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)
    return 0.5 * x * (1.0 + topi.fast_tanh(inner))


def _softmax(x, axis):
    return topi.nn.fast_softmax(x, axis)


# relax op name -> (fp32 fast TE function, attribute names passed as extra arguments)
FAST = {
    "relax.exp": (topi.fast_exp, ()),
    "relax.erf": (topi.fast_erf, ()),
    "relax.tanh": (topi.fast_tanh, ()),
    "relax.nn.gelu": (_gelu, ()),
    "relax.nn.gelu_tanh": (_gelu_tanh, ()),
    "relax.nn.softmax": (_softmax, ("axis",)),
}


@relax.expr_functor.mutator
class _Rewriter(relax.PyExprMutator):
    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        name = getattr(call.op, "name", None)
        if name not in FAST or not _is_low(call.args[0]):
            return call
        fast, attrs = FAST[name]
        extra = [int(getattr(call.attrs, a)) for a in attrs]
        return self.builder_.call_te(
            _widened(fast), call.args[0], *extra, primfunc_name_hint=name.split(".")[-1] + "_fast"
        )


def _is_low(expr: relax.Expr) -> bool:
    ty = expr.ty
    return isinstance(ty, relax.TensorType) and str(ty.dtype) in LOW_DTYPES


@tvm.transform.module_pass(opt_level=0, name="tvmamp.LowPrecisionFastMath")
class LowPrecisionFastMath:
    """Rewrite fp16/bf16 exp, erf, tanh, gelu, gelu_tanh and softmax to fp32 fast kernels."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        """Rewrite the calls of every Relax function of ``mod``."""
        rewriter = _Rewriter(mod)
        for gvar, func in mod.functions_items():
            if isinstance(func, relax.Function):
                rewriter.builder_.update_func(gvar, rewriter.visit_expr(func))
        return rewriter.builder_.get()


__all__ = ["FAST", "LowPrecisionFastMath"]
