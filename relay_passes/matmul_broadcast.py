"""Drop the ``broadcast_to`` that importers put around a matmul's operands.

PyTorch decomposes ``x[b, m, k] @ W[k, n]`` into ``bmm(expand(x), expand(W))``, so the Relax
importer emits ``matmul(broadcast_to(x, [b, m, k]), broadcast_to(W, [b, k, n]))``. Relax's
``matmul`` broadcasts by itself, and the explicit copy is harmful: with ``W`` a weight,
``FoldConstant`` materialises ``b`` copies of it (a TransformerEncoderLayer's 1536x512 in-proj
became a 403 MB constant, and the bf16 GEMM packed each copy), and the kernel becomes a batch of
``b`` small GEMMs instead of one GEMM over ``b * m`` rows.

:class:`SimplifyMatmulBroadcast` rewrites ``matmul(a, broadcast_to(w, batch + w.shape))`` to
``matmul(a, w)`` when ``a``'s batch dimensions are ``batch`` (the result is the same value of
the same shape), and ``broadcast_to(x, x.shape)`` to ``x``. Dead bindings are removed; no
binding is renamed.
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax import PyExprMutator

from tvmamp.tensors import static_shape

_BROADCAST = tvm.ir.Op.get("relax.broadcast_to")
_MATMUL = tvm.ir.Op.get("relax.matmul")


@tvm.transform.module_pass(opt_level=0, name="tvmamp.SimplifyMatmulBroadcast")
class SimplifyMatmulBroadcast:
    """Remove the broadcasts of matmul operands that ``matmul`` itself would do."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        """Rewrite every Relax function of ``mod``."""
        rewriter = _Rewriter(mod)
        for gvar, func in mod.functions_items():
            if isinstance(func, relax.Function):
                rewriter.builder_.update_func(gvar, rewriter.visit_expr(func))
        return relax.transform.DeadCodeElimination()(rewriter.builder_.get())


def _shape(expr: relax.Expr) -> tuple[int, ...] | None:
    return static_shape(expr.ty)


def _is_identity_broadcast(value: relax.Expr) -> bool:
    if not (isinstance(value, relax.Call) and value.op == _BROADCAST):
        return False
    shape = _shape(value)
    return shape is not None and shape == _shape(value.args[0])


@relax.expr_functor.mutator
class _Rewriter(PyExprMutator):
    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        """An identity broadcast inside a dataflow block: its uses read the source instead.

        No alias binding is left, so that the names of the other bindings (the nodes of
        per-node precision control) do not change.
        """
        value = binding.value
        if isinstance(binding.var, relax.DataflowVar) and _is_identity_broadcast(value):
            source = self.visit_expr(value.args[0])
            if isinstance(source, relax.Var):
                self.set_var_remap(binding.var, source)
                return
        super().visit_var_binding_(binding)

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if call.op == _MATMUL:
            a, b = call.args
            source = self._unbroadcast(b, _shape(a))
            if source is not None:
                return relax.op.matmul(a, source, out_dtype=call.attrs.out_dtype)
        return call

    def _unbroadcast(self, b: relax.Expr, a_shape: tuple[int, ...] | None) -> relax.Expr | None:
        """The tensor ``b`` broadcasts, when only leading dims equal to ``a``'s batch are added."""
        value = self.lookup_binding(b) if isinstance(b, relax.Var) else b
        if not (isinstance(value, relax.Call) and value.op == _BROADCAST) or a_shape is None:
            return None
        source = value.args[0]
        shape, source_shape = _shape(value), _shape(source)
        if shape is None or source_shape is None or len(source_shape) < 2:
            return None
        batch = shape[: len(shape) - len(source_shape)]
        if shape[len(batch) :] != source_shape or tuple(a_shape[:-2]) != batch:
            return None
        return source
