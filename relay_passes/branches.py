"""Each branch of an ``If`` as a function of its own, so that memory planning stays inside it.

TVM's ``StaticPlanBlockMemory`` plans the tensors of both branches of an ``If`` as one
sequence: a storage that the ``then`` branch allocates is reused by the ``else`` branch, where
it was never allocated (apache/tvm#17348). A branch with two kernels or more then crashes the
VM (``StorageObj::AllocTensor`` on a null storage). At O2 every branch has them, since AMP puts
casts around its ops: an ONNX ``If`` segfaulted at O2 and O3.

:class:`OutlineBranches` moves the body of every branch that binds anything into a private
function of the values (and sizes) it reads, and makes the branch a call of it. The planner
plans each function apart, so a branch allocates every storage it uses; the kernels run as
before, one VM call more per taken branch. A branch that only calls Relax functions (or chooses
between such calls) allocates nothing itself and stays where it is.
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.ir import PrimType
from tvm.relax import PyExprMutator


@tvm.transform.module_pass(opt_level=0, name="tvmamp.OutlineBranches")
class OutlineBranches:
    """Outline each ``If`` branch that has bindings into a private Relax function."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        if not any(_has_branches(f) for _, f in mod.functions_items()):
            return mod
        outliner = _Outliner(mod)
        for gvar, func in mod.functions_items():
            if isinstance(func, relax.Function) and _has_branches(func):
                outliner.prefix = gvar.name_hint
                outliner.builder_.update_func(gvar, outliner.visit_expr(func))
        return outliner.builder_.get()


def _has_branches(func) -> bool:
    found = []
    if isinstance(func, relax.Function):
        relax.analysis.post_order_visit(func.body, lambda e: found.append(isinstance(e, relax.If)))
    return any(found)


@relax.expr_functor.mutator
class _Outliner(PyExprMutator):
    prefix = "main"

    def visit_if_(self, node: relax.If) -> relax.Expr:
        cond = self.visit_expr(node.cond)
        then = self._outlined(self.visit_expr(node.true_branch), "then")
        other = self._outlined(self.visit_expr(node.false_branch), "else")
        return relax.If(cond, then, other, node.span)

    def _outlined(self, branch: relax.Expr, which: str) -> relax.Expr:
        """``branch`` as a call of a new function of its free vars, where it binds anything
        but calls of Relax functions and choices between them (which allocate nothing here)."""
        if not _binds(branch) or self._only_calls(branch):
            return branch
        # the values it reads; a size is a ``Var`` of type ``int64`` in TVM 0.27, and
        # ``free_vars`` lists the sizes computed with (``zeros(shape([n]))``) among them
        args = [v for v in relax.analysis.free_vars(branch) if not isinstance(v.ty, PrimType)]
        params = list(args)
        # sizes it uses (in shapes too) that its values' shapes do not define: one shape argument
        sizes = list(relax.analysis.free_symbolic_vars(relax.Function(args, branch, branch.ty)))
        if sizes:
            args.append(relax.ShapeExpr(sizes))
            params.append(relax.Var("sizes", relax.ShapeType(sizes)))
        pure = not relax.analysis.contains_impure_call(branch)
        # new vars (and sizes) for the parameters: the caller binds its own
        func = relax.Function(params, branch, branch.ty, is_pure=pure)
        func = relax.utils.copy_with_new_vars(func)
        name = f"{self.prefix}_{which}_branch"
        gvar = self.builder_.add_func(func, name)
        return relax.SeqExpr([], relax.Call(gvar, args))

    def _only_calls(self, branch: relax.SeqExpr) -> bool:
        """Whether every binding of ``branch`` calls a Relax function, casts or renames a
        value, or is an ``If`` whose branches do no more (a run-time choice between such
        calls: the decode step's dispatcher, ``relay_passes/decode_step.py``). Each outlined
        level was one more VM function matching every input's shape again: the dispatch took
        9-10 us a call on a small decoder, now 4."""
        mod = self.builder_.get()
        for block in branch.blocks:
            for binding in block.bindings:
                value = getattr(binding, "value", None)
                if isinstance(value, relax.Var):  # an alias, or a match_cast of the result
                    continue
                if isinstance(value, relax.If):
                    if not all(
                        not _binds(b) or self._only_calls(b)
                        for b in (value.true_branch, value.false_branch)
                    ):
                        return False
                elif not (
                    isinstance(value, relax.Call)
                    and isinstance(value.op, relax.GlobalVar)
                    and isinstance(mod[value.op], relax.Function)
                ):
                    return False
        return True


def _binds(expr: relax.Expr) -> bool:
    """Whether ``expr`` is a SeqExpr that binds anything."""
    return isinstance(expr, relax.SeqExpr) and any(b.bindings for b in expr.blocks)
