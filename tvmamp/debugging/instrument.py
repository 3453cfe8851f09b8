"""Instrumented builds: a Relax rewrite that calls a packed function after every selected op.

The debugging tools (tensor checker, executed-op statistics, accuracy dumps) all work the same
way. While a tool is on, an instrumentation hook of the pipeline
(``tvmamp.pipeline.add_instrumentation_hook``) rewrites the converted module before lowering:
each selected op binding is followed by an impure ``R.call_packed(callback, value, site...)``,
so the compiled graph itself reports every op's output while it runs. The dataflow blocks are
turned into ordinary binding blocks first (impure calls may not live in dataflow blocks, and
pure calls whose result is unused would be removed), and each rewritten function gets
``relax.force_pure`` so that callers keep treating it as pure. Such a build does not fuse ops,
which is what a per-op check needs.

With no hook registered nothing here runs: the compiled module is the uninstrumented one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import tvm
from tvm import relax
from tvm.ir.expr import Constant

_NO_RESULT = relax.TupleType([])
_SKIPPED_ATTRS = ("Primitive", "Composite", "Codegen")


@dataclasses.dataclass(frozen=True)
class Site:
    """One op binding of a Relax function, as the debugging tools name it.

    Attributes
    ----------
    func : str
        The Relax function holding the binding.
    index : int
        Position of the binding among the instrumented ones of ``func`` (graph order).
    op : str
        Full op name (``relax.exp``), ``relax.call_tir:<prim func>`` for TIR calls.
    var : str
        The bound variable's name, made unique within the function as the TVMScript printer does
        (``lv``, ``lv_1``, ...).
    dtype : str
        The dtype the op computes in: that of its first float input, else of its output.
    """

    func: str
    index: int
    op: str
    var: str
    dtype: str

    @property
    def short_op(self) -> str:
        """The op name without the ``relax.`` prefix, as reports show it."""
        return self.op[len("relax.") :] if self.op.startswith("relax.") else self.op


def op_label(call: relax.Call) -> str | None:
    """Name of the op a binding calls, or None when it calls no Relax op (a packed function)."""
    if not isinstance(call.op, tvm.ir.Op):
        return None
    name = call.op.name
    if name == "relax.call_tir" and isinstance(call.args[0], relax.GlobalVar):
        return f"{name}:{call.args[0].name_hint}"
    if name == "relax.call_pure_packed" and isinstance(call.args[0], relax.ExternFunc):
        return f"{name}:{call.args[0].global_symbol}"
    return name


def _is_float(dtype: str) -> bool:
    return dtype.startswith(("float", "bfloat"))


def _float_dtypes(expr) -> list[str]:
    ty = getattr(expr, "ty", None)
    if isinstance(ty, relax.TensorType):
        dtype = str(ty.dtype)
        return [dtype] if _is_float(dtype) else []
    if isinstance(expr, relax.Tuple):
        return [d for field in expr.fields for d in _float_dtypes(field)]
    if isinstance(ty, relax.TupleType):
        return [d for field in ty.fields for d in _float_dtypes(relax.Var("_", field))]
    return []


def call_dtype(call: relax.Call, result_ty) -> str:
    """The dtype an op call of a converted module computes in, read from its types.

    Its first float input's dtype, else its result's, else ''. (The dtype the policy decides
    for an op is ``Policy.compute_dtype``; this reads what a module does.)
    """
    for arg in call.args:
        found = _float_dtypes(arg)
        if found:
            return found[0]
    found = _float_dtypes(relax.Var("_", result_ty))
    if found:
        return found[0]
    return str(result_ty.dtype) if isinstance(result_ty, relax.TensorType) else ""


def constant_only(call: relax.Call, folded: set) -> bool:
    """Whether every tensor input of ``call`` is a constant or folded from constants only."""
    leaves = []
    for arg in call.args:
        leaves.extend(arg.fields if isinstance(arg, relax.Tuple) else [arg])
    tensors = [a for a in leaves if isinstance(a.ty, (relax.TensorType, relax.TupleType))]
    return bool(tensors) and all(isinstance(a, Constant) or a in folded for a in tensors)


def instrumentable(func) -> bool:
    """Relax functions the tools rewrite: not fused, composite or BYOC functions."""
    if not isinstance(func, relax.Function):
        return False
    return not (func.attrs and any(k in func.attrs for k in _SKIPPED_ATTRS))


def packed_call(name: str, *args) -> relax.Call:
    """An impure call of the global function ``name`` that returns nothing."""
    args = [tvm.ir.StringImm(a) if isinstance(a, str) else a for a in args]
    return relax.Call(relax.ExternFunc(name), args, ty_args=[_NO_RESULT])


# ``emit(site, value) -> list[relax.Call]``: the calls to insert after one op binding.
Emit = Callable[[Site, relax.Expr], list]


def instrument_module(mod: tvm.IRModule, emit: Emit, on_entry: str | None = None):
    """Insert ``emit(site, value)`` calls after every op binding of every Relax function.

    Parameters
    ----------
    mod : tvm.IRModule
        A Relax module (before lowering).
    emit : callable
        ``emit(site, value)`` returns the packed calls to insert after that binding (or []).
        Bindings computed from constants only are skipped (FoldConstant folds them).
    on_entry : str, optional
        A global function called with the function's name when a public function starts.

    Returns
    -------
    tvm.IRModule
        The instrumented module (the input module when nothing was inserted).
    """
    names = [gv for gv, f in mod.functions_items() if instrumentable(f)]
    if not names:
        return mod
    mod = relax.transform.ToNonDataflow()(mod)
    rewriter = _Instrumenter(mod, emit)
    for gv in names:
        func = rewriter.rewrite(gv.name_hint, mod[gv], on_entry)
        rewriter.builder_.update_func(gv, func)
    out = rewriter.builder_.get()
    relax.analysis.well_formed(out)
    return out if rewriter.inserted else mod


@relax.expr_functor.mutator
class _Instrumenter(relax.PyExprMutator):
    """Emits the instrumentation calls after each op binding (see :func:`instrument_module`)."""

    def __init__(self, mod, emit):
        super().__init__(mod)
        self.emit_fn = emit
        self.inserted = 0
        self._func = ""
        self._index = 0
        self._names: dict[str, int] = {}
        self._folded: set = set()

    def rewrite(self, name: str, func: relax.Function, on_entry: str | None) -> relax.Function:
        """Instrument one function; mark it ``relax.force_pure`` when it was pure."""
        self._func, self._index, self._names, self._folded = name, 0, {}, set()
        for param in func.params:  # the printer numbers names after the parameters
            self._unique(param.name)
        before = self.inserted
        new = self.visit_expr(func)
        if self.inserted == before:
            return func
        if on_entry is not None and func.attrs and "global_symbol" in func.attrs:
            call = self.builder_.normalize(packed_call(on_entry, name))
            entry = relax.VarBinding(relax.Var("_entry", _NO_RESULT), call)
            body = relax.SeqExpr([relax.BindingBlock([entry]), *new.body.blocks], new.body.body)
            body = self.builder_.normalize(body)
            new = relax.Function(new.params, body, new.ret_ty, new.is_pure, new.attrs, new.span)
        return new.with_attr("relax.force_pure", True) if new.is_pure else new

    def _unique(self, name: str) -> str:
        seen = self._names.get(name, 0)
        self._names[name] = seen + 1
        return name if seen == 0 else f"{name}_{seen}"

    def visit_var_binding_(self, binding):
        super().visit_var_binding_(binding)
        value, var = binding.value, binding.var
        label = op_label(value) if isinstance(value, relax.Call) else None
        unique = self._unique(var.name)
        if label is None:
            return
        new_var = self.visit_expr(var)
        if constant_only(value, self._folded):
            self._folded.add(var)
            return
        dtype = call_dtype(value, var.ty)
        site = Site(self._func, self._index, label, unique, dtype)
        self._index += 1
        for call in self.emit_fn(site, new_var):
            args = [self._leaf(a) for a in call.args]
            self.builder_.emit(relax.Call(call.op, args, call.attrs, call.ty_args), "_dbg")
            self.inserted += 1

    def _leaf(self, arg):
        return self.builder_.emit(arg, "_dbg") if isinstance(arg, relax.TupleGetItem) else arg


def tensor_fields(site: Site, value: relax.Expr):
    """``(site, tensor)`` pairs for the float tensors of a binding's value (tuples split)."""
    ty = value.ty
    if isinstance(ty, relax.TensorType):
        dtype = str(ty.dtype)
        return [(site, value)] if _is_float(dtype) else []
    if isinstance(ty, relax.TupleType):
        pairs = []
        for i, field in enumerate(ty.fields):
            if isinstance(field, relax.TensorType) and _is_float(str(field.dtype)):
                named = dataclasses.replace(site, var=f"{site.var}[{i}]")
                pairs.append((named, relax.TupleGetItem(value, i)))
        return pairs
    return []
