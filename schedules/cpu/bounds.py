"""Bounds checks that hold on every tile but the last, marked ``likely`` for LoopPartition.

A GEMM over a symbolic number of columns (attention's scores over a run-time number of keys)
pads its columns to whole tiles and packs ``B``'s panels in the kernel, reading ``B`` through
``if_then_else(j < columns, B[...], 0)``. TVM vectorises a load under a per-lane condition lane
by lane, each behind its own branch, so on every panel, not only the last one, the pack ran as
32 scalar loads a row: a decode step's scores GEMM over 2049 cached keys read them at 10 GB/s.

:func:`mark` tags such a block with a plain integer; :data:`inject_likely`, a TIR pass at the
start of the CPU lowering pipeline (:mod:`tvmamp.targets.llvm_lowering`), wraps the
conditions of the tagged blocks' ``if_then_else`` in ``likely``. TVM's ``LoopPartition`` then
splits each symbolic loop those conditions use into the iterations where they always hold,
whose loads lose the check and vectorise whole, and the rest, which keep it.
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import s_tir, tirx
from tvm.ir.expr import Call
from tvm.s_tir.schedule import SBlockRV

# The block annotation.
KEY = "tvmamp.likely_in_bounds"
_IF_THEN_ELSE = tvm.ir.Op.get("prim.if_then_else")
_LIKELY = tvm.ir.Op.get("prim.likely")


def mark(sch: s_tir.Schedule, block: SBlockRV) -> None:
    """Ask for the bounds checks of ``block`` (a padded copy) to be marked ``likely``."""
    sch.annotate(block, KEY, 1)


def _likely_checks(expr):
    def on_call(call, mutator):
        call = mutator.default_mutate(call)
        if not call.op.same_as(_IF_THEN_ELSE):
            return call
        cond = call.args[0]
        if _is_likely(cond):
            return call
        return tirx.if_then_else(tirx.likely(cond), call.args[1], call.args[2], span=call.span)

    return tvm_ffi.structural_mutate(expr, [(Call, on_call)])


def _likely_predicate(predicate):
    """``predicate`` (a block's ``T.where``) with each of its conjuncts marked ``likely``."""
    if isinstance(predicate, tirx.IntImm):
        return predicate
    terms, stack = [], [predicate]
    while stack:
        term = stack.pop()
        if isinstance(term, tirx.And):
            stack += [term.b, term.a]
        else:
            terms.append(term)
    return tirx.all(*(t if _is_likely(t) else tirx.likely(t) for t in terms))


def _is_likely(expr) -> bool:
    return isinstance(expr, Call) and expr.op.same_as(_LIKELY)


@tirx.transform.prim_func_pass(opt_level=0, name="tvmamp.InjectLikelyBounds")
def inject_likely(func: tirx.PrimFunc, _mod, _ctx) -> tirx.PrimFunc:
    """Mark the bounds checks of the blocks :func:`mark` tagged ``likely``: the conditions of
    their ``if_then_else`` and the conjuncts of their predicates."""

    def on_realize(realize, mutator):
        realize = mutator.default_mutate(realize)
        block = realize.block
        if KEY not in block.annotations:
            return realize
        realize = _likely_checks(realize)  # the if_then_else of the block's body
        predicate = _likely_predicate(realize.predicate)
        return s_tir.SBlockRealize(realize.iter_values, predicate, realize.block)

    body = tvm_ffi.structural_mutate(func.body, [(s_tir.SBlockRealize, on_realize)])
    return func if body.same_as(func.body) else func.with_body(body)


__all__ = ["KEY", "inject_likely", "mark"]
