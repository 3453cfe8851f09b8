"""Operator statistics: op calls per compute dtype, from the IR or counted while a model runs."""

from __future__ import annotations

import collections
import contextlib
import sys

import tvm
from tvm import relax

from tvmamp.pipeline import add_instrumentation_hook, remove_instrumentation_hook

from .instrument import (
    Site,
    call_dtype,
    constant_only,
    instrument_module,
    instrumentable,
    op_label,
    packed_call,
)

COUNT_FUNC = "tvmamp.debugging.count_op"
COLUMNS = ("FP16", "BF16", "FP32", "Other")
_LABELS = {"float16": "FP16", "bfloat16": "BF16", "float32": "FP32"}


class OperatorStats:
    """Calls of each op per dtype column (FP16, BF16, FP32, Other), as Paddle's table shows.

    Attributes
    ----------
    ops : dict
        op name (``matmul``, ``nn.softmax``, ``call_tir:fused_x``) -> Counter of column -> calls.
    """

    def __init__(self):
        self.ops: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)

    def add(self, op: str, dtype: str, calls: int = 1) -> None:
        """Record ``calls`` calls of ``op`` computing in ``dtype``."""
        self.ops[op][_LABELS.get(dtype, "Other")] += calls

    def calls(self, op: str, column: str | None = None) -> int:
        """Calls of ``op`` in one column (or all columns)."""
        counter = self.ops.get(op, collections.Counter())
        return sum(counter.values()) if column is None else counter[column]

    def as_dict(self) -> dict:
        """``{op: {"FP16": n, "BF16": n, "FP32": n, "Other": n}}`` sorted by op name."""
        return {op: {c: self.ops[op][c] for c in COLUMNS} for op in sorted(self.ops)}

    def table(self) -> str:
        """Paddle's operator table: op name, then calls in FP16 / BF16 / FP32 / Other."""
        head = ["Op Name", *(f"{c} Calls" for c in COLUMNS)]
        lines = [
            f"<{' op list ':-^120}>",
            f"<{' ' + head[0] + ' ':-^40} | "
            + " | ".join(f"{' ' + h + ' ':-^17}" for h in head[1:])
            + ">",
        ]
        for op, row in self.as_dict().items():
            lines.append(f"  {op:<40}|" + "|".join(f"  {row[c]:<17}" for c in COLUMNS))
        lines.append(f"<{' op count: ' + str(len(self.ops)) + ' ':-^120}>")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def _module_of(mod_or_exe) -> tvm.IRModule:
    mod = getattr(mod_or_exe, "mod", mod_or_exe)  # Executable and Converted carry .mod
    if isinstance(mod, relax.Function):
        mod = tvm.IRModule({"main": mod})
    if not isinstance(mod, tvm.IRModule):
        raise TypeError(
            "tvmamp.debugging.collect_operator_stats: expected an Executable, a Converted "
            f"result, an IRModule or a relax.Function, got {type(mod_or_exe).__name__}"
        )
    return mod


def static_operator_stats(mod_or_exe) -> OperatorStats:
    """Op calls per dtype in the (converted) Relax IR; ops on constants only are left out."""
    stats = OperatorStats()
    for _, func in _module_of(mod_or_exe).functions_items():
        if instrumentable(func):
            _StatsVisitor(stats).visit_expr(func)
    return stats


@relax.expr_functor.visitor
class _StatsVisitor(relax.PyExprVisitor):
    def __init__(self, stats):
        super().__init__()
        self.stats = stats
        self.folded: set = set()

    def visit_var_binding_(self, binding):
        value = binding.value
        label = op_label(value) if isinstance(value, relax.Call) else None
        if label is not None:
            if constant_only(value, self.folded):
                self.folded.add(binding.var)
            else:
                op = label[len("relax.") :] if label.startswith("relax.") else label
                self.stats.add(op, call_dtype(value, binding.var.ty))
        super().visit_var_binding_(binding)


def collect_operator_stats(mod_or_exe=None, verbose: bool = True):
    """Op calls per dtype of a converted model; without an argument, Paddle's context manager.

    Parameters
    ----------
    mod_or_exe : Executable, Converted, IRModule or relax.Function, optional
        A built or converted model: its static op counts are taken from the converted IR.
        Without it, this returns :func:`operator_stats_collection` (``with
        collect_operator_stats(): ...`` counts the calls executed in the block).
    verbose : bool
        Print the table.

    Returns
    -------
    OperatorStats
    """
    if mod_or_exe is None:
        return operator_stats_collection(verbose=verbose)
    stats = static_operator_stats(mod_or_exe)
    if verbose:
        print(stats.table())
    return stats


_COLLECTING: list[OperatorStats] = []


def enable_operator_stats_collection() -> OperatorStats:
    """Count executed op calls: models built from now on are instrumented; returns the counts."""
    _COLLECTING[:] = [OperatorStats()]
    add_instrumentation_hook(count_hook)
    return _COLLECTING[0]


def disable_operator_stats_collection(verbose: bool = True) -> OperatorStats:
    """Stop counting; print (``verbose``) and return the calls executed since enabling."""
    stats = _COLLECTING[0] if _COLLECTING else OperatorStats()
    _COLLECTING.clear()
    remove_instrumentation_hook(count_hook)
    if verbose:
        print(stats.table(), file=sys.stdout)
    return stats


@contextlib.contextmanager
def operator_stats_collection(verbose: bool = True):
    """``with operator_stats_collection() as stats:`` build and run models, then read stats."""
    stats = enable_operator_stats_collection()
    try:
        yield stats
    finally:
        disable_operator_stats_collection(verbose=verbose)


def count_hook(converted) -> tvm.IRModule:
    """Instrumentation hook: count each op call, with its compute dtype, when it runs."""

    def emit(site: Site, _value):
        return [packed_call(COUNT_FUNC, site.short_op, site.dtype)]

    return instrument_module(converted.mod, emit)


@tvm.register_global_func(COUNT_FUNC, override=True)
def _count_op(op, dtype):
    if _COLLECTING:
        _COLLECTING[0].add(str(op), str(dtype))
