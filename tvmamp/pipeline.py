"""The compile pipeline: a converted module through the target phases to a Relax VM executable.

The phases keep the names TVM gives its own backends (``tvm/relax/backend/cpu_generic/
pipeline.py``); each is a function returning passes, run in order under ``with target:``:

1. :func:`library_dispatch_passes`: the input-size conditions of the convs and pools, the
   target entry's partitioning (BYOC, layout and padding rewrites, fast math), then TVM's
   sampling and sort/scan dispatch;
2. :func:`legalize_passes`: legalize Relax ops to TIR, fold constants, fuse kernels.
   Phases 1-2 are :func:`front_phases`: the kernels tuning sees and a tuning log is checked
   against;
3. :func:`schedule_passes`: tuned kernels from a meta_schedule database, then the target's
   default schedules (dlight rules from ``schedules/``);
4. :func:`dataflow_lower_passes`: dataflow blocks to ordinary bindings, the input-size check
   first in each public function, ``call_tir`` lowered;
5. :func:`finalize_passes`: memory planning and VM lowering, then the target entry's last word
   (on CPUs the feature guard of ``targets/cpu_guard.py``).

:func:`compile_converted` runs phases 1-2 once, hands that module to an optional check (the
tuning log's coverage check), then runs phases 3-5 and ``tvm.compile``. Instrumentation hooks
(the debugging tools) rewrite the converted module before phase 1. This module imports only the
layers below it (conversion, targets, executable); the driver and the features above call it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable

import tvm
from tvm import relax

from tvmamp.conversion import Converted
from tvmamp.executable import Executable
from tvmamp.relay_passes import (
    low_reductions,
    nan_ops,
    slice_axes,
    symbolic_concat,
    symbolic_reshape,
)
from tvmamp.relay_passes.branches import OutlineBranches
from tvmamp.relay_passes.size_checks import CollectSizeChecks, InsertSizeChecks
from tvmamp.relay_passes.size_params import SizeParamsAsShapes
from tvmamp.relay_passes.symbolic_order import OrderShapeDefinitions
from tvmamp.targets.registry import derived_pass_context

# ``hook(converted) -> tvm.IRModule``: rewrites every converted module before it is lowered while
# registered (the debugging tools insert their packed calls this way). With no hook registered
# the compiled module is exactly the uninstrumented one.
InstrumentationHook = Callable[[Converted], tvm.IRModule]
_INSTRUMENTATION_HOOKS: list[InstrumentationHook] = []


def add_instrumentation_hook(hook: InstrumentationHook) -> None:
    """Register ``hook`` (once): every later :func:`compile_converted` applies it."""
    if hook not in _INSTRUMENTATION_HOOKS:
        _INSTRUMENTATION_HOOKS.append(hook)


def remove_instrumentation_hook(hook: InstrumentationHook) -> None:
    """Unregister ``hook`` if it is registered."""
    while hook in _INSTRUMENTATION_HOOKS:
        _INSTRUMENTATION_HOOKS.remove(hook)


def instrumentation_hooks() -> tuple[InstrumentationHook, ...]:
    """The registered hooks, in the order they run."""
    return tuple(_INSTRUMENTATION_HOOKS)


def library_dispatch_passes(target, entry, policy) -> list:
    """Phase 1: the input-size conditions of the convs and pools (checked from phase 4 on),
    the target entry's partition passes, then TVM's library dispatch."""
    return [
        CollectSizeChecks(),
        *entry.partition_passes(target, policy),
        relax.backend.DispatchSampling(),
        relax.backend.DispatchSortScan(),
    ]


def legalize_passes(target=None, entry=None) -> list:
    """Phase 2: legalize Relax ops to TIR (tvmamp's rules, then the target entry's
    ``legalize_rules`` over them), fold constants, fuse the kernels (with the target entry's
    ``fusion_passes`` between grouping the ops and fusing their TIR)."""
    fusion = entry.fusion_passes(target) if entry is not None else []
    rules = {
        **low_reductions.LEGALIZE_MAP,
        **nan_ops.LEGALIZE_MAP,
        **symbolic_reshape.LEGALIZE_MAP,
        **symbolic_concat.LEGALIZE_MAP,
        **slice_axes.LEGALIZE_MAP,
        **(entry.legalize_rules(target) if entry is not None else {}),
    }
    return [
        # low reductions add up in fp32; ReLU, clip, maximum and minimum keep NaN; a symbolic
        # reshape TVM cannot prove a view stays one; a symbolic concatenation stays fusable; a
        # slice's negative axes count from the end
        relax.transform.LegalizeOps(rules),
        relax.transform.AnnotateTIROpPattern(),
        slice_axes.SlicesIntoReductions(),  # a cache's values fuse into the kernel reading them
        relax.transform.FoldConstant(),
        relax.transform.FuseOps(),
        OrderShapeDefinitions(),  # FuseOps may hoist a call above its sizes' match_cast
        *fusion,
        SizeParamsAsShapes(),  # FuseTIR defines a scalar size parameter twice
        relax.transform.FuseTIR(),
    ]


def front_phases(target, entry, policy) -> list:
    """Phases 1 and 2 (partition, dispatch, legalize, fuse): the kernels tuning sees."""
    return [*library_dispatch_passes(target, entry, policy), *legalize_passes(target, entry)]


def schedule_passes(target, entry, database=None) -> list:
    """Phase 3: kernels from ``database`` (the current meta_schedule database when the passes
    run), then the target's default schedules for the rest."""
    applied = [relax.transform.MetaScheduleApplyDatabase()] if database is not None else []
    return [*applied, *entry.schedule_passes(target)]


def dataflow_lower_passes() -> list:
    """Phase 4: each ``If`` branch a function of its own (phase 5's memory planning shares
    storage across branches), dataflow blocks to ordinary bindings, the input-size check first
    in each public function, ``call_tir`` to destination passing."""
    return [
        OutlineBranches(),
        symbolic_reshape.RewriteDataflowReshape,
        relax.transform.ToNonDataflow(),
        relax.transform.RemovePurityChecking(),
        InsertSizeChecks(),
        relax.transform.CallTIRRewrite(),
    ]


def finalize_passes(target, entry) -> list:
    """Phase 5: memory planning and VM lowering, then the target entry's last word (the CPU
    feature guard of ``targets/cpu_guard.py`` on LLVM targets)."""
    return [
        relax.transform.StaticPlanBlockMemory(),
        relax.transform.LowerAllocTensor(),
        relax.transform.KillAfterLastUse(),
        relax.transform.LowerRuntimeBuiltin(),
        relax.transform.ComputePrimValue(),
        relax.transform.VMShapeLower(),
        relax.transform.AttachGlobalSymbol(),
        *entry.finalize_passes(target),
    ]


def _back_phases(target, entry, database) -> list:
    """Phases 3-5: what runs after the front phases."""
    return [
        *schedule_passes(target, entry, database),
        *dataflow_lower_passes(),
        *finalize_passes(target, entry),
    ]


def _as_pass(target, phases: Callable[[], list], name: str) -> tvm.transform.Pass:
    """One module pass running ``phases()`` under ``with target:`` (as mlc-llm's pipeline)."""

    @tvm.transform.module_pass(opt_level=0, name=name)
    def pipeline(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        with target:
            return tvm.transform.Sequential(phases())(mod)

    return pipeline


def relax_pipeline(target, entry, policy, database=None) -> tvm.transform.Pass:
    """Every phase, 1 to 5, as one pass for ``tvm.compile(mod, relax_pipeline=...)``.

    With ``database``, compile inside ``with database:`` so that phase 3 finds it. Pass
    ``tir_pipeline=entry.tir_pipeline(target)`` to ``tvm.compile`` as well, as
    :func:`compile_converted` does: the CPU kernels need tvmamp's TIR lowering to keep their
    register tiles in registers inside parallel loops.
    """
    return _as_pass(
        target,
        lambda: [*front_phases(target, entry, policy), *_back_phases(target, entry, database)],
        "tvmamp.Pipeline",
    )


def run_front_phases(converted: Converted, mod: tvm.IRModule | None = None) -> tvm.IRModule:
    """Phases 1-2 on ``mod`` (by default ``converted.mod``) for ``converted``'s target."""
    target, entry = converted.target, converted.entry
    with target:
        passes = front_phases(target, entry, converted.policy)
        return tvm.transform.Sequential(passes)(converted.mod if mod is None else mod)


def compile_converted(
    converted: Converted,
    database=None,
    check_kernels: Callable[[tvm.IRModule], list] | None = None,
) -> Executable:
    """Lower a converted module for its target: hooks, then phases 1-2 once, then 3-5.

    Parameters
    ----------
    converted : Converted
        From :func:`tvmamp.convert`.
    database : tvm.s_tir.meta_schedule.Database, optional
        Tuned kernels applied in phase 3 (a tuning log opened by ``tvmamp.tuning``).
    check_kernels : callable, optional
        ``check_kernels(mod) -> list of str`` is called with the module after phases 1-2 (the
        kernels phase 3 schedules); it may raise, and what it returns becomes ``exe.notes``.
        A tuning log's coverage check goes here, so the module is lowered only once.

    Returns
    -------
    Executable
    """
    mod = converted.mod
    for hook in _INSTRUMENTATION_HOOKS:
        mod = hook(dataclasses.replace(converted, mod=mod))
    target, entry = converted.target, converted.entry
    with _pass_context(converted):
        lowered = run_front_phases(converted, mod)
        notes = list(check_kernels(lowered)) if check_kernels is not None else []
        back = _as_pass(target, lambda: _back_phases(target, entry, database), "tvmamp.Lower")
        with database if database is not None else contextlib.nullcontext():
            vm_exec = tvm.compile(
                lowered, target=target, relax_pipeline=back, tir_pipeline=entry.tir_pipeline(target)
            )
    exe = Executable(
        vm_exec, target, converted.mod, converted.report, converted.policy, notes, entry=entry
    )
    report = getattr(entry, "partition_report", None)
    exe.partition = report(target, converted.policy, converted.mod) if report else None
    return exe


def _pass_context(converted: Converted) -> tvm.transform.PassContext:
    """The caller's PassContext plus the target entry's options (cp.async on sm_80+)."""
    return derived_pass_context(converted.entry.pass_config(converted.target))
