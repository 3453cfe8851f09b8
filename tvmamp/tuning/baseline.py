"""Time each kernel's default (untuned) schedule, so that a tuning log never slows a build down."""

from __future__ import annotations

import os
import shutil

import tvm
from tvm.s_tir.meta_schedule.arg_info import ArgInfo
from tvm.s_tir.meta_schedule.builder import BuilderInput
from tvm.s_tir.meta_schedule.runner import RunnerInput

from .callbacks import median_secs
from .packed_weights import for_measuring


def default_schedule(task, target, entry) -> tvm.IRModule | None:
    """The task's kernel under the target's default schedule passes (None if none applies)."""
    # a copy: dlight's ApplyDefaultSchedule replaces functions in the module it is given
    mod = tvm.IRModule(dict(task.mod.functions_items()), attrs=task.mod.attrs)
    with target:
        mod = tvm.transform.Sequential(entry.schedule_passes(target))(mod)
    func = mod["main"]
    return mod if func.attrs.get("tirx.is_scheduled", False) else None


def measure_default(task, target, entry, builder, runner) -> float | None:
    """Median seconds of the default schedule, timed by the same builder and runner as the trials.

    Returns None when no default schedule applies or it fails to build or run.
    """
    mod = default_schedule(task, target, entry)
    if mod is None:
        return None
    mod = for_measuring(mod)
    (built,) = builder.build([BuilderInput(mod, target)])
    if built.error_msg is not None:
        return None
    device = entry.device(target).__device_type_name__()
    # as for meta_schedule's own candidates: weight-packing blocks run at compile time, not here
    args_info = ArgInfo.from_entry_func(mod, remove_preproc=True)
    (future,) = runner.run([RunnerInput(built.artifact_path, device, args_info)])
    secs = median_secs(future.result())
    shutil.rmtree(os.path.dirname(built.artifact_path), ignore_errors=True)
    return secs
