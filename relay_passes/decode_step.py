"""A decoder's one-token step as a function of its own, chosen at run time.

A decoder exported once for every length computes its self-attention over a symbolic number of
queries ``s`` and keys ``s + past`` (a key-value cache). Its attention may be one
``relax.nn.attention`` (onnxruntime's fused ``Attention`` with ``past`` and ``present``, as its
GPT-2 optimiser writes it), or written out as GEMMs around a softmax (optimum's exports,
torch.export's): ``q[..., s, d] @ k[..., d, past + s]``. Generation calls such a decoder with
``s = 1`` at every step after the first, and most often with one sequence. Built for any ``s``
and batch, that step padded its one row to a tile of 8 in every Linear layer, copied the keys
into a transposed buffer and packed them again: a GPT-2-sized decoder over 2048 cached
positions spent 3.6 of its 10.4 ms a step (O2, one thread) on attention that reads 25 MB, and
its Linear layers read their weights at 27 GB/s, where one row streams them at 45.

:class:`SpecializeDecodeStep` keeps each public function ``f`` with such an attention as a
private ``f_any``, and adds private copies with ``s = 1`` bound: ``f_step``, and where the
function's inputs have a batch axis (axis 0 of an input whose shape also holds ``s``),
``f_step_one`` with that batch bound to 1 as well. ``f`` calls the narrowest copy that the run
time sizes fit. With one query, ``DecomposeAttention`` writes the attention as dot products that
read the cache in place (``relay_passes/attention_ops.py``); with one row, each Linear layer is
a GEMV that streams its weight once (``schedules/cpu/gemv.py``, and the bf16 GEMM rule's GEMV
tile).

The cost is more copies of the function's kernels: about two (no batch axis) or three times
the build time of such a model. Functions without such an attention are left as they are.
"""

from __future__ import annotations

import functools

import tvm
import tvm_ffi
from tvm import relax, tirx
from tvm.ir.expr import Constant
from tvm.tirx.analysis import undefined_vars

from tvmamp.tensors import shape_dims

from .size_checks import ATTR as SIZE_CHECKS

_ATTENTION = {tvm.ir.Op.get("relax.nn.attention"), tvm.ir.Op.get("relax.nn.attention_bias")}
_MATMUL = tvm.ir.Op.get("relax.matmul")
_SOFTMAX = tvm.ir.Op.get("relax.nn.softmax")


@tvm.transform.module_pass(opt_level=0, name="tvmamp.SpecializeDecodeStep")
class SpecializeDecodeStep:
    """Dispatch each public function with a symbolic query length to one-query copies."""

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
                out = _dispatched(out, gvar, func, var, batch_sizes(func, var))
        return out


def query_length(func: relax.Function) -> tirx.Var | None:
    """The symbolic query length of ``func``'s attention: the one size variable that is the
    query length of every attention where it differs from the keys' length, and that a
    parameter's shape defines. None if there is no such attention, or they disagree.

    The attention is a ``relax.nn.attention`` (the queries are axis 1 of ``q``, ``[batch,
    queries, heads, dim]``), or, in a function with a softmax, the scores of one written out:
    a matmul of two computed operands ``[..., s, d] @ [..., d, keys]`` whose keys' length is an
    expression of ``s`` (``past + s``: a cache extended by the queries)."""
    found, scores = set(), set()
    has_softmax = False

    def visit(expr):
        nonlocal has_softmax
        if not isinstance(expr, relax.Call):
            return
        if expr.op.same_as(_SOFTMAX):
            has_softmax = True
        elif any(expr.op.same_as(op) for op in _ATTENTION):
            found.add(_attention_queries(expr))
        elif expr.op.same_as(_MATMUL):
            scores.add(_scores_queries(expr))

    relax.analysis.post_order_visit(func.body, visit)
    if has_softmax:
        found |= scores - {None}
    found.discard(False)  # attention over its own length (an encoder's)
    if len(found) != 1 or None in found:
        return None
    (var,) = found
    params = {v for p in func.params for v in _symbolic_vars(p.ty)}
    return var if var in params else None


def _attention_queries(call: relax.Call):
    """The query length variable of a ``relax.nn.attention`` call; False where it is the keys'
    length or static, None where the shapes are unknown."""
    q, k = call.args[0], call.args[1]
    q_shape, k_shape = shape_dims(q.ty), shape_dims(k.ty)
    if q_shape is None or k_shape is None or len(q_shape) != 4:
        return None
    queries, keys = q_shape[1], k_shape[1]
    if isinstance(queries, tirx.Var) and not tvm_ffi.structural_equal(queries, keys):
        return queries
    return False


def _scores_queries(call: relax.Call):
    """The query length variable of a matmul that computes attention scores over a cache (see
    :func:`query_length`), else None."""
    a, b = call.args[0], call.args[1]
    if isinstance(a, Constant) or isinstance(b, Constant):
        return None
    a_shape, b_shape = shape_dims(a.ty), shape_dims(b.ty)
    if a_shape is None or b_shape is None or len(a_shape) < 3 or len(b_shape) < 3:
        return None
    queries, keys = a_shape[-2], b_shape[-1]
    if not isinstance(queries, tirx.Var) or isinstance(keys, int):
        return None
    if isinstance(keys, tirx.Var) or not any(v.same_as(queries) for v in undefined_vars(keys)):
        return None
    return queries


def batch_sizes(func: relax.Function, queries: tirx.Var) -> list[tirx.Var]:
    """The batch size variables of a decoder ``func`` with query length ``queries``: axis 0
    of each parameter whose shape also holds ``queries`` (``input_ids[batch, s]``,
    ``hidden[batch, s, d]``), where that is a variable other than ``queries``."""
    found = []
    for param in func.params:
        dims = shape_dims(param.ty)
        if not dims or len(dims) < 2 or not isinstance(dims[0], tirx.Var):
            continue
        if dims[0].same_as(queries) or not any(
            isinstance(d, tirx.Var) and d.same_as(queries) for d in dims[1:]
        ):
            continue
        if not any(dims[0].same_as(v) for v in found):
            found.append(dims[0])
    return found


def _symbolic_vars(ty) -> list[tirx.Var]:
    """The size variables that appear bare in the shape(s) of ``ty``."""
    if isinstance(ty, relax.TupleType):
        return [v for field in ty.fields for v in _symbolic_vars(field)]
    return [d for d in shape_dims(ty) or () if isinstance(d, tirx.Var)]


def _dispatched(
    mod: tvm.IRModule,
    gvar: relax.GlobalVar,
    func: relax.Function,
    var: tirx.Var,
    batch: list[tirx.Var],
) -> tvm.IRModule:
    """``mod`` with ``gvar`` a dispatcher to ``<name>_step_one`` (``var`` and ``batch`` = 1),
    ``<name>_step`` (``var`` = 1) and ``<name>_any``."""
    name = gvar.name_hint
    private = func.without_attr("global_symbol")
    if SIZE_CHECKS in private.attrs:  # the dispatcher checks the sizes, once (.size_checks)
        private = private.without_attr(SIZE_CHECKS)
    builder = relax.BlockBuilder(mod)
    copies = [({var: 1, **dict.fromkeys(batch, 1)}, "step_one")] if batch else []
    copies.append(({var: 1}, "step"))
    branches = []  # (condition, copy), narrowest first
    for bound, suffix in copies:
        copy = relax.utils.copy_with_new_vars(private.bind_symbolic_vars(bound))
        ones = [tirx.EQ(size, tirx.IntImm("int64", 1)) for size in bound]  # sizes are int64
        cond = functools.reduce(tirx.And, ones)
        branches.append((cond, builder.add_func(copy, f"{name}_{suffix}")))
    general = builder.add_func(relax.utils.copy_with_new_vars(private), f"{name}_any")

    # the dispatcher keeps the function's own parameters (and the sizes their shapes define)
    params = [relax.Var(p.name, p.ty) for p in func.params]
    chosen = relax.Call(general, params)
    for cond, copy in reversed(branches):
        chosen = relax.If(
            relax.prim_value(cond),
            relax.SeqExpr([], relax.Call(copy, params)),
            _bound(builder, chosen),
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


def _bound(builder: relax.BlockBuilder, expr: relax.Expr) -> relax.SeqExpr:
    """``expr`` as the body of an If branch: a call as it is, an inner If bound to a var."""
    if not isinstance(expr, relax.If):
        return relax.SeqExpr([], expr)
    inner = relax.Var("inner", builder.normalize(expr).ty)
    return relax.SeqExpr([relax.BindingBlock([relax.VarBinding(inner, expr)])], inner)


__all__ = ["SpecializeDecodeStep", "batch_sizes", "query_length"]
