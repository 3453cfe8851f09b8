"""Run-time checks that an input is large enough for every conv and pool over symbolic sizes,
and of sizes its layers can join.

A model imported with symbolic image sizes (ONNX ``dynamic_axes``, ``torch.export`` dynamic
shapes) gives each conv and pool an output size such as ``(h - 3) // 2 + 1``. On an input too
small for a window that size is zero or negative: TVM allocates an empty tensor, the kernels loop
over nothing, and the model returns garbage or NaN (Inception-v3 on a 113 x 67 image returned
all-NaN logits). torch and onnxruntime raise an error instead; so does a tvmamp build now.

Two passes do it, because the ops are known only before the target's rewrites and an effect can
be placed only after the purity checks are gone:

- :class:`CollectSizeChecks` runs first in phase 1, on the converted module. For each window op
  of a public function it keeps the condition ``size >= 1`` of every output size that is neither
  a size of its input nor provably positive, and whose variables the function's parameters
  define. The conditions on one size variable that rise with it (sums, positive products and
  floor divisions by constants, min and max) become one bound, ``h >= smallest``, found by
  bisection; the others stay as they are. Each ``match_cast`` of sizes (the importer's join of a
  skip connection's two branches, a Resize by a fraction) adds the equality it checks, named by
  the sizes that satisfy it (``a multiple of 2``, ``0 or 31 modulo 32``), so that the error
  names them instead of the VM's ``match_cast`` message. A reshape into sizes an export fixed
  (MobileViT's unfolding into patches) adds the equality of the element counts, named by the two
  shapes, where TVM's view check said "relative_byte_offset + view_size <= curr_size". They are
  kept in the function attribute ``tvmamp.size_checks``.
- :class:`InsertSizeChecks` runs after ``RemovePurityChecking``: it turns the attribute into a
  host PrimFunc of ``AssertStmt`` (``ValueError`` with a message naming the input, the axis and
  the smallest size) and makes calling it the function's first binding. It is native code in the
  library, so an exported model checks its input with only the TVM runtime loaded, for about the
  cost of one VM call.
"""

from __future__ import annotations

import functools
import re

import tvm
import tvm_ffi
from tvm import relax, tirx
from tvm.sym.analyzer import Analyzer, ConstIntBound

from tvmamp.tensors import int_or_expr

ATTR = "tvmamp.size_checks"

_WINDOW_OPS = {
    f"relax.nn.{kind}{rank}d{suffix}"
    for kind, suffix in (("conv", ""), ("conv", "_transpose"), ("max_pool", ""), ("avg_pool", ""))
    for rank in (1, 2, 3)
}
_AXES = {"D": "depth", "H": "height", "W": "width"}
_LARGEST = 1 << 40  # no image axis is larger; the bisection's upper end


def _text(value) -> str:
    """A size, a shape (a tuple) or a condition as a message shows it: ``(h - 1) // 8 + 1``,
    not TVMScript's ``(h - T.int64(1)) // T.int64(8) + T.int64(1)``."""
    return re.sub(r"T\.int(?:32|64)\((-?\d+)\)", r"\1", str(value))


def _describe(call: relax.Call) -> str:
    """``max_pool2d (window 3x3, strides 2x2)``, ``conv2d (kernel 7x7, padding (3, 3, 3, 3))``."""
    attrs = call.attrs
    parts = []
    if hasattr(attrs, "pool_size"):
        parts.append("window " + "x".join(str(int(v)) for v in attrs.pool_size))
    else:
        weight, layout = call.args[1].ty.shape, str(attrs.kernel_layout)
        if isinstance(weight, relax.ShapeExpr):
            kernel = [weight.values[layout.index(axis)] for axis in "DHW" if axis in layout]
            parts.append("kernel " + "x".join(str(int_or_expr(k)) for k in kernel))
    for field, default in (("strides", 1), ("dilation", 1), ("padding", 0)):
        values = [int(v) for v in getattr(attrs, field, ())]
        if any(v != default for v in values):
            shown = "x".join(map(str, values)) if field != "padding" else str(tuple(values))
            parts.append(f"{field} {shown}")
    return f"{call.op.name.rsplit('.', 1)[1]} ({', '.join(parts)})"


def _rising(expr, var) -> bool:
    """Whether ``expr`` is built from ``var`` and constants so that it never falls as ``var``
    grows: sums, differences with a constant, products and floor divisions by positive
    constants, min and max."""
    if isinstance(expr, tirx.IntImm):
        return True
    if isinstance(expr, tirx.Var):
        return expr.same_as(var)
    if isinstance(expr, tirx.Cast):
        return _rising(expr.value, var)
    if isinstance(expr, (tirx.Add, tirx.Min, tirx.Max)):
        return _rising(expr.a, var) and _rising(expr.b, var)
    if isinstance(expr, tirx.Sub):
        return _rising(expr.a, var) and isinstance(expr.b, tirx.IntImm)
    if isinstance(expr, (tirx.Mul, tirx.FloorDiv)):
        if isinstance(expr, tirx.Mul) and isinstance(expr.a, tirx.IntImm):
            scale, term = expr.a, expr.b
        else:
            scale, term = expr.b, expr.a
        return isinstance(scale, tirx.IntImm) and scale.value > 0 and _rising(term, var)
    return False


def _substituted(expr, values: dict):
    """``expr`` with each variable in ``values`` replaced by its value, simplified."""
    analyzer = Analyzer()
    for var, value in values.items():
        analyzer.bind(var, value)
    return analyzer.simplify(expr)


def _smallest(size, var) -> int | None:
    """The smallest value of ``var`` at which the rising ``size`` is at least 1 (None where no
    value up to ``_LARGEST`` is)."""

    def ok(value: int) -> bool:
        return int(_substituted(size, {var: tirx.IntImm(var.ty.dtype, value)})) >= 1

    if not ok(_LARGEST):
        return None
    low, high = 0, _LARGEST  # ok(high); find the first ok
    while low < high:
        mid = (low + high) // 2
        low, high = (low, mid) if ok(mid) else (mid + 1, high)
    return low


def _size_names(func: relax.Function, axes: dict) -> dict:
    """Size variable -> ``"x.shape[2] (height)"`` for the sizes a parameter's shape binds; the
    axis is named where a window op's layout names the axis its size comes from (``axes``)."""
    names = {}
    for param in func.params:
        shape = getattr(param.ty, "shape", None)
        if not isinstance(shape, relax.ShapeExpr):
            continue
        for axis, dim in enumerate(shape.values):
            if isinstance(dim, tirx.Var) and dim not in names:
                label = f" ({axes[dim]})" if dim in axes else ""
                names[dim] = f"{param.name}.shape[{axis}]{label}"
    return names


def _out_layout(call: relax.Call) -> str:
    """The layout of the result of a conv, pool or resize (``NCHW``...); "" for other ops."""
    attrs = call.attrs
    for field in ("out_layout", "data_layout", "layout"):
        layout = str(getattr(attrs, field, "") or "")
        if layout:
            return layout
    return ""


def size_checks(func: relax.Function) -> list[tuple]:
    """``[(condition, message), ...]``: what must hold of ``func``'s input sizes for every conv
    and pool in it to have a non-empty output, for the sizes each ``match_cast`` of it checks
    to agree, and for each reshape to keep the number of elements. Empty where the sizes are
    static."""
    defined = {v for p in func.params for v in relax.analysis.definable_tir_vars_in_type(p.ty)}
    if not defined:
        return []
    analyzer = Analyzer()
    for var in defined:
        analyzer.update(var, ConstIntBound(0, ConstIntBound.POS_INF))
    found = []  # (size, op description), in the order the ops run
    axes = {}  # size variable -> the axis a window op's layout puts it on ("height")

    def visit(binding):
        call = binding.value
        if not (isinstance(call, relax.Call) and isinstance(call.op, tvm.ir.Op)):
            return
        out = getattr(call.ty, "shape", None)  # the op's own (not a cast's)
        if not isinstance(out, relax.ShapeExpr):
            return
        layout = _out_layout(call)  # conv, pool, resize: the axes their sizes come from
        for letter, size in zip(layout, out.values):
            used = tirx.analysis.undefined_vars(size)
            if letter in _AXES and len(used) == 1:
                axes.setdefault(used[0], _AXES[letter])
        data = getattr(call.args[0].ty, "shape", None) if call.args else None
        if not isinstance(data, relax.ShapeExpr):
            return
        if call.op.name == "relax.reshape":
            visit_reshape(data, out)
        if call.op.name not in _WINDOW_OPS:
            return
        for size in out.values:
            if isinstance(size, tirx.IntImm) or any(
                tvm_ffi.structural_equal(size, d) for d in data.values
            ):
                continue
            used = set(tirx.analysis.undefined_vars(size))
            if used <= defined and not analyzer.can_prove(size >= 1):
                found.append((size, _describe(call)))

    agreements = []  # (size, the size a match_cast needs it to be)
    reshapes = []  # (condition, message): a reshape to sizes an export fixed

    def visit_reshape(data, out):
        have = functools.reduce(lambda a, b: a * b, data.values, tirx.IntImm("int64", 1))
        want = functools.reduce(lambda a, b: a * b, out.values, tirx.IntImm("int64", 1))
        used = {*tirx.analysis.undefined_vars(have), *tirx.analysis.undefined_vars(want)}
        if used and used <= defined and not analyzer.can_prove_equal(have, want):
            shapes = [tuple(int_or_expr(d) for d in shape.values) for shape in (data, out)]
            message = (
                f"the input's sizes do not fit this model: a reshape of {_text(shapes[0])} "
                f"into {_text(shapes[1])} needs as many elements (its export fixed sizes the "
                "model computes from its input: export it at the size it runs at, or give "
                "shape_dict)"
            )
            reshapes.append((have == want, message))

    def visit_cast(binding):
        have, want = getattr(binding.value, "ty", None), binding.ty
        if not (isinstance(have, relax.TensorType) and isinstance(want, relax.TensorType)):
            return
        if not (
            isinstance(have.shape, relax.ShapeExpr) and isinstance(want.shape, relax.ShapeExpr)
        ):
            return
        for a, b in zip(have.shape.values, want.shape.values):
            used = set(tirx.analysis.undefined_vars(a)) | set(tirx.analysis.undefined_vars(b))
            if used and used <= defined and not analyzer.can_prove_equal(a, b):
                agreements.append((a, b))

    for block in func.body.blocks:
        for binding in block.bindings:
            visit(binding)
            if isinstance(binding, relax.MatchCast):
                visit_cast(binding)
    names = _size_names(func, axes)
    return _merge(found, names) + _agreed(agreements, names) + reshapes


def _fitting(condition, var, span: int = 1024) -> tuple[int, list[int]] | None:
    """``(period, residues)``: the sizes of ``var`` from ``period`` on for which ``condition``
    holds are those congruent to a residue modulo the period (the first period up to 256 that
    repeats over ``span`` sizes); None where none does, or no size from it on fits."""
    holds = [
        bool(_substituted(condition, {var: tirx.IntImm(var.ty.dtype, v)})) for v in range(span)
    ]
    for period in range(1, 257):
        if all(holds[v] == holds[v + period] for v in range(period, span - period)):
            residues = [r for r in range(period) if holds[period + r]]
            return (period, residues) if residues else None
    return None


def _agreed(agreements: list, names: dict) -> list[tuple]:
    """The sizes a ``match_cast`` needs to agree (a skip connection's two sides, a Resize by a
    fraction): one condition for each size variable, named by the sizes of it that fit, then the
    others as equalities."""
    per_var: dict = {}
    checks = []
    for a, b in agreements:
        used = {*tirx.analysis.undefined_vars(a), *tirx.analysis.undefined_vars(b)}
        if len(used) == 1:
            per_var.setdefault(used.pop(), []).append(a == b)
        else:
            message = f"the input's sizes do not fit this model: {_text(a)} must equal {_text(b)}"
            checks.append((a == b, message))
    fits = []
    for var, conditions in per_var.items():
        condition = functools.reduce(tirx.And, conditions)
        pattern = _fitting(condition, var)
        if pattern is None:
            fits.append((condition, f"{names.get(var, var.name)} must satisfy {_text(condition)}"))
            continue
        period, residues = pattern
        if len(residues) == period:
            continue  # every size fits from the period on (TVM could not prove it)
        if residues == [0]:
            which = f"a multiple of {period}"
        else:
            which = " or ".join(map(str, residues)) + f" modulo {period}"
        fits.append((condition, f"{names.get(var, var.name)} must be {which}"))
    if fits:
        condition = functools.reduce(tirx.And, [c for c, _ in fits])
        message = (
            f"the input's sizes do not fit this model: {' and '.join(m for _, m in fits)} (at "
            "other sizes its layers' sizes disagree, as where a skip connection joins two "
            "branches or a Resize divides a size)"
        )
        checks.insert(0, (condition, message))
    return checks


def _merge(found: list, names: dict) -> list[tuple]:
    """One condition for every size variable that each of its sizes rises with (``h >= 11 and
    w >= 11``), then the other sizes' conditions, one for each distinct size."""
    bounds: dict = {}  # var -> (smallest, op description)
    checks, seen = [], []
    for size, op in found:
        used = tirx.analysis.undefined_vars(size)
        if len(used) == 1 and _rising(size, used[0]):
            var, smallest = used[0], _smallest(size, used[0])
            if smallest is not None:
                if var not in bounds or smallest > bounds[var][0]:
                    bounds[var] = (smallest, op)
                continue
        if not any(tvm_ffi.structural_equal(size, s) for s in seen):
            seen.append(size)
            message = f"the input is too small for {op}: its output size {_text(size)} must be >= 1"
            checks.append((size >= 1, message))
    if not bounds:
        return checks
    condition = functools.reduce(
        tirx.And, [var >= smallest for var, (smallest, _) in bounds.items()]
    )
    needs = " and ".join(
        f"{names.get(var, var.name)} at least {smallest}" for var, (smallest, _) in bounds.items()
    )
    ops = "; ".join(dict.fromkeys(op for _, op in bounds.values()))
    message = (
        f"the input is too small for this model: it needs {needs} (below that, {ops} has an "
        "empty output)"
    )
    return [(condition, message), *checks]


@tvm.transform.module_pass(opt_level=0, name="tvmamp.CollectSizeChecks")
class CollectSizeChecks:
    """Record each public function's input-size conditions in its ``tvmamp.size_checks``."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        updates = {}
        for gvar, func in mod.functions_items():
            if isinstance(func, relax.Function) and "global_symbol" in (func.attrs or {}):
                checks = size_checks(func)
                if checks:
                    updates[gvar] = func.with_attr(ATTR, [[c, m] for c, m in checks])
        if not updates:
            return mod
        mod = mod.clone()
        for gvar, func in updates.items():
            mod[gvar] = func
        return mod


def _assert(condition, message: str) -> tirx.Stmt:
    """``assert condition, message`` raising ValueError. (The constructor is called directly:
    TVM 0.27's ``tirx.AssertStmt.__init__`` passes its first two arguments in the wrong order.)"""
    kind, parts = tvm.ir.StringImm("ValueError"), [tvm.ir.StringImm(message)]
    return tirx._ffi_api.AssertStmt(condition, kind, parts, None)  # noqa: SLF001


def _check_func(checks, sizes: list) -> tirx.PrimFunc:
    """A host PrimFunc taking ``sizes`` and asserting each condition."""
    params = [tirx.Var(v.name, v.ty.dtype) for v in sizes]
    remap = dict(zip(sizes, params))
    body = tirx.SeqStmt(
        [_assert(_substituted(cond, remap), f"tvmamp: {message}") for cond, message in checks]
        + [tirx.Evaluate(tirx.IntImm("int32", 0))]
    )
    func = tirx.PrimFunc(params, body)
    return func.with_attrs({"tirx.is_host_func": True, "tirx.is_scheduled": True})


@tvm.transform.module_pass(opt_level=0, name="tvmamp.InsertSizeChecks")
class InsertSizeChecks:
    """Make a call of the ``tvmamp.size_checks`` of each function its first binding. Run it
    after ``RemovePurityChecking`` (the call has an effect)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        marked = [
            (gvar, func)
            for gvar, func in mod.functions_items()
            if isinstance(func, relax.Function) and ATTR in (func.attrs or {})
        ]
        if not marked:
            return mod
        builder = relax.BlockBuilder(mod)
        for gvar, func in marked:
            checks = [(c, str(m)) for c, m in func.attrs[ATTR]]
            sizes = sorted(
                {v for c, _ in checks for v in tirx.analysis.undefined_vars(c)},
                key=lambda v: v.name,
            )
            check = builder.add_func(_check_func(checks, sizes), f"{gvar.name_hint}_size_check")
            call = builder.normalize(relax.Call(check, list(sizes)))
            binding = relax.VarBinding(relax.Var("size_check", call.ty), call)
            body = func.body
            blocks = list(body.blocks)
            if blocks and not isinstance(blocks[0], relax.DataflowBlock):
                blocks[0] = relax.BindingBlock([binding, *blocks[0].bindings])
            else:
                blocks.insert(0, relax.BindingBlock([binding]))
            body = builder.normalize(relax.SeqExpr(blocks, body.body))
            new = relax.Function(
                func.params, body, func.ret_ty, func.is_pure, func.attrs, func.span
            )
            builder.update_func(gvar, new.without_attr(ATTR))
        return builder.get()
