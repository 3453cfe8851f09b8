"""tvmamp.tune: meta_schedule with the XGBoost cost model on the AMP-converted kernels."""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from collections.abc import Mapping, Sequence

from tvmamp.conversion import convert
from tvmamp.schedules.intrin_loader import load, only_target_intrinsics

from . import logfile
from .manifest import FILENAME, compare, make_manifest, read_manifest, write_manifest
from .rpc import RPC
from .tasks import extract_tasks, split_budget


@dataclasses.dataclass
class TaskResult:
    """One kernel of a tuning log: its budget, the trials the log holds and its best time."""

    name: str
    weight: int
    flops: float
    trials: int
    done: int
    best_ms: float | None
    default_ms: float | None = None
    default_timed: bool = False


@dataclasses.dataclass
class TuneResult:
    """What :func:`tune` did: the log, per-task results, whether anything was timed, notes."""

    work_dir: str
    tasks: list
    measured: bool
    new_trials: int
    seconds: float
    notes: list

    def summary(self) -> str:
        """A table of the tasks (default = the untuned schedule timed alongside), then notes."""
        rows = [
            f"{'task':<40} {'calls':>5} {'GFLOP':>8} {'trials':>9} {'best ms':>9} {'default':>9}"
        ]
        for t in self.tasks:
            best = f"{t.best_ms:.4g}" if t.best_ms is not None else "-"
            default = f"{t.default_ms:.4g}" if t.default_ms is not None else "-"
            trials, gflop = f"{t.done}/{t.trials}", t.flops / 1e9
            rows.append(
                f"{t.name:<40} {t.weight:>5} {gflop:>8.3f} {trials:>9} {best:>9} {default:>9}"
            )
        return "\n".join(rows + [f"note: {n}" for n in self.notes])


def tune(
    mod,
    target="llvm",
    level: str = "O2",
    dtype: str | None = None,
    work_dir: str | os.PathLike = "logs/",
    trials: int = 512,
    params: Mapping | None = None,
    rpc: RPC | None = None,
    *,
    custom_white_list: Sequence[str] | None = None,
    custom_black_list: Sequence[str] | None = None,
    custom_fp32_nodes: Sequence[str] | None = None,
    custom_low_nodes: Sequence[str] | None = None,
    keep_io_types: bool = True,
    accumulate_dtype: str = "float32",
    num_trials_per_iter: int = 64,
    population_size: int | None = None,
    evaluator_config=None,
    seed: int | None = None,
    progress: bool = True,
) -> TuneResult:
    """Auto-schedule the kernels of a model with meta_schedule's XGBoost cost model.

    The model is converted exactly as ``tvmamp.build`` converts it (same level, dtype, lists)
    and lowered through the same partition, legalize and fuse phases, so the kernels tuned are
    the low-precision kernels the build will run. ``trials`` is split across kernels by their
    share of the FLOPs. Records go to a meta_schedule database in ``work_dir``
    (database_workload.json, database_tuning_record.json) with a manifest
    (tvmamp_manifest.json). A run that is killed keeps every finished record; running the same
    call again continues up to ``trials`` without measuring a candidate twice.

    Parameters
    ----------
    mod, target, level, dtype, params, custom_white_list, custom_black_list, keep_io_types,
    custom_fp32_nodes, custom_low_nodes, accumulate_dtype
        As for :func:`tvmamp.build`.
    work_dir : path
        The log directory; pass it to ``tvmamp.build(..., tuning_log=work_dir)``.
    trials : int
        Measured candidates in total, over all kernels (records already in the log count).
    rpc : tvmamp.RPC, optional
        Measure on the devices of a TVM RPC tracker instead of this machine.
    num_trials_per_iter : int
        Candidates per search round (meta_schedule's batch).
    population_size : int, optional
        The evolutionary search's population; default 8 x the task's trials, in [64, 512].
    evaluator_config : meta_schedule.runner.EvaluatorConfig, optional
        How each candidate is timed (TVM's default: 3 runs, at least 100 ms).
    seed : int, optional
        Seed of the search.
    progress : bool
        Show a tqdm bar (trials, task being tuned, best latency so far).

    Returns
    -------
    TuneResult
        ``measured`` is False when nothing could be timed (a CUDA target with no local GPU and
        no ``rpc``): then candidates were only generated and built, and no record was written.
    """
    start = time.perf_counter()
    if rpc is not None and not isinstance(rpc, RPC):
        raise TypeError(f"tvmamp.tune: rpc must be a tvmamp.RPC, got {type(rpc).__name__}")
    if not isinstance(num_trials_per_iter, int) or num_trials_per_iter < 1:
        raise ValueError(
            f"tvmamp.tune: num_trials_per_iter must be a positive integer, got "
            f"{num_trials_per_iter!r}"
        )
    converted = convert(
        mod,
        level,
        target,
        dtype,
        params,
        custom_white_list,
        custom_black_list,
        custom_fp32_nodes,
        custom_low_nodes,
        keep_io_types,
        accumulate_dtype,
    )
    tasks = split_budget(extract_tasks(converted), trials)
    options = _Options(num_trials_per_iter, population_size, evaluator_config, seed, progress)
    work_dir = os.fspath(work_dir)
    entry = converted.entry
    target, notes = entry.tuning_target(converted.target)
    if rpc is None and not entry.device(target).exist:
        from .build_only import build_candidates_only

        notes += build_candidates_only(tasks, target, entry, options)
        return TuneResult(work_dir, _results(tasks, None), False, 0, _since(start), notes)
    notes += _prepare_work_dir(work_dir, converted, tasks, trials)
    new_trials = _tune_tasks(work_dir, tasks, target, entry, rpc, options)
    results = _results(tasks, logfile.scan(work_dir, "tvmamp.tune"), work_dir)
    return TuneResult(work_dir, results, True, new_trials, _since(start), notes)


@dataclasses.dataclass(frozen=True)
class _Options:
    num_trials_per_iter: int
    population_size: int | None
    evaluator_config: object
    seed: int | None
    progress: bool


def _since(start: float) -> float:
    return time.perf_counter() - start


def _prepare_work_dir(work_dir: str, converted, tasks, trials: int) -> list[str]:
    """Check an existing log is for the same target/level/dtype, repair it, write the manifest."""
    os.makedirs(work_dir, exist_ok=True)
    manifest = make_manifest(converted, tasks, trials)
    notes = []
    if os.path.isfile(os.path.join(work_dir, FILENAME)):
        old = read_manifest(work_dir, "tvmamp.tune")
        mismatches, _ = compare(old, converted)
        if mismatches:
            raise ValueError(
                f"tvmamp.tune: work_dir {work_dir!r} holds a log for another configuration "
                f"({'; '.join(mismatches)}); use a new work_dir"
            )
        manifest.models = list(dict.fromkeys([*old.models, *manifest.models]))
        manifest.created = old.created or manifest.created
        earlier = {t.get("workload"): t for t in old.tasks}
        for entry in manifest.tasks:  # keep default-schedule times measured before
            if "default_ms" in earlier.get(entry["workload"], {}):
                entry["default_ms"] = earlier[entry["workload"]]["default_ms"]
        ours = {t["workload"] for t in manifest.tasks}
        manifest.tasks += [t for t in old.tasks if t.get("workload") not in ours]
        for name in logfile.repair(work_dir):
            notes.append(f"dropped the cut-short last line of {name} (a killed run)")
        logfile.scan(work_dir, "tvmamp.tune")
    for name in (logfile.WORKLOADS, logfile.RECORDS):
        open(os.path.join(work_dir, name), "a").close()  # an empty log is a valid log
    write_manifest(work_dir, manifest)
    return notes


def _results(tasks, scan, work_dir=None) -> list[TaskResult]:
    index = {w: i for i, w in enumerate(scan.workloads)} if scan is not None else {}
    defaults = {t.get("workload"): t for t in read_manifest(work_dir).tasks} if work_dir else {}
    results = []
    for t in tasks:
        i = index.get(t.workload)
        done = scan.trials.get(i, 0) if i is not None else 0
        best = scan.best_secs.get(i) if i is not None else None
        best_ms = best * 1e3 if best is not None else None
        entry = defaults.get(t.workload, {})
        result = TaskResult(t.name, t.weight, t.flops, t.trials, done, best_ms)
        result.default_ms, result.default_timed = entry.get("default_ms"), "default_ms" in entry
        results.append(result)
    return results


def _tune_tasks(work_dir: str, tasks, target, entry, rpc, options: _Options) -> int:
    """Tune every task that has trials left; returns the candidates measured now."""
    so_far = _results(tasks, logfile.scan(work_dir), work_dir)
    pending = [
        (t, r)
        for t, r in zip(tasks, so_far)
        if t.trials > 0 and (r.done < t.trials or not r.default_timed)
    ]
    if not pending:
        return 0
    from .session import Session

    families = entry.intrinsic_families(target)
    with only_target_intrinsics(families):
        initializer = functools.partial(load, families)
        session = Session(work_dir, target, entry, rpc, options, initializer)
        total = sum(max(t.trials - r.done, 0) for t, r in pending)
        return session.run(pending, total, functools.partial(_record_default, work_dir))


def _record_default(work_dir: str, task, secs: float | None) -> None:
    """Store a task's default-schedule time in the manifest (None: no default applies)."""
    manifest = read_manifest(work_dir, "tvmamp.tune")
    for entry in manifest.tasks:
        if entry.get("workload") == task.workload:
            entry["default_ms"] = secs * 1e3 if secs is not None else None
    write_manifest(work_dir, manifest)
