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
    space : str
        Its design space: "post-order-apply" (meta_schedule's rules, evolutionary search) or
        "bf16-gemm" (tvmamp's vdpbf16ps/AMX configurations, each measured once).
    space_size : int or None
        How many distinct candidates the space holds when that is known (the most trials the
        task can use), else None.
    """

    name: str
    mod: tvm.IRModule
    weight: int
    flops: float
    workload: str
    trials: int = 0
    space: str = "post-order-apply"
    space_size: int | None = None


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

    from .bf16_gemm import classify

    lowered = lower_for_tuning(converted)
    tasks = []
    for task in ms.relax_integration.extract_tasks(lowered, converted.target):
        mod = task.dispatched[0]
        if mod.attrs is not None and mod.attrs.get("tirx.is_scheduled", False):
            continue  # already scheduled by the target's partition phase
        flops = float(estimate_tir_flops(mod)) * int(task.weight)
        workload = str(ms.database.Workload(mod).as_json()[0])
        space, size = classify(mod, converted.target)
        name, weight = str(task.task_name), int(task.weight)
        tasks.append(Task(name, mod, weight, flops, workload, space=space, space_size=size))
    return tasks


def split_budget(tasks: list[Task], trials: int) -> list[Task]:
    """Give each task its share of ``trials`` by its share of the FLOPs (largest remainder).

    Tasks with no FLOPs (casts, copies) get no trials and keep the default schedules. A task
    whose space holds fewer candidates than its share (``space_size``) gets that many, and the
    rest goes to the other tasks by the same rule.
    """
    if not isinstance(trials, int) or isinstance(trials, bool) or trials < 0:
        raise ValueError(f"tvmamp.tune: trials must be a non-negative integer, got {trials!r}")
    shares = [0] * len(tasks)
    open_ = [i for i, t in enumerate(tasks) if t.flops > 0]
    left = trials
    while open_ and left > 0:
        split = _largest_remainder([tasks[i].flops for i in open_], left)
        full = [i for i, n in zip(open_, split) if _cap(tasks[i]) <= n]
        if not full:
            for i, n in zip(open_, split):
                shares[i] = n
            break
        for i in full:
            shares[i], left = _cap(tasks[i]), left - _cap(tasks[i])
        open_ = [i for i in open_ if i not in full]
    return [dataclasses.replace(t, trials=n) for t, n in zip(tasks, shares)]


def _cap(task: Task) -> float:
    return task.space_size if task.space_size is not None else float("inf")


def _largest_remainder(weights: list[float], total: int) -> list[int]:
    """Integers proportional to ``weights`` that sum to ``total``."""
    exact = [total * w / sum(weights) for w in weights]
    shares = [int(x) for x in exact]
    by_remainder = sorted(range(len(weights)), key=lambda i: exact[i] - shares[i], reverse=True)
    for i in by_remainder[: total - sum(shares)]:
        shares[i] += 1
    return shares


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
