"""Slices of tensors with a symbolic dim that TVM 0.27's legalizer does not build.

TVM 0.27 legalizes such a ``strided_slice`` through topi's ``dynamic_strided_slice_with_axes``,
which does not count a negative axis from the end: "Check failed: axis < src_tensor_dim (-1
vs. 2)". torch.export writes ``x[..., 1:]``, ``x.narrow(-1, ...)`` and ``torch.diff(x, dim=-1)``
with ``axes=(-1,)``, so transformers' decoders (their packed-sequence check), CodeGen, Phi-3 and
Mamba imported with a dynamic batch failed to build. :data:`LEGALIZE_MAP`, given to
``LegalizeOps``, counts the axes from the front first and legalizes as TVM does.

A ``slice_scatter`` over a whole symbolic axis (torch.export writes ``y[:, :, 1:] = x`` as one
across the batch, from 0 to ``batch`` by 1: Funnel's relative shift) failed in topi, which needs
a constant extent ("Expect value to be constant int"); its result is its source, which covers
the whole tensor.
"""

from __future__ import annotations

import tvm
from tvm import relax, s_tir
from tvm.ir.expr import TensorLoad  # what tvm.tirx.BufferLoad makes
from tvm.s_tir.dlight.analysis import get_root_block
from tvm.sym import Analyzer

from .bindings import bound_values, call_of, readers
from .fused_functions import BROADCAST, COMM_REDUCE, INJECTIVE, op_pattern, prim_func


def _legalize_strided_slice(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    x, axes = call.args[0], call.args[1]
    ndim = getattr(x.ty, "ndim", -1)
    if ndim > 0 and isinstance(axes, relax.Tuple):
        values = [int(a) for a in axes.fields if isinstance(a, tvm.tirx.IntImm)]
        if len(values) == len(axes.fields) and any(a < 0 for a in values):
            positive = [a % ndim if -ndim <= a < 0 else a for a in values]
            call = bb.normalize(
                relax.op.strided_slice(
                    x, positive, *call.args[2:], assume_inbound=call.attrs.assume_inbound
                )
            )
    return _TVM_LEGALIZE(bb, call)


_CALL_TIR = tvm.ir.Op.get("relax.call_tir")


@tvm.transform.module_pass(opt_level=0, name="tvmamp.SlicesIntoReductions")
class SlicesIntoReductions:
    """Give a unit-stride slice that only reductions read the op pattern of a broadcast, which
    ``FuseOps`` fuses into a reduction (an injective one it does not). Run between
    ``AnnotateTIROpPattern`` and ``FuseOps``.

    ``AnalyzeOpPatternKind`` calls a slice from the first index a broadcast (its loads index
    with the store's variables) and one from any other index injective, though each reads its
    range once, in order, all the same. A decoder's cache ``present[2, b, h, n, d]`` is read as
    ``present[0]`` (the keys) and ``present[1]`` (the values): the keys' slice was fused into
    the scores' kernel and read in place, the values' was copied by a kernel of its own (12 x
    2049 x 64 fp32: 0.13 ms, the reduction that reads them 0.08). Only a slice whose every
    reader leads, through elementwise, broadcast and injective kernels, to reductions alone
    changes: as a broadcast it could also become the epilogue of a GEMM, and the slices of an
    unrolled GRU's steps, each its own offset, made each step's kernel its own function
    (:mod:`.slices_to_split`).
    """

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        """Re-pattern the qualifying slice kernels of every Relax function of ``mod``."""
        found = {}  # Relax function -> its qualifying slice bindings
        for gvar, func in mod.functions_items():
            if isinstance(func, relax.Function) and isinstance(func.body, relax.SeqExpr):
                bindings = _read_by_reductions(mod, func)
                if bindings:
                    found[gvar] = bindings
        if not found:
            return mod
        builder = relax.BlockBuilder(mod)
        copies = {}  # slice kernel -> its broadcast-patterned copy
        for bindings in found.values():
            for kernel in {b.value.args[0] for b in bindings}:
                if kernel not in copies:
                    func = mod[kernel].with_attr("op_pattern", BROADCAST)
                    copies[kernel] = builder.add_func(func, f"{kernel.name_hint}_into_reduction")
        out = builder.get()
        for gvar, bindings in found.items():
            vars_ = {b.var for b in bindings}
            out[gvar] = _Retarget(copies, vars_).visit_expr(out[gvar])
        return out


def _pattern(mod: tvm.IRModule, value) -> int | None:
    """The op pattern of the kernel a ``call_tir`` binding calls, or None."""
    return op_pattern(prim_func(mod, value)) if call_of(value, _CALL_TIR) is not None else None


def _read_by_reductions(mod: tvm.IRModule, func: relax.Function) -> list:
    """The bindings of ``func``'s injective slices whose readers lead to reductions only (see
    :class:`SlicesIntoReductions`)."""
    values, read_by = bound_values(func), readers(func)
    memo = {}

    def leads(reader) -> bool:
        pattern = _pattern(mod, values[reader])
        if pattern == COMM_REDUCE:
            return True
        return pattern is not None and pattern <= INJECTIVE and leads_to_reductions(reader)

    def leads_to_reductions(var) -> bool:
        if var not in memo:
            reading = read_by.get(var, set())  # None among them: the function's result
            memo[var] = bool(reading) and None not in reading and all(map(leads, reading))
        return memo[var]

    found = []
    for block in func.body.blocks:
        for binding in block.bindings:
            if _pattern(mod, binding.value) != INJECTIVE:
                continue
            if _copies_a_range(mod[binding.value.args[0]]) and leads_to_reductions(binding.var):
                found.append(binding)
    return found


def _copies_a_range(func: tvm.tirx.PrimFunc) -> bool:
    """Whether ``func`` copies a range of its input, as a slice with unit strides does: one
    block, storing at its own variables what it loads at those variables plus constants, in
    the same order (or at constants: a dimension of one taken)."""
    try:
        sch = s_tir.Schedule(func)
        blocks = sch.get_child_blocks(get_root_block(sch))
    except (tvm.error.TVMError, ValueError):
        return False
    if len(blocks) != 1:
        return False
    block = sch.get(blocks[0])
    store = block.body
    if not (isinstance(store, tvm.tirx.BufferStore) and isinstance(store.value, TensorLoad)):
        return False
    variables = [iv.var for iv in block.iter_vars]
    if len(store.indices) != len(variables):
        return False
    if not all(i.same_as(v) for i, v in zip(store.indices, variables)):
        return False
    analyzer = Analyzer()
    order = []  # the variables, as the load's indices take them: in the store's order
    for index in store.value.indices:
        used = [v for v in variables if _uses(index, v)]
        if len(used) > 1:
            return False
        offset = analyzer.simplify(index - used[0]) if used else index
        if not isinstance(offset, tvm.tirx.IntImm):
            return False
        order += [variables.index(used[0])] if used else []
    return order == sorted(order)  # no transpose


def _uses(expr, var) -> bool:
    """Whether ``var`` appears in ``expr``."""
    return any(v.same_as(var) for v in tvm.tirx.analysis.undefined_vars(expr))


@relax.expr_functor.mutator
class _Retarget(relax.PyExprMutator):
    """The slice bindings of ``bound`` made calls of their kernels' broadcast-patterned copies."""

    def __init__(self, copies: dict, bound: set):
        super().__init__()
        self.copies, self.bound = copies, bound

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        if binding.var in self.bound:
            value = self.visit_expr(binding.value)
            args = [self.copies[value.args[0]], *value.args[1:]]
            value = relax.Call(value.op, args, value.attrs, value.ty_args, value.span)
            value = self.builder_.normalize(value)
            self.builder_.emit_normalized(relax.VarBinding(binding.var, value))
            return
        super().visit_var_binding_(binding)


def _legalize_slice_scatter(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    data, src = call.args[0], call.args[1]
    bounds = list(call.args[2:5])  # PrimExprs
    shape, src_shape = (getattr(v.ty, "shape", None) for v in (data, src))
    if isinstance(shape, relax.ShapeExpr) and isinstance(src_shape, relax.ShapeExpr):
        extent = shape.values[int(call.attrs.axis)]
        whole = (
            all(tvm.ir.is_prim_expr(b) for b in bounds)
            and _equal(bounds[0], 0)
            and _equal(bounds[1], extent)
            and _equal(bounds[2], 1)
        )
        same = len(shape.values) == len(src_shape.values) and all(
            _equal(a, b) for a, b in zip(shape.values, src_shape.values)
        )
        if whole and same and not isinstance(extent, tvm.tirx.IntImm):
            return src
    return _TVM_SLICE_SCATTER(bb, call)


def _equal(a, b) -> bool:
    return bool(Analyzer().can_prove_equal(a, b))


_TVM_LEGALIZE = tvm.ir.Op.get("relax.strided_slice").get_attr("FLegalize")
_TVM_SLICE_SCATTER = tvm.ir.Op.get("relax.slice_scatter").get_attr("FLegalize")

LEGALIZE_MAP = {
    "relax.strided_slice": _legalize_strided_slice,
    "relax.slice_scatter": _legalize_slice_scatter,
}

__all__ = ["LEGALIZE_MAP", "SlicesIntoReductions"]
