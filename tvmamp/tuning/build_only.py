"""Tuning without a device to time on: generate and build candidates, record nothing."""

from __future__ import annotations

import functools
import os
import shutil

from tvm.s_tir import meta_schedule as ms

from tvmamp.schedules.intrin_loader import load, only_target_intrinsics

from .session import make_context

NO_DEVICE = (
    "measuring needs a device: there is no local {kind} device, so no candidate was timed and "
    "no tuning record was written. Measure on a remote device with "
    "rpc=tvmamp.RPC(tracker='HOST:PORT', key='KEY') (see docs/TUNING.md)"
)


def build_candidates_only(tasks, target, entry, options) -> list[str]:
    """For each task with trials: its design space, one batch of candidates, built locally.

    This checks that the target's search space generates and compiles here (for CUDA, with no
    GPU); the timings that tuning needs can only come from a device, so none are made up.
    ``entry`` (the target's TargetEntry) names the tensor intrinsics its rules can use.

    Returns
    -------
    list of str
        One note per task, then the note that nothing was measured.
    """
    families = entry.intrinsic_families(target)
    notes = []
    with only_target_intrinsics(families):
        builder = ms.builder.LocalBuilder(
            max_workers=os.cpu_count() or 1,
            initializer=functools.partial(load, families),
            f_build=entry.meta_schedule_build,
        )
        for task in tasks:
            if task.trials > 0:
                notes.append(_build_one(task, target, options, builder))
    notes.append(NO_DEVICE.format(kind=target.kind.name))
    return notes


def _build_one(task, target, options, builder) -> str:
    ctx = make_context(task, target, options)
    spaces = ctx.generate_design_space()
    batch = min(task.trials, options.num_trials_per_iter)
    ctx.pre_tuning(batch, batch, spaces, ms.database.MemoryDatabase(), ms.cost_model.RandomModel())
    candidates = ctx.generate_measure_candidates() or []
    ctx.post_tuning()
    results = builder.build([ms.builder.BuilderInput(c.sch.mod, target) for c in candidates])
    for result in results:
        if result.artifact_path is not None:
            shutil.rmtree(os.path.dirname(result.artifact_path), ignore_errors=True)
    built = sum(r.error_msg is None for r in results)
    errors = [r.error_msg.strip().splitlines()[-1] for r in results if r.error_msg]
    first_error = f"; first build error: {errors[0][:300]}" if errors else ""
    return (
        f"{task.name}: {len(spaces)} design space(s); built {built} of {len(candidates)} "
        f"candidates (not timed){first_error}"
    )
