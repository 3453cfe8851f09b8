"""SplitToSlices: a ``split`` whose parts only feed elementwise or layout ops becomes slices.

``split`` is a kernel of its own with one output per part (a tuple), and ``FuseOps`` fuses
nothing through a tuple: an LSTM step ran ``add + split`` of its gate pre-activations, then the
sigmoid/tanh gates and the cell update as separate kernels, each a few hundred nanoseconds of
work behind a kernel call. A ``strided_slice`` per part is an injective op that fuses into its
elementwise consumers, so the slices, gates and cell update become one kernel reading the gate
matmul's result in place.

The same holds for parts read by layout ops (``reshape``, ``permute_dims``, ``squeeze``): an
attention's ``q``, ``k``, ``v`` split from one projection (ONNX exports of torch attention)
become three slice chains, each one copy kernel, which :mod:`.gemm_layout` then merges into the
packing of the GEMMs that read ``K^T`` and ``V`` instead of a whole copy of the projection
first. Only splits into at most :data:`MAX_PARTS` parts along a static axis, whose every part is
read by elementwise or layout ops alone, are rewritten: a part that feeds a matmul directly
would be a copy either way, and a split over time steps (a decomposed GRU reads its input projection
as 50 parts, one per step) would put a different slice offset in each step's kernel, so no two
steps' kernels would be the same function any more: 48 kernels to compile instead of one, and
an 80 s build where 6 s had done.
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax import PyExprMutator

from .conv2d_rows import BINARY_OPS, UNARY_OPS
from .row_layout import LAYOUT_OPS

_SPLIT = tvm.ir.Op.get("relax.split")
# Gates (an LSTM's 4, a GLU's 2); more parts are a sequence's steps (see the module docstring).
MAX_PARTS = 4
# The elementwise ops the rows rewrite follows, and a few more that read one value per element.
ELEMENTWISE = frozenset(UNARY_OPS + BINARY_OPS) | frozenset(
    tvm.ir.Op.get(f"relax.{name}")
    for name in ("power", "negative", "abs", "exp", "sqrt", "rsqrt", "erf")
)


@tvm.transform.module_pass(opt_level=0, name="tvmamp.SplitToSlices")
class SplitToSlices:
    """Rewrite each ``split`` whose parts feed only elementwise or layout ops into slices."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        """Rewrite the splits of every Relax function of ``mod``; the unused ones are removed."""
        rewriter = _Rewriter(mod)
        for gvar, func in mod.functions_items():
            if isinstance(func, relax.Function):
                rewriter.parts = _sliceable_parts(func)
                if rewriter.parts:
                    func = relax.analysis.remove_all_unused(rewriter.visit_expr(func))
                    rewriter.builder_.update_func(gvar, func)
        return rewriter.builder_.get()


def _sliceable_parts(func: relax.Function) -> dict:
    """``TupleGetItem`` variable -> ``(data, axis, begin, end)`` for each part of a split that
    only elementwise or layout ops read, when every part of that split is read that way."""
    bindings = [b for block in func.body.blocks for b in block.bindings]
    splits = {
        b.var: b.value
        for b in bindings
        if isinstance(b.value, relax.Call)
        and b.value.op == _SPLIT
        and len(_bounds(b.value) or ()) in range(2, MAX_PARTS + 1)
    }
    parts, users = {}, {}
    for binding in bindings:
        value = binding.value
        if isinstance(value, relax.TupleGetItem) and value.tuple_value in splits:
            parts[binding.var] = value
        for var in relax.analysis.free_vars(value):
            users.setdefault(var, []).append(value)
    outputs = set(relax.analysis.free_vars(func.body.body))
    found = {}
    for split_var, split in splits.items():
        mine = {v: p for v, p in parts.items() if p.tuple_value.same_as(split_var)}
        direct = [u for u in users.get(split_var, []) if not isinstance(u, relax.TupleGetItem)]
        if not mine or direct or split_var in outputs:
            continue
        if any(v in outputs or not _fusable_users(users.get(v, [])) for v in mine):
            continue
        bounds = _bounds(split)
        for var, part in mine.items():
            begin, end = bounds[part.index]
            found[var] = (split.args[0], int(split.attrs.axis), begin, end)
    return found


def _fusable_users(values: list) -> bool:
    """Whether ``values`` are elementwise or layout ops (a slice fuses into either)."""
    return bool(values) and all(
        isinstance(v, relax.Call) and (v.op in ELEMENTWISE or v.op in LAYOUT_OPS) for v in values
    )


def _bounds(split: relax.Call) -> list[tuple[int, int]] | None:
    """The ``(begin, end)`` of each part along the split axis, or None if not static."""
    ty = split.args[0].ty
    if not isinstance(ty, relax.TensorType) or not isinstance(ty.shape, relax.ShapeExpr):
        return None
    axis = int(split.attrs.axis) % len(ty.shape.values)
    size = ty.shape.values[axis]
    if not isinstance(size, tvm.tirx.IntImm):
        return None
    size, sections = int(size), split.attrs.indices_or_sections
    if isinstance(sections, (int, tvm.tirx.IntImm)):
        count = int(sections)
        if size % count:
            return None
        cuts = [size // count * i for i in range(1, count)]
    else:
        cuts = [int(c) for c in sections]
    edges = [0, *cuts, size]
    return list(zip(edges[:-1], edges[1:]))


@relax.expr_functor.mutator
class _Rewriter(PyExprMutator):
    def __init__(self, mod: tvm.IRModule):
        super().__init__(mod)
        self.parts: dict = {}

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        if binding.var not in self.parts:
            super().visit_var_binding_(binding)
            return
        data, axis, begin, end = self.parts[binding.var]
        piece = relax.op.strided_slice(self.visit_expr(data), [axis], [begin], [end])
        self.set_var_remap(binding.var, self.builder_.emit(piece, binding.var.name))
