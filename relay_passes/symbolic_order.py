"""Keep each binding after the ``match_cast`` that defines the symbolic sizes it uses.

A size known only at run time (the rows of one expert of a MoE layer,
:mod:`tvmamp.frontends.torch_moe`) is defined mid-function by a ``match_cast`` of a shape
computed from data. A call that uses that size without reading the cast value (``zeros`` of
the padding rows, a ``strided_slice`` ending at it) depends on the ``match_cast`` only through
the symbolic variable. TVM's ``FuseOps`` re-emits each dataflow block in the order of its data
dependencies alone, so it can move such a call above the ``match_cast``; the VM then fails
to build ("PrimExpr ... has not been computed", Qwen2-MoE).

:class:`OrderShapeDefinitions` restores a valid order: within each block, a stable
topological sort over both kinds of dependency (values and symbolic variables), which leaves
an already valid block as it is.
"""

from __future__ import annotations

import heapq

import tvm
from tvm import relax


@tvm.transform.module_pass(opt_level=0, name="tvmamp.OrderShapeDefinitions")
class OrderShapeDefinitions:
    """Move each binding below the bindings that define the values and sizes it uses."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        updates = {}
        for gvar, func in mod.functions_items():
            if isinstance(func, relax.Function) and isinstance(func.body, relax.SeqExpr):
                known = {v for param in func.params for v in _symbolic_vars(param.ty)}
                blocks = [_ordered(block, known) for block in func.body.blocks]
                if any(new is not old for new, old in zip(blocks, func.body.blocks, strict=True)):
                    body = relax.SeqExpr(blocks, func.body.body, func.body.span)
                    updates[gvar] = relax.Function(
                        func.params, body, func.ret_ty, func.is_pure, func.attrs, func.span
                    )
        if not updates:
            return mod
        mod = tvm.IRModule(dict(mod.functions_items()), attrs=mod.attrs)
        for gvar, func in updates.items():
            mod[gvar] = func
        return mod


def _ordered(block: relax.BindingBlock, known: set) -> relax.BindingBlock:
    """``block`` with its bindings in a valid order (``block`` itself when it has one).

    ``known`` holds the symbolic variables defined before the block (by the function's
    parameters); a ``match_cast`` to a shape that uses one of them only checks it. The block's
    own definitions are added to it."""
    bindings = list(block.bindings)
    definer = {}  # relax var or symbolic var -> index of the binding that defines it
    for index, binding in enumerate(bindings):
        definer[binding.var] = index
        if isinstance(binding, relax.MatchCast):
            for var in _symbolic_vars(binding.ty):
                if var not in known:
                    definer.setdefault(var, index)
    known.update(v for v in definer if isinstance(v, tvm.tirx.Var))
    needs = [set() for _ in bindings]
    for index, binding in enumerate(bindings):
        used = list(relax.analysis.free_vars(binding.value))
        used += relax.analysis.free_symbolic_vars(binding.value)
        if not isinstance(binding, relax.MatchCast):
            used += _symbolic_vars(binding.var.ty)
        needs[index] = {definer[v] for v in used if v in definer and definer[v] != index}
    if all(all(d < i for d in deps) for i, deps in enumerate(needs)):
        return block
    waiting = [len(deps) for deps in needs]
    users = [[] for _ in bindings]
    for index, deps in enumerate(needs):
        for dep in deps:
            users[dep].append(index)
    ready = [i for i, count in enumerate(waiting) if count == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        index = heapq.heappop(ready)
        order.append(bindings[index])
        for user in users[index]:
            waiting[user] -= 1
            if waiting[user] == 0:
                heapq.heappush(ready, user)
    if len(order) != len(bindings):
        raise RuntimeError("tvmamp.OrderShapeDefinitions: a dependency cycle among bindings")
    if isinstance(block, relax.DataflowBlock):
        return relax.DataflowBlock(order, block.span)
    return relax.BindingBlock(order, block.span)


def _symbolic_vars(ty) -> list:
    """The symbolic variables in the shape of a tensor or shape type (or a tuple of them)."""
    if isinstance(ty, relax.TupleType):
        return [v for field in ty.fields for v in _symbolic_vars(field)]
    values = getattr(ty, "values", None) if isinstance(ty, relax.ShapeType) else None
    if isinstance(ty, relax.TensorType) and ty.shape is not None:
        values = getattr(ty.shape, "values", None)
    if not values:
        return []
    return list(relax.analysis.free_symbolic_vars(relax.ShapeExpr(list(values))))
