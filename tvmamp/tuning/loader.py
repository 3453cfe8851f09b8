"""Open a tuning log for a build: check it, then say which kernels it covers."""

from __future__ import annotations

import dataclasses
import json
import os

from tvm import tirx

from tvmamp.targets import DEFAULT_SPACE

from . import logfile
from .intrinsics import register_log_intrinsics
from .manifest import SOFT_TARGET_KEYS, Manifest, compare, read_manifest
from .tasks import lower_for_tuning

COMPONENT = "tvmamp.build"


@dataclasses.dataclass
class TuningLog:
    """A tuning log opened for one converted model (:func:`open_tuning_log`).

    Attributes
    ----------
    path : str
        The log directory.
    database : tvm.s_tir.meta_schedule.Database
        The best record of each kernel, in memory (building never writes to the log). Use it as
        a context manager around ``tvm.compile`` with ``MetaScheduleApplyDatabase`` in the
        pipeline (``tvmamp.pipeline.compile_converted`` does).
    notes : list of str
        What a user should know so far: an override, another thread count, another model,
        defaults kept because they were faster.
    target : tvm.target.Target
        The target the model is compiled for.
    """

    path: str
    database: object
    notes: list
    target: object

    def check_kernels(self, lowered) -> list[str]:
        """The notes, plus which kernels of ``lowered`` have a record.

        ``lowered`` is the module after the pipeline's phases 1-2 (``front_phases``). Every
        record that matches a kernel is replayed now, so one that does not apply fails here,
        with the kernel's name, rather than in the middle of compiling.
        """
        return self.notes + _coverage(self.database, lowered, self.target)


def open_tuning_log(path, converted, override: bool = False) -> TuningLog:
    """Open the tuning log in ``path`` for building ``converted``, without lowering it.

    The checks and the arguments are :func:`load_tuning_log`'s; the kernel coverage is left to
    :meth:`TuningLog.check_kernels`, which ``tvmamp.build`` hands to
    ``tvmamp.pipeline.compile_converted`` so that the module is lowered once.
    """
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(
            f"{COMPONENT}: tuning log {path!r} is not a directory; "
            "create one with tvmamp.tune(..., work_dir=...)"
        )
    manifest = read_manifest(path, COMPONENT)
    mismatches, notes = compare(manifest, converted)
    if mismatches and not override:
        raise ValueError(
            f"{COMPONENT}: tuning log {path!r} was made for another configuration: "
            f"{'; '.join(mismatches)}. Tune for this one, or pass tuning_log_override=True "
            "to apply it anyway"
        )
    notes = [f"override: log applied although {m}" for m in mismatches] + notes
    scan = logfile.check_complete(path, COMPONENT)
    register_log_intrinsics(path)
    _check_record_targets(path, manifest, scan)
    database, kept = _best_records(path, manifest, converted)
    return TuningLog(path, database, notes + kept, converted.target)


def load_tuning_log(path, converted, override: bool = False):
    """Open the tuning log in ``path`` for building ``converted``, and check its coverage.

    Parameters
    ----------
    path : str or os.PathLike
        A directory written by ``tvmamp.tune``.
    converted : tvmamp.Converted
        The converted model about to be compiled (``tvmamp.convert``).
    override : bool
        Apply a log made for another target, level or dtype anyway (its kernels are still
        applied only where they match the graph's kernels exactly).

    Returns
    -------
    database : tvm.s_tir.meta_schedule.Database
        The best record of each kernel, in memory (building never writes to the log). Use it as
        a context manager around ``tvm.compile`` with ``MetaScheduleApplyDatabase`` in the
        pipeline.
    notes : list of str
        What a user should know: kernels without a record (they keep the default schedules),
        an override, another thread count, another model.

    Raises
    ------
    FileNotFoundError
        ``path`` or one of its files is missing.
    ValueError
        The log was made for another target, level or dtype (without ``override``), or a file
        is corrupt or truncated, or a record does not apply to the kernel it names.
    """
    log = open_tuning_log(path, converted, override)
    return log.database, log.check_kernels(lower_for_tuning(converted))


def _check_record_targets(path: str, manifest: Manifest, scan) -> None:
    """Every record must be for the manifest's target: otherwise the files were mixed up.

    Records may carry more keys than the manifest (GPU limits tuning filled in), not others.
    """
    want = {k: v for k, v in manifest.target.items() if k not in SOFT_TARGET_KEYS}
    for text, line in scan.targets.items():
        have = json.loads(text) or {}
        if any(have.get(k) != v for k, v in want.items()):
            raise ValueError(
                f"{COMPONENT}: tuning log {path!r} is inconsistent: record line {line} was tuned "
                f"for {text} but the manifest says {json.dumps(manifest.target)}"
            )


def _best_records(path: str, manifest: Manifest, converted):
    """The log's best valid record per kernel, in a MemoryDatabase, and notes.

    A kernel whose default schedule was timed faster than its best tuned record during tuning
    keeps the default (its record is left out), so applying a log never makes a build slower.
    So does a kernel tuned in another version of a target's own design space (its recorded
    space name differs from the one the target gives it now): its record holds the index of a
    candidate in a list that has changed since, and would replay as another candidate.
    """
    from tvm.s_tir import meta_schedule as ms

    pruned = ms.database.MemoryDatabase()
    _open_json_database(path).dump_pruned(pruned)
    defaults = {t.get("workload"): t for t in manifest.tasks if t.get("default_ms") is not None}
    spaces = {t.get("workload"): t for t in manifest.tasks}
    database, notes = ms.database.MemoryDatabase(), []
    for record in pruned.get_all_tuning_records():
        key = str(record.workload.as_json()[0])
        stale = _stale_space(spaces.get(key), record.workload.mod, converted)
        if stale is not None:
            notes.append(stale)
            continue
        task = defaults.get(key)
        secs = sorted(float(s) for s in record.run_secs)
        best_ms = secs[len(secs) // 2] * 1e3
        if task is not None and task["default_ms"] < best_ms:
            notes.append(
                f"kept the default schedule of {task['name']}: it ran in {task['default_ms']:.4g}"
                f" ms when tuned, the best tuned schedule in {best_ms:.4g} ms"
            )
            continue
        workload = database.commit_workload(record.workload.mod)
        database.commit_tuning_record(
            ms.database.TuningRecord(
                record.trace, workload, record.run_secs, record.target, record.args_info
            )
        )
    return database, notes


def _stale_space(task: dict | None, mod, converted) -> str | None:
    """A note when ``task`` was tuned in another version of its target's own design space."""
    if task is None or task.get("space", DEFAULT_SPACE.name) == DEFAULT_SPACE.name:
        return None
    now = converted.entry.design_space(mod, converted.target).name
    if task["space"] == now:
        return None
    return (
        f"kept the default schedule of {task.get('name', '?')}: it was tuned in design space "
        f"{task['space']!r}, and this tvmamp's is {now!r} (its candidates changed); tune again"
    )


def _open_json_database(path: str):
    from tvm.s_tir import meta_schedule as ms

    try:
        return ms.database.JSONDatabase(work_dir=path, allow_missing=False)
    except Exception as err:  # TVM raises its own error types for records it cannot replay
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise ValueError(
            f"{COMPONENT}: tuning log {path!r} is corrupt: TVM could not read it ({first}). "
            "Delete the log and tune again"
        ) from None


def _coverage(database, lowered, target) -> list[str]:
    """Replay the record of every kernel of ``lowered`` now, so a bad one fails with its name."""
    from tvm.s_tir.meta_schedule.tune_context import _normalize_mod

    applied, missing = [], []
    for gv, func in lowered.functions_items():
        if not isinstance(func, tirx.PrimFunc) or func.attrs.get("tirx.is_scheduled", False):
            continue
        name = gv.name_hint
        try:
            found = database.query_schedule(_normalize_mod(func), target, name)
        except (RuntimeError, ValueError, TypeError) as err:  # TVM errors derive from these
            raise ValueError(
                f"{COMPONENT}: the tuning log's record for kernel {name!r} does not apply: "
                f"{str(err).strip().splitlines()[0]}"
            ) from None
        (applied if found is not None else missing).append(name)
    notes = [
        f"tuned schedules from the log for {len(applied)} of {len(applied) + len(missing)} kernels"
    ]
    if missing:
        notes.append(f"no record for {', '.join(sorted(missing))}: default schedules used")
    return notes
