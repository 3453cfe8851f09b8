"""SlicesToSplit: a tensor cut into many slices along one axis (a sequence unbound into steps)
becomes one ``split``, so that the steps' kernels are the same function.

torch decomposes a GRU (and other unrolled recurrences) into one input projection over the
whole sequence, ``[T, B, 3H]``, and ``T`` slices of it, one per step. ``FuseOps`` fuses each
slice into its step's gate kernel, and since the slices differ in their offset, so do the
``T`` kernels: a 50-step GRU compiled 48 gate kernels of a few hundred lines each (80 s at O0,
230 s at O2). ``split`` returns a tuple, which ``FuseOps`` does not fuse through: the parts are
copied once by one kernel, and every step's kernel reads a whole ``[B, 3H]`` tensor, the same
function for every step (compiled once).

Slices are gathered per source tensor and axis: static-shape ``strided_slice`` calls with unit
stride along one axis, more than :data:`.split_to_slices.MAX_PARTS` of them, that cut the axis
into disjoint pieces covering all of it. The opposite case, a few gate slices, is
:mod:`.split_to_slices`.
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax import PyExprMutator

from tvmamp.tensors import static_shape

from .split_to_slices import MAX_PARTS

_SLICE = tvm.ir.Op.get("relax.strided_slice")


@tvm.transform.module_pass(opt_level=0, name="tvmamp.SlicesToSplit")
class SlicesToSplit:
    """Rewrite each full set of many unit-stride slices of a tensor along one axis as a split."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        """Rewrite the sliced sequences of every Relax function of ``mod``."""
        rewriter = _Rewriter(mod)
        for gvar, func in mod.functions_items():
            if isinstance(func, relax.Function):
                rewriter.plan = _plan(func)
                if rewriter.plan:
                    rewriter.builder_.update_func(gvar, rewriter.visit_expr(func))
        return rewriter.builder_.get()


def _plan(func: relax.Function) -> dict:
    """Slice variable -> ``(source, axis, cut points, part index)`` for every slice of a
    sequence this pass rewrites."""
    groups: dict = {}
    for block in func.body.blocks:
        for binding in block.bindings:
            piece = _piece(binding.value)
            if piece is not None:
                source, axis, begin, end = piece
                groups.setdefault((source, axis), []).append((begin, end, binding.var))
    plan = {}
    for (source, axis), pieces in groups.items():
        pieces.sort(key=lambda p: p[0])
        edges = [p[0] for p in pieces] + [pieces[-1][1]]
        size = static_shape(source.ty)[axis]
        contiguous = all(a[1] == b[0] for a, b in zip(pieces, pieces[1:]))
        if len(pieces) <= MAX_PARTS or not contiguous or edges[0] != 0 or edges[-1] != size:
            continue
        for index, (_, _, var) in enumerate(pieces):
            plan[var] = (source, axis, tuple(edges[1:-1]), index)
    return plan


def _piece(value) -> tuple | None:
    """``(source, axis, begin, end)`` of a static unit-stride slice along one axis, else None."""
    if not isinstance(value, relax.Call) or value.op != _SLICE or len(value.args) < 4:
        return None
    source = value.args[0]
    shape = static_shape(source.ty) if isinstance(source, relax.Var) else None
    fields = [_ints(a) for a in value.args[1:4]]
    strides = _ints(value.args[4]) if len(value.args) > 4 else None
    if shape is None or None in fields or any(len(f) != 1 for f in fields):
        return None
    if strides not in (None, (1,)):
        return None
    (axis,), (begin,), (end,) = fields
    axis %= len(shape)
    if not 0 <= begin < end <= shape[axis]:
        return None
    return source, axis, begin, end


def _ints(expr) -> tuple[int, ...] | None:
    if not isinstance(expr, relax.Tuple):
        return None
    values = []
    for field in expr.fields:
        value = getattr(field, "value", None)  # a PrimValue holds an IntImm
        value = getattr(value, "value", value)
        if not isinstance(value, int):
            return None
        values.append(value)
    return tuple(values)


@relax.expr_functor.mutator
class _Rewriter(PyExprMutator):
    def __init__(self, mod: tvm.IRModule):
        super().__init__(mod)
        self.plan: dict = {}
        self.splits: dict = {}

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        if binding.var not in self.plan:
            super().visit_var_binding_(binding)
            return
        source, axis, cuts, index = self.plan[binding.var]
        key = (source, axis)
        if key not in self.splits:
            split = relax.op.split(self.visit_expr(source), list(cuts), axis)
            self.splits[key] = self.builder_.emit(split)
        part = self.builder_.emit(relax.TupleGetItem(self.splits[key], index), binding.var.name)
        self.set_var_remap(binding.var, part)
