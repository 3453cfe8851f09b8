"""The kernels to tune: the converted graph after legalize and fuse, and each one's trial budget."""

from __future__ import annotations

import dataclasses
import json

import tvm

# GPU limits meta_schedule's CUDA rules need and plain "cuda -arch=sm_XY" targets lack: the
# values every NVIDIA GPU since sm_30 supports (48 KB is the most without opt-in shared memory).
GPU_LIMITS = {"max_threads_per_block": 1024, "max_shared_memory_per_block": 49152}


@dataclasses.dataclass
class Task:
    """One fused kernel (a meta_schedule task) and its share of the trial budget.

    Attributes
    ----------
    name : str
        The fused PrimFunc's name ("fused_matmul_add_relu").
    mod : tvm.IRModule
        The kernel as meta_schedule sees it (normalised, one ``main`` PrimFunc).
    weight : int
        How many times the graph calls it.
    flops : float
        FLOPs of all its calls (TVM's estimate times ``weight``).
    workload : str
        meta_schedule's structural hash of ``mod``, as the log's workload file stores it.
    trials : int
        The trials this task gets out of the total budget.
    """

    name: str
    mod: tvm.IRModule
    weight: int
    flops: float
    workload: str
    trials: int = 0


def lower_for_tuning(converted) -> tvm.IRModule:
    """Run the phases of ``tvmamp.build`` that come before scheduling (partition, legalize, fuse).

    The kernels meta_schedule tunes are then exactly those ``build`` will look up in the log.
    """
    from tvmamp.build import front_phases

    target, entry = converted.target, converted.entry
    with target:
        passes = front_phases(target, entry, converted.policy)
        return tvm.transform.Sequential(passes)(converted.mod)


def extract_tasks(converted) -> list[Task]:
    """The kernels of the lowered graph, in TVM's order, with their FLOPs."""
    from tvm.s_tir import meta_schedule as ms
    from tvm.s_tir.analysis import estimate_tir_flops

    lowered = lower_for_tuning(converted)
    tasks = []
    for task in ms.relax_integration.extract_tasks(lowered, converted.target):
        mod = task.dispatched[0]
        if mod.attrs is not None and mod.attrs.get("tirx.is_scheduled", False):
            continue  # already scheduled by the target's partition phase
        flops = float(estimate_tir_flops(mod)) * int(task.weight)
        workload = str(ms.database.Workload(mod).as_json()[0])
        tasks.append(Task(str(task.task_name), mod, int(task.weight), flops, workload))
    return tasks


def split_budget(tasks: list[Task], trials: int) -> list[Task]:
    """Give each task its share of ``trials`` by its share of the FLOPs (largest remainder).

    Tasks with no FLOPs (casts, copies) get no trials and keep the default schedules.
    """
    if not isinstance(trials, int) or isinstance(trials, bool) or trials < 0:
        raise ValueError(f"tvmamp.tune: trials must be a non-negative integer, got {trials!r}")
    total = sum(t.flops for t in tasks)
    if total <= 0:
        return [dataclasses.replace(t, trials=0) for t in tasks]
    exact = [trials * t.flops / total for t in tasks]
    shares = [int(x) for x in exact]
    by_remainder = sorted(range(len(tasks)), key=lambda i: exact[i] - shares[i], reverse=True)
    for i in by_remainder[: trials - sum(shares)]:
        shares[i] += 1
    return [dataclasses.replace(t, trials=n) for t, n in zip(tasks, shares)]


def tuning_target(target: tvm.target.Target) -> tuple[tvm.target.Target, list[str]]:
    """The target meta_schedule tunes for: ``target`` plus GPU limits it may lack, and a note."""
    if target.kind.name != "cuda":
        return target, []
    spec = json.loads(str(target))
    missing = {k: v for k, v in GPU_LIMITS.items() if k not in spec}
    if not missing:
        return target, []
    spec.update(missing)
    assumed = ", ".join(f"{k}={v}" for k, v in missing.items())
    note = f"tuned assuming {assumed}; name the GPU (e.g. nvidia/a100) for its exact limits"
    return tvm.target.Target(spec), [note]
