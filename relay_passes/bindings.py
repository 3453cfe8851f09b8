"""Reading a Relax function's bindings, for the graph rewrites that match a few ops in a row.

The rewrites (``FoldBatchNorm``, ``SimplifyMatmulBroadcast``, ``FuseRMSNorm``,
``FuseLayerNorm``) look up what each var is bound to in the function as written, replace a value
only when nothing else reads the values they fold away, and bind the new value in place of the
old binding.
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.ir.expr import Constant
from tvm.relax import PyExprMutator

from tvmamp.tensors import FLOAT_DTYPES

_POWER, _MULTIPLY = tvm.ir.Op.get("relax.power"), tvm.ir.Op.get("relax.multiply")


def bound_values(func: relax.Function) -> dict:
    """Var -> the value bound to it, for the bindings of ``func``'s body."""
    return {b.var: b.value for block in func.body.blocks for b in block.bindings}


def use_counts(func: relax.Function) -> dict:
    """Var -> how many times ``func``'s body (its result included) reads it."""
    counts: dict = {}

    def visit(expr):
        if isinstance(expr, relax.Var):
            counts[expr] = counts.get(expr, 0) + 1

    relax.analysis.post_order_visit(func.body, visit)
    return counts


def call_of(value: relax.Expr | None, op) -> relax.Call | None:
    """``value`` when it is a call of ``op``, else None."""
    return value if isinstance(value, relax.Call) and value.op == op else None


_CONVS = {
    "relax.nn.conv1d": relax.op.nn.conv1d,
    "relax.nn.conv2d": relax.op.nn.conv2d,
    "relax.nn.conv3d": relax.op.nn.conv3d,
}


def rebuilt_conv(call: relax.Call, data: relax.Expr, weight: relax.Expr, **changes) -> relax.Expr:
    """The conv1d/conv2d/conv3d ``call`` on ``data`` and ``weight``, with its attributes but
    those named in ``changes`` (``padding``, ``out_dtype``...)."""
    attrs = call.attrs
    fields = ("strides", "padding", "dilation", "groups", "data_layout", "kernel_layout")
    options = {name: getattr(attrs, name) for name in (*fields, "out_layout", "out_dtype")}
    return _CONVS[call.op.name](data, weight, **{**options, **changes})


def scalar_constant(expr: relax.Expr) -> float | None:
    """The value of a float constant of one element, or None."""
    if not isinstance(expr, Constant) or str(expr.value.dtype) not in FLOAT_DTYPES:
        return None
    data = expr.value.numpy()
    return float(data.astype("float64").reshape(())) if data.size == 1 else None


def squares(value: relax.Expr | None, x: relax.Expr) -> bool:
    """Whether ``value`` is ``x ** 2`` or ``x * x``."""
    power = call_of(value, _POWER)
    if power is not None:
        return power.args[0].same_as(x) and scalar_constant(power.args[1]) == 2.0
    times = call_of(value, _MULTIPLY)
    return times is not None and all(a.same_as(x) for a in times.args)


def means_last_axis(mean: relax.Call) -> bool:
    """Whether the ``relax.mean`` call ``mean`` averages its input's last axis only and keeps
    the dimension (the statistics of a row norm)."""
    ndim = getattr(mean.args[0].ty, "ndim", -1)
    if ndim < 1 or mean.attrs.axis is None or not mean.attrs.keepdims:
        return False
    return [int(a) % ndim for a in mean.attrs.axis] == [ndim - 1]


def rewrite_functions(mod, rewriter: PyExprMutator):
    """``mod`` with every Relax function visited by ``rewriter`` (a mutator built on ``mod``):
    the body of a pass that rewrites calls one at a time."""
    for gvar, func in mod.functions_items():
        if isinstance(func, relax.Function):
            rewriter.builder_.update_func(gvar, rewriter.visit_expr(func))
    return rewriter.builder_.get()


def readers(func: relax.Function) -> dict:
    """Var -> the binding vars whose values read it (None for the function's result)."""
    found: dict = {}
    for block in func.body.blocks:
        for binding in block.bindings:
            for var in relax.analysis.free_vars(binding.value):
                found.setdefault(var, set()).add(binding.var)
    for var in relax.analysis.free_vars(func.body.body):
        found.setdefault(var, set()).add(None)
    return found


def rewrite_matches(mod, rewriter: PyExprMutator):
    """``mod`` with every Relax function visited by ``rewriter`` (a mutator built on ``mod``
    that matches a few ops in a row), its ``values``, ``uses`` and ``readers`` those of the
    function as written (:func:`bound_values`, :func:`use_counts`, :func:`readers`); the
    bindings it left dead are removed."""
    for gvar, func in mod.functions_items():
        if isinstance(func, relax.Function) and isinstance(func.body, relax.SeqExpr):
            rewriter.values, rewriter.uses = bound_values(func), use_counts(func)
            rewriter.readers = readers(func)
            rewriter.builder_.update_func(gvar, rewriter.visit_expr(func))
    return relax.transform.DeadCodeElimination()(rewriter.builder_.get())


def rebind(mutator: PyExprMutator, var: relax.Var, value: relax.Expr, name: str) -> None:
    """Bind ``value`` in place of ``var``'s binding: a new var named ``name`` that ``var``'s
    readers read, or ``var`` itself when it is a result of the dataflow block."""
    builder = mutator.builder_
    if isinstance(var, relax.DataflowVar):
        mutator.set_var_remap(var, builder.emit(value, name))
    else:
        builder.emit_normalized(relax.VarBinding(var, builder.normalize(value)))


__all__ = [
    "bound_values",
    "call_of",
    "readers",
    "rebind",
    "rewrite_functions",
    "rewrite_matches",
    "means_last_axis",
    "scalar_constant",
    "squares",
    "use_counts",
]
