"""FLOPs and bytes of each TIR kernel, read from its PrimFunc (never from its name).

A kernel's FLOPs are counted by walking its TIR: every floating-point ``+ - * /``, ``min``/
``max`` and math intrinsic (``exp``, ``tanh``, ``sqrt``, ...; one FLOP each, ``fma`` two) in a
buffer store (a repeated subexpression once), times the number of times the store runs (the
product of its enclosing loop extents; a reduction block's ``init`` runs once per spatial
point). Index arithmetic, casts, comparisons and selects are not FLOPs. A matmul
``C[i, j] += A[i, k] * B[k, j]`` thus counts ``2 * M * N * K``. Extents that are shape
variables stay symbolic until the kernel's runtime arguments bind them
(:meth:`KernelCost.flops_for`).

The kernels are counted as phases 1-2 of the pipeline leave them (legalized and fused, not yet
scheduled): scheduling keeps a kernel's arithmetic, but tensorized blocks hide it.
:func:`kernel_cost_recording` records them while a model is built (a pass instrument, so any
build works: ``tvmamp.build``, tuning logs, the CLI); :func:`replay_kernel_costs` recomputes them
from a built :class:`~tvmamp.executable.Executable`.
"""

from __future__ import annotations

import contextlib
import dataclasses

import tvm
import tvm_ffi
from tvm import s_tir, tirx

from tvmamp.conversion import Converted
from tvmamp.pipeline import run_front_phases
from tvmamp.targets.registry import derived_pass_context

# The pass of tvmamp.pipeline.compile_converted that runs phases 3-5 (schedules to VM code).
LOWER_PASS = "tvmamp.Lower"
_BINARY = (tirx.Add, tirx.Sub, tirx.Mul, tirx.Div, tirx.Min, tirx.Max, tirx.FloorDiv)
# a float comparison is one FLOP, as the max of TVM's ReLU was: relu(x) = x < 0 ? 0 : x
_COMPARISONS = (tirx.LT, tirx.LE, tirx.GT, tirx.GE, tirx.EQ, tirx.NE)
_MATH = frozenset(
    "tirx." + name
    for name in (
        "exp exp2 exp10 expm1 log log2 log10 log1p tanh sigmoid sqrt rsqrt erf pow sin cos tan "
        "asin acos atan atan2 sinh cosh asinh acosh atanh fabs floor ceil round nearbyint trunc "
        "fmod hypot copysign ldexp"
    ).split()
)
# (FLOPs per run of a statement, the loop extents it runs under)
Term = tuple[int, tuple]


def _is_float(dtype) -> bool:
    return str(dtype).startswith(("float", "bfloat"))


def expr_flops(expr, seen: set | None = None) -> int:
    """Floating-point operations of one evaluation of ``expr`` (vector lanes counted).

    A subexpression that occurs more than once (the argument of a polynomial exp, repeated
    in each of its terms by TE inlining) is counted once, as the compiled code computes it.
    """
    seen = set() if seen is None else seen
    if isinstance(
        expr, (*_BINARY, *_COMPARISONS, tvm.ir.expr.Call, tirx.Cast, tirx.Broadcast, tirx.Select)
    ):
        key = tvm_ffi.structural_hash(expr)
        if key in seen:
            return 0
        seen.add(key)
    if isinstance(expr, (*_BINARY, *_COMPARISONS)):  # float operands: one FLOP a lane
        own = _lanes(expr) if _is_float(expr.a.ty.dtype) else 0
        return own + expr_flops(expr.a, seen) + expr_flops(expr.b, seen)
    if isinstance(expr, tvm.ir.expr.Call):
        name = expr.op.name if isinstance(expr.op, tvm.ir.Op) else ""
        own = 0
        if name in _MATH and _is_float(expr.ty.dtype):
            own = _lanes(expr) * (2 if name == "tirx.fma" else 1)
        return own + sum(expr_flops(a, seen) for a in expr.args)
    if isinstance(expr, (tirx.Cast, tirx.Broadcast)):
        return expr_flops(expr.value, seen)
    if isinstance(expr, tirx.Select):
        parts = (expr.condition, expr.true_value, expr.false_value)
        return sum(expr_flops(e, seen) for e in parts)
    return 0  # loads, immediates, variables


def _lanes(expr) -> int:
    return int(getattr(expr.ty.dtype, "lanes", 1) or 1)


def stmt_terms(stmt, extents: tuple = ()) -> list[Term]:
    """The ``(flops, extents)`` of every store under ``stmt``, inside loops of ``extents``."""
    if isinstance(stmt, tirx.For):
        return stmt_terms(stmt.body, (*extents, stmt.extent))
    if isinstance(stmt, tirx.SeqStmt):
        return [t for s in stmt.seq for t in stmt_terms(s, extents)]
    if isinstance(stmt, s_tir.SBlockRealize):
        return stmt_terms(stmt.block, extents)
    if isinstance(stmt, s_tir.SBlock):
        terms = stmt_terms(stmt.body, extents)
        if stmt.init is not None:
            spatial = tuple(
                iv.dom.extent for iv in stmt.iter_vars if iv.iter_type == tirx.IterVar.DataPar
            )
            terms += stmt_terms(stmt.init, spatial)
        return terms
    if isinstance(stmt, tirx.BufferStore):
        flops = expr_flops(stmt.value)
        return [(flops, extents)] if flops else []
    if isinstance(stmt, tirx.Evaluate):
        flops = expr_flops(stmt.value)
        return [(flops, extents)] if flops else []
    if isinstance(stmt, tirx.IfThenElse):
        branches = [stmt.then_case, stmt.else_case]
        return [t for b in branches if b is not None for t in stmt_terms(b, extents)]
    body = getattr(stmt, "body", None)  # AttrStmt, While (counted once), ...
    return stmt_terms(body, extents) if isinstance(body, tirx.Stmt) else []


@dataclasses.dataclass(frozen=True)
class KernelCost:
    """What one PrimFunc computes, from its TIR.

    Attributes
    ----------
    name : str
        The kernel's name (the PrimFunc's global name, as the VM calls it).
    terms : tuple
        ``(flops, loop extents)`` of each store; extents may hold shape variables.
    params : tuple
        Per parameter: its buffer's shape (a tuple of PrimExpr) or, for a scalar, its Var.
    """

    name: str
    terms: tuple
    params: tuple

    def flops_for(self, args=()) -> int | None:
        """FLOPs of one call, shape variables bound from the call's ``args`` (runtime tensors
        and integers, in parameter order); None when a variable stays unbound."""
        analyzer = None
        total = 0
        for flops, extents in self.terms:
            count = flops
            for extent in extents:
                if not isinstance(extent, tirx.IntImm):
                    analyzer = analyzer or self._analyzer(args)
                    extent = analyzer.simplify(extent)
                    if not isinstance(extent, tirx.IntImm):
                        return None
                count *= int(extent.value)
            total += count
        return total

    @property
    def flops(self) -> int | None:
        """FLOPs of one call when the kernel's shapes are static, else None."""
        return self.flops_for()

    def _analyzer(self, args):
        """An analyzer with the parameters' shape variables bound to the call's values."""
        analyzer, bound = tvm.sym.Analyzer(), []
        for param, arg in zip(self.params, args):
            pairs = []
            if isinstance(param, tirx.Var) and isinstance(arg, int):
                pairs = [(param, arg)]
            elif isinstance(param, tuple) and hasattr(arg, "shape"):
                pairs = [(d, int(s)) for d, s in zip(param, arg.shape) if isinstance(d, tirx.Var)]
            for var, value in pairs:
                if not any(var.same_as(b) for b in bound):
                    analyzer.bind(var, tirx.IntImm(var.ty.dtype, value))
                    bound.append(var)
        return analyzer


def func_cost(name: str, func: tirx.PrimFunc) -> KernelCost:
    """The :class:`KernelCost` of one PrimFunc."""
    # a buffer parameter by its shape, a scalar one (a shape variable passed in) as itself;
    # ``isinstance(p, tirx.Buffer)`` holds for every parameter Var, so test its type
    params = [tuple(p.shape) if isinstance(p.ty, tirx.BufferType) else p for p in func.params]
    return KernelCost(name, tuple(stmt_terms(func.body)), tuple(params))


def kernel_costs(mod: tvm.IRModule) -> dict[str, KernelCost]:
    """The cost of every PrimFunc of ``mod``, by global name."""
    return {
        gv.name_hint: func_cost(gv.name_hint, func)
        for gv, func in mod.functions_items()
        if isinstance(func, tirx.PrimFunc)
    }


class KernelCosts(dict):
    """Kernel name -> :class:`KernelCost`, filled while models build (see
    :func:`kernel_cost_recording`); :meth:`lookup` finds the kernel the VM calls by name."""

    def __init__(self):
        super().__init__()
        self.scheduled: dict[str, KernelCost] = {}

    def lookup(self, name: str) -> KernelCost | None:
        """The cost of the kernel the VM calls ``name``: the unscheduled kernel of that name;
        for a kernel whose packing was split out (``<kernel>_prepacked``, once per split), the
        kernel it came from; else the scheduled kernel (its FLOPs exact unless tensorized)."""
        if name in self:
            return self[name]
        base = name
        while base.endswith("_prepacked"):
            base = base.removesuffix("_prepacked")
            if base in self:
                return self[base]
        return self.scheduled.get(name)


@tvm.ir.instrument.pass_instrument
class _CostRecorder:
    """Counts the kernels before (unscheduled) and after (scheduled) the pipeline's phases 3-5.

    The counting happens at once: TVM may update a module in place later in the build.
    """

    def __init__(self, costs: KernelCosts):
        self.costs = costs

    def run_before_pass(self, mod, info):
        if info.name == LOWER_PASS:
            self.costs.update(kernel_costs(mod))

    def run_after_pass(self, mod, info):
        if info.name == LOWER_PASS:
            self.costs.scheduled.update(kernel_costs(mod))


@contextlib.contextmanager
def kernel_cost_recording():
    """Record the cost of every kernel of the models built inside the ``with`` block.

    Yields a :class:`KernelCosts` (a dict of kernel name -> :class:`KernelCost`), filled as
    builds run; pass it to :func:`tvmamp.debugging.profile` as ``costs``::

        with tvmamp.debugging.kernel_cost_recording() as costs:
            exe = tvmamp.build(mod, "O2")
        prof = tvmamp.debugging.profile(exe, inputs, costs=costs)
    """
    costs = KernelCosts()
    with derived_pass_context(instruments=[_CostRecorder(costs)]):
        yield costs


def replay_kernel_costs(exe) -> KernelCosts:
    """The unscheduled kernels' costs of a built executable, by running phases 1-2 again on
    ``exe.mod`` (cheaper than a build; no scheduled fallbacks)."""
    converted = Converted(exe.mod, exe.stats, exe.policy, exe.target, exe.entry)
    costs = KernelCosts()
    costs.update(kernel_costs(run_front_phases(converted)))
    return costs
