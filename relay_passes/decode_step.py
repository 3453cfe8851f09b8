"""A decoder's one-token step as a function of its own, chosen at run time.

A decoder exported once for every length with its attention as ``relax.nn.attention``
(onnxruntime's fused ``Attention`` with ``past`` and ``present``, as its GPT-2 optimiser writes
it) computes that attention over a symbolic number of queries ``s`` and keys ``s + past``.
Attention written out as GEMMs and a softmax (optimum's exports, torch.export's) is not
recognised here. Generation calls such a decoder with ``s = 1`` at every step after the
first; the kernels built for any ``s`` padded that one query to a tile of 8 rows, copied the
keys into a transposed buffer and packed them again, on every step: a GPT-2-sized decoder over
2048 cached positions spent 3.6 of its 10.4 ms a step (O2, one thread) on attention that reads
25 MB.

:class:`SpecializeDecodeStep` keeps each public function ``f`` whose attention has a symbolic
query length ``s`` of its own (not the keys' length too) as a private ``f_any``, adds a private
``f_step`` with ``s = 1`` bound, and makes ``f`` call ``f_step`` when ``s == 1`` at run time
and ``f_any`` otherwise. Built with one query, ``DecomposeAttention`` writes the attention as
dot products that read the cache in place (``relay_passes/attention_ops.py``), and every
other kernel of the step (the Linear layers, the norms) is built for one row.

The cost is a second copy of the function's kernels: about twice the build time of such a
model. Functions without such an attention are left as they are.
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import relax, tirx

from tvmamp.tensors import shape_dims

from .size_checks import ATTR as SIZE_CHECKS

_ATTENTION = {tvm.ir.Op.get("relax.nn.attention"), tvm.ir.Op.get("relax.nn.attention_bias")}


@tvm.transform.module_pass(opt_level=0, name="tvmamp.SpecializeDecodeStep")
class SpecializeDecodeStep:
    """Dispatch each public function with a symbolic query length to a one-query copy."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        """Specialise every public Relax function of ``mod`` that fits (see the module doc)."""
        out = mod
        for gvar, func in mod.functions_items():
            if not isinstance(func, relax.Function) or func.attrs is None:
                continue
            if "global_symbol" not in func.attrs:
                continue
            var = query_length(func)
            if var is not None:
                out = _dispatched(out, gvar, func, var)
        return out


def query_length(func: relax.Function) -> tirx.Var | None:
    """The symbolic query length of ``func``'s attention: the one size variable that is the
    query length (axis 1 of ``q``, ``[batch, queries, heads, dim]``) of every attention call
    where it differs from the keys' length, and that a parameter's shape defines. None if
    there is no such call, or they disagree."""
    found = set()

    def visit(expr):
        if isinstance(expr, relax.Call) and any(expr.op.same_as(op) for op in _ATTENTION):
            q, k = expr.args[0], expr.args[1]
            if not (isinstance(q.ty, relax.TensorType) and isinstance(k.ty, relax.TensorType)):
                found.add(None)
                return
            if q.ty.shape is None or k.ty.shape is None or q.ty.ndim != 4:
                found.add(None)
                return
            queries, keys = q.ty.shape.values[1], k.ty.shape.values[1]
            if isinstance(queries, tirx.Var) and not tvm_ffi.structural_equal(queries, keys):
                found.add(queries)

    relax.analysis.post_order_visit(func.body, visit)
    if len(found) != 1 or None in found:
        return None
    (var,) = found
    params = {v for p in func.params for v in _symbolic_vars(p.ty)}
    return var if var in params else None


def _symbolic_vars(ty) -> list[tirx.Var]:
    """The size variables that appear bare in the shape(s) of ``ty``."""
    if isinstance(ty, relax.TupleType):
        return [v for field in ty.fields for v in _symbolic_vars(field)]
    return [d for d in shape_dims(ty) or () if isinstance(d, tirx.Var)]


def _dispatched(
    mod: tvm.IRModule, gvar: relax.GlobalVar, func: relax.Function, var: tirx.Var
) -> tvm.IRModule:
    """``mod`` with ``gvar`` a dispatcher to ``<name>_step`` (``var`` = 1) and ``<name>_any``."""
    name = gvar.name_hint
    private = func.without_attr("global_symbol")
    if SIZE_CHECKS in private.attrs:  # the dispatcher checks the sizes, once (.size_checks)
        private = private.without_attr(SIZE_CHECKS)
    step = relax.utils.copy_with_new_vars(private.bind_symbolic_vars({var: 1}))
    general = relax.utils.copy_with_new_vars(private)
    builder = relax.BlockBuilder(mod)
    step_gvar = builder.add_func(step, f"{name}_step")
    any_gvar = builder.add_func(general, f"{name}_any")

    # the dispatcher keeps the function's own parameters (and the sizes their shapes define)
    params = [relax.Var(p.name, p.ty) for p in func.params]
    cond = relax.prim_value(tirx.EQ(var, tirx.IntImm("int64", 1)))  # sizes are int64
    chosen = relax.If(
        cond,
        relax.SeqExpr([], relax.Call(step_gvar, params)),
        relax.SeqExpr([], relax.Call(any_gvar, params)),
    )
    chosen_var = relax.Var("chosen", builder.normalize(chosen).ty)
    result = relax.Var("result", func.ret_ty)
    bindings = [
        relax.VarBinding(chosen_var, chosen),
        relax.MatchCast(result, chosen_var, func.ret_ty),  # the shapes the branches lost
    ]
    body = relax.SeqExpr([relax.BindingBlock(bindings)], result)
    dispatcher = relax.Function(params, body, func.ret_ty, func.is_pure, func.attrs, func.span)
    builder.update_func(gvar, dispatcher)
    return builder.finalize()


__all__ = ["SpecializeDecodeStep", "query_length"]
