"""The kernels to tune: the converted graph after legalize and fuse, and each one's trial budget."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import tvm

from tvmamp.pipeline import run_front_phases
from tvmamp.targets import DEFAULT_SPACE


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
        Its design space's name, from the target entry's ``design_space``: "post-order-apply"
        (meta_schedule's rules, evolutionary search) or the target's own
        ("bf16-gemm:<digest>": tvmamp's vdpbf16ps/AMX configurations on CPUs with avx512_bf16).
    space_size : int or None
        How many distinct candidates the space holds when that is known (the most trials the
        task can use), else None.
    space_generator : callable or None
        ``(target) -> meta_schedule SpaceGenerator`` of the target's own space, whose
        configurations are each measured once; None for meta_schedule's space.
    """

    name: str
    mod: tvm.IRModule
    weight: int
    flops: float
    workload: str
    trials: int = 0
    space: str = DEFAULT_SPACE.name
    space_size: int | None = None
    space_generator: Callable | None = None


def lower_for_tuning(converted) -> tvm.IRModule:
    """``tvmamp.pipeline.run_front_phases``: the phases before scheduling (partition, legalize,
    fuse), so the kernels meta_schedule tunes are exactly those a build looks up in the log."""
    return run_front_phases(converted)


def extract_tasks(converted) -> list[Task]:
    """The kernels of the lowered graph, in TVM's order, with their FLOPs and design spaces."""
    from tvm.s_tir import meta_schedule as ms
    from tvm.s_tir.analysis import estimate_tir_flops

    lowered = run_front_phases(converted)  # the kernels a build looks up in the log
    tasks = []
    for task in ms.relax_integration.extract_tasks(lowered, converted.target):
        mod = task.dispatched[0]
        if mod.attrs is not None and mod.attrs.get("tirx.is_scheduled", False):
            continue  # already scheduled by the target's partition phase
        flops = float(estimate_tir_flops(mod)) * int(task.weight)
        workload = str(ms.database.Workload(mod).as_json()[0])
        space = converted.entry.design_space(mod, converted.target)
        name, weight = str(task.task_name), int(task.weight)
        tasks.append(
            Task(name, mod, weight, flops, workload, 0, space.name, space.size, space.generator)
        )
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
