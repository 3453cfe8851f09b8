"""Undo the shape plumbing that importers put around a matmul: broadcasts and flattening.

PyTorch decomposes ``x[b, m, k] @ W[k, n]`` into ``bmm(expand(x), expand(W))``, so the Relax
importer emits ``matmul(broadcast_to(x, [b, m, k]), broadcast_to(W, [b, k, n]))``. Relax's
``matmul`` broadcasts by itself, and the explicit copy is harmful: with ``W`` a weight,
``FoldConstant`` materialises ``b`` copies of it (a TransformerEncoderLayer's 1536x512 in-proj
became a 403 MB constant, and the bf16 GEMM packed each copy), and the kernel becomes a batch of
``b`` small GEMMs instead of one GEMM over ``b * m`` rows.

It also flattens: ``x[b, m, k] @ W`` becomes ``reshape(matmul(reshape(x, [b * m, k]), W),
[b, m, n])``, and attention's ``q[b, h, m, k] @ kt[b, h, k, n]`` a 3-D matmul between two such
reshapes. The reshapes cost nothing by themselves, but ``FuseOps`` fuses only elementwise and
broadcast ops into a matmul's epilogue, so the ops after the reshape back (attention's scale
and mask, a residual add) ran as kernels of their own.

:class:`SimplifyMatmulBroadcast` rewrites ``matmul(a, broadcast_to(w, batch + w.shape))`` to
``matmul(a, w)`` when ``a``'s batch dimensions are ``batch`` (the result is the same value of
the same shape), ``broadcast_to(x, x.shape)`` to ``x``, and ``reshape(matmul(reshape(a),
reshape(b)), shape)`` (or with ``b`` a 2-D matrix) to ``matmul(a, b)`` when the reshapes only
flatten leading dimensions and ``shape`` is what ``matmul(a, b)`` gives. A scalar constant
scale of an operand moves to the result: ``matmul(a * s, b * t)`` is ``matmul(a, b) * (s * t)``
(``F.scaled_dot_product_attention`` scales q and k by sqrt(scale) each). The scale then fuses
into the matmul's epilogue, and the head-splitting transposes of q and k that carried it become
pure copies, which run as register transposes (a TransformerEncoderLayer's k took 1.2 ms of
18 as a scaled transposing copy). Dead bindings are removed; the matmul keeps the name of the
binding it replaces.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax
from tvm.relax import PyExprMutator

from tvmamp.tensors import static_shape

from .bindings import bound_values, call_of, rebind, scalar_constant, use_counts

_BROADCAST = tvm.ir.Op.get("relax.broadcast_to")
_MATMUL = tvm.ir.Op.get("relax.matmul")
_RESHAPE = tvm.ir.Op.get("relax.reshape")
_MULTIPLY = tvm.ir.Op.get("relax.multiply")


@tvm.transform.module_pass(opt_level=0, name="tvmamp.SimplifyMatmulBroadcast")
class SimplifyMatmulBroadcast:
    """Remove the broadcasts of matmul operands that ``matmul`` itself would do, and the
    reshapes that flatten a matmul's leading dimensions and restore them after it."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        """Rewrite every Relax function of ``mod``."""
        rewriter = _Rewriter(mod)
        for gvar, func in mod.functions_items():
            if isinstance(func, relax.Function):
                rewriter.values, rewriter.uses = bound_values(func), use_counts(func)
                rewriter.builder_.update_func(gvar, rewriter.visit_expr(func))
        return relax.transform.DeadCodeElimination()(rewriter.builder_.get())


def _shape(expr: relax.Expr) -> tuple[int, ...] | None:
    return static_shape(expr.ty)


def _is_identity_broadcast(value: relax.Expr) -> bool:
    if not (isinstance(value, relax.Call) and value.op == _BROADCAST):
        return False
    shape = _shape(value)
    return shape is not None and shape == _shape(value.args[0])


# Elementwise ops that may sit between a flattened matmul and the reshape back: with their
# other operands a scalar or one value per column, they give the same values on either shape.
_EPILOGUE_OPS = frozenset(
    f"relax.{name}"
    for name in (
        "astype add subtract multiply divide maximum minimum power clip negative exp erf tanh "
        "sigmoid sqrt rsqrt nn.relu nn.gelu nn.gelu_tanh nn.silu"
    ).split()
)


def _per_column(operand: relax.Expr, columns: int) -> bool:
    """Whether ``operand`` is not a tensor, or one value or one value per column."""
    if not isinstance(getattr(operand, "ty", None), relax.TensorType):
        return True
    shape = _shape(operand)
    if shape is None:
        return False
    while shape and shape[0] == 1:
        shape = shape[1:]
    return shape in ((), (columns,))


def epilogue_argument(value: relax.Expr | None, var: relax.Var) -> int | None:
    """The argument of the elementwise ``value`` (bound to ``var``) that has its shape, when
    every other argument is one value per column: ``value`` then gives the same values row by
    row on any arrangement of the rows."""
    if not isinstance(value, relax.Call) or str(getattr(value.op, "name", "")) not in (
        _EPILOGUE_OPS
    ):
        return None
    shape = _shape(var)
    full = [i for i, arg in enumerate(value.args) if _shape(arg) == shape and shape]
    if len(full) != 1:
        return None
    others = [arg for i, arg in enumerate(value.args) if i != full[0]]
    return full[0] if all(_per_column(arg, shape[-1]) for arg in others) else None


@relax.expr_functor.mutator
class _Rewriter(PyExprMutator):
    def __init__(self, mod: tvm.IRModule):
        super().__init__(mod)
        self.values: dict = {}  # var -> bound value, of the function being rewritten
        self.uses: dict = {}  # var -> how many bindings read it

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        """An identity broadcast inside a dataflow block: its uses read the source instead.

        No alias binding is left, so that the names of the other bindings (the nodes of
        per-node precision control) do not change. A reshape back from a flattened matmul
        becomes that matmul, and its epilogue, on the unflattened operands.
        """
        value = binding.value
        if isinstance(binding.var, relax.DataflowVar) and _is_identity_broadcast(value):
            source = self.visit_expr(value.args[0])
            if isinstance(source, relax.Var):
                self.set_var_remap(binding.var, source)
                return
        matmul = call_of(value, _MATMUL)
        if matmul is not None and self._scale(matmul.args) != 1.0:
            a, b = matmul.args
            rebind(self, binding.var, *self._product(a, b, matmul.attrs.out_dtype, binding.var))
            return
        plan = self._unflatten_plan(binding)
        if plan is None:
            super().visit_var_binding_(binding)
            return
        matmul_var, (a, b, out_dtype), chain = plan
        value, name = self._product(a, b, out_dtype, matmul_var)
        for var, call, index in chain:  # the epilogue, in order, on the unflattened result
            value = self._with_arg(call, index, self.builder_.emit(value, name))
            name = var.name
        rebind(self, binding.var, value, name)

    def _product(self, a, b, out_dtype, var) -> tuple[relax.Expr, str]:
        """``matmul(a, b)`` with the operands' scalar scales after it (:meth:`_unscale`), and
        the name for its binding: ``var``'s, or ``<var>_scaled`` for the scale, the matmul
        binding ``var``'s name."""
        (a, s), (b, t) = self._unscale(a), self._unscale(b)
        # visited as a call, so that the broadcasts of its operands are dropped too
        value = self.visit_expr(relax.op.matmul(a, b, out_dtype))
        if s * t == 1.0 or not np.isfinite(s * t):
            return value, var.name
        product = self.builder_.emit(value, var.name)
        return relax.op.multiply(product, relax.const(s * t, str(product.ty.dtype))), (
            f"{var.name}_scaled"
        )

    def _scale(self, operands) -> float:
        """The product of the operands' scalar scales (:meth:`_unscale`); 1.0 when it is not
        finite (nothing is moved)."""
        scale = self._unscale(operands[0])[1] * self._unscale(operands[1])[1]
        return scale if np.isfinite(scale) else 1.0

    def _with_arg(self, call: relax.Call, index: int, value: relax.Expr) -> relax.Call:
        """``call`` with its arguments visited and argument ``index`` replaced by ``value``."""
        args = [value if i == index else self.visit_expr(arg) for i, arg in enumerate(call.args)]
        return relax.Call(call.op, args, call.attrs, call.ty_args)

    def _unscale(self, operand: relax.Expr) -> tuple[relax.Expr, float]:
        """``(x, s)`` when ``operand`` is ``x * s`` (or ``s * x``, or an identity broadcast of
        it), read only here, with ``s`` a finite float constant of one element; else
        ``(operand, 1.0)``."""
        source = operand
        while self.uses.get(source, 0) == 1 and _is_identity_broadcast(self.values.get(source)):
            source = self.values[source].args[0]
        multiply = call_of(self.values.get(source), _MULTIPLY)
        if multiply is None or self.uses.get(source, 0) != 1:
            return operand, 1.0
        for x, s in (multiply.args, reversed(multiply.args)):
            factor = scalar_constant(s)
            if factor is not None and np.isfinite(factor) and _shape(x) == _shape(source):
                return x, factor
        return operand, 1.0

    def _unflatten_plan(self, binding: relax.VarBinding):
        """For ``var = reshape(epilogue(matmul(reshape(a), reshape(b))))``, where the reshapes
        only flatten leading dimensions and the result has ``matmul(a, b)``'s shape: ``(matmul
        var, (a, b, out_dtype), [(var, call, index of the chain argument)] of the epilogue)``.
        Every value in between must have no other reader. None otherwise."""
        reshape = call_of(binding.value, _RESHAPE)
        out = _shape(binding.var)
        if reshape is None or out is None:
            return None
        chain = []
        current = reshape.args[0]
        while True:
            if not isinstance(current, relax.Var) or self.uses.get(current, 0) != 1:
                return None
            value = self.values.get(current)
            if call_of(value, _MATMUL) is not None:
                break
            index = epilogue_argument(value, current)
            if index is None:
                return None
            chain.insert(0, (current, value, index))
            current = value.args[index]
        operands = self._unflattened_operands(value, out)
        return None if operands is None else (current, operands, chain)

    def _unflattened_operands(self, matmul: relax.Call, out: tuple[int, ...]):
        """``(a, b, out_dtype)`` such that ``matmul(a, b)`` has shape ``out`` and the values of
        ``matmul`` (flattened leading dimensions), or None."""
        a, b = (self._flattened_from(arg) for arg in matmul.args)
        if a is None:
            return None
        flat_a, flat_b = _shape(matmul.args[0]), _shape(matmul.args[1])
        a_shape = _shape(a)
        b_shape = _shape(b if b is not None else matmul.args[1])
        if None in (a_shape, b_shape, flat_a, flat_b) or flat_a[-1] != a_shape[-1]:
            return None
        if b is None:  # rows of a flattened, b one matrix: x[..., k] @ W[k, n]
            if len(b_shape) != 2 or out != (*a_shape[:-1], b_shape[1]):
                return None
            b = matmul.args[1]
        else:  # the batches of both flattened: q[..., m, k] @ kt[..., k, n]
            batch = a_shape[:-2]
            if not (
                len(flat_a) == len(flat_b) == 3
                and flat_a[-2:] == a_shape[-2:]
                and flat_b[-2:] == b_shape[-2:]
                and b_shape[:-2] == batch
                and out == (*batch, a_shape[-2], b_shape[-1])
            ):
                return None
        return a, b, matmul.attrs.out_dtype

    def _flattened_from(self, operand: relax.Expr) -> relax.Expr | None:
        """The tensor that ``operand`` reshapes, or None."""
        reshape = call_of(self.values.get(operand), _RESHAPE)
        return reshape.args[0] if reshape is not None else None

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
