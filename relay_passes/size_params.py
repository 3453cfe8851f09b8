"""Pass the sizes a fused function takes as ``R.Shape`` parameters, not ``T.int64`` ones.

``FuseOps`` gives a fused function a scalar parameter for each symbolic size a kernel reads as
a value (``shape_to_tensor`` of a shape computed from ``batch`` and ``seq``, as TVM's ONNX
importer emits for a ``Shape`` node of a model with symbolic inputs). ``FuseTIR`` first runs
``RemoveUnusedParameters``, which does not count a scalar parameter as the definition of its
variable: it appends an ``R.Shape([batch])`` parameter as well, and ``FuseTIR`` then fails on
the variable defined twice ("VarRemapGet(source) == nullptr", BigBird, SqueezeBERT and I-BERT
exported with a symbolic batch and sequence).

:class:`SizeParamsAsShapes` runs just before ``FuseTIR``: a scalar parameter of a primitive
function whose every caller passes a bare size variable becomes an ``R.Shape`` parameter of
that variable, and the callers pass ``R.shape([size])``. The function body is unchanged: the
variable it reads is now defined by the shape.
"""

from __future__ import annotations

import tvm
from tvm import relax


def _is_size_var(expr) -> bool:
    """A bare scalar variable (in TVM 0.27 a TIR variable is a Relax expression)."""
    return isinstance(expr, tvm.ir.Var) and isinstance(expr.ty, tvm.ir.PrimType)


def _scalar_params(func: relax.Function) -> list[int]:
    return [i for i, p in enumerate(func.params) if _is_size_var(p)]


@tvm.transform.module_pass(opt_level=0, name="tvmamp.SizeParamsAsShapes")
class SizeParamsAsShapes:
    """Turn the scalar size parameters of primitive functions into shape parameters."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        candidates = {
            gvar: set(_scalar_params(func))
            for gvar, func in mod.functions_items()
            if isinstance(func, relax.Function)
            and func.attrs is not None
            and "Primitive" in func.attrs
            and _scalar_params(func)
        }
        if not candidates:
            return mod
        callers = [
            (gvar, func)
            for gvar, func in mod.functions_items()
            if isinstance(func, relax.Function) and gvar not in candidates
        ]
        for _, func in callers:  # keep a position only where every call passes a variable
            for call in _calls(func, candidates):
                positions = candidates[call.op]
                positions &= {i for i in positions if _is_size_var(call.args[i])}
        candidates = {g: p for g, p in candidates.items() if p}
        if not candidates:
            return mod
        functions = {g: f for g, f in mod.functions_items() if g not in candidates}
        base = tvm.IRModule(functions, attrs=mod.attrs, global_infos=mod.global_infos)
        rewriter = _CallSites(base)
        for gvar, positions in candidates.items():
            func = mod[gvar]
            params = [
                relax.Var(f"size_{p.name}", relax.ShapeType([p])) if i in positions else p
                for i, p in enumerate(func.params)
            ]
            new = relax.Function(params, func.body, func.ret_ty, func.is_pure, func.attrs)
            added = rewriter.builder_.add_func(new, gvar.name_hint)
            rewriter.replacements[gvar] = (added, positions)
        for gvar, func in callers:
            new = rewriter.visit_expr(func)
            if not new.same_as(func):
                rewriter.builder_.update_func(gvar, new)
        return rewriter.builder_.get()


def _calls(func, candidates):
    found = []

    def visit(expr):
        if isinstance(expr, relax.Call) and expr.op in candidates:
            found.append(expr)

    relax.analysis.post_order_visit(func, visit)
    return found


@relax.expr_functor.mutator
class _CallSites(relax.PyExprMutator):
    def __init__(self, mod):
        super().__init__(mod)
        self.replacements = {}  # old GlobalVar -> (new GlobalVar, positions of sizes)

    def visit_call_(self, call):
        call = self.visit_expr_post_order(call)
        found = self.replacements.get(call.op) if isinstance(call.op, tvm.ir.GlobalVar) else None
        if found is None:
            return call
        gvar, positions = found
        args = [relax.ShapeExpr([a]) if i in positions else a for i, a in enumerate(call.args)]
        return relax.Call(gvar, args, call.attrs, call.ty_args, call.span)
