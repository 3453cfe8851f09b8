"""Read, check and repair the meta_schedule database files of a tuning log."""

from __future__ import annotations

import dataclasses
import json
import os

WORKLOADS = "database_workload.json"
RECORDS = "database_tuning_record.json"
# meta_schedule's value for a candidate that failed to build or run
FAILED_SECS = 1e9


@dataclasses.dataclass
class LogScan:
    """What the database files hold, read line by line without TVM.

    Attributes
    ----------
    workloads : list of str
        The structural hash string of each workload line, in file order.
    trials : dict
        workload index -> number of records (measured candidates, failures included).
    best_secs : dict
        workload index -> best median run time in seconds (failures excluded).
    truncated : list of str
        Files whose last line was cut short (a run killed while writing).
    targets : dict
        JSON text of each target the records were tuned for -> the first line naming it.
    """

    workloads: list
    trials: dict
    best_secs: dict
    truncated: list
    targets: dict = dataclasses.field(default_factory=dict)


def scan(work_dir: str, component: str = "tvmamp") -> LogScan:
    """Check every line of both database files; a corrupt line is a ValueError naming it."""
    result = LogScan([], {}, {}, [])
    for number, item in _lines(work_dir, WORKLOADS, result.truncated, component):
        pair = isinstance(item, list) and len(item) == 2
        if not (pair and all(isinstance(x, str) for x in item)):
            raise _corrupt(work_dir, WORKLOADS, number, "not a [hash, module] pair", component)
        result.workloads.append(item[0])
    for number, item in _lines(work_dir, RECORDS, result.truncated, component):
        index, secs = _record(item, len(result.workloads))
        if index is None:
            raise _corrupt(work_dir, RECORDS, number, secs, component)
        result.trials[index] = result.trials.get(index, 0) + 1
        result.targets.setdefault(json.dumps(item[1][2], sort_keys=True), number)
        if secs is not None and secs < FAILED_SECS:
            result.best_secs[index] = min(secs, result.best_secs.get(index, secs))
    return result


def _lines(work_dir, name, truncated, component):
    path = os.path.join(work_dir, name)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{component}: tuning log {work_dir!r} lacks {name}; "
            "create one with tvmamp.tune(..., work_dir=...)"
        )
    with open(path, "rb") as f:
        data = f.read()
    lines = data.split(b"\n")
    if lines[-1]:  # the writer ends every line with a newline: the last one was cut short
        truncated.append(name)
    for number, line in enumerate(lines[:-1], start=1):
        if not line.strip():
            continue
        try:
            yield number, json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise _corrupt(work_dir, name, number, str(err), component) from None


def _record(item, num_workloads):
    """``(workload index, median secs or None)``, or ``(None, reason)`` for a malformed record."""
    if not (isinstance(item, list) and len(item) == 2 and isinstance(item[1], list)):
        return None, "not a [workload index, record] pair"
    index, record = item
    if not isinstance(index, int) or not 0 <= index < num_workloads:
        return None, f"workload index {index!r} is not one of the {num_workloads} workloads"
    if len(record) != 4 or not isinstance(record[0], list):
        return None, "the record is not [trace, run_secs, target, args_info]"
    secs = record[1]
    if secs is None:
        return index, None
    if not (isinstance(secs, list) and secs and all(isinstance(s, int | float) for s in secs)):
        return None, f"run_secs {secs!r} is not a list of numbers"
    return index, sorted(secs)[len(secs) // 2]


def _corrupt(work_dir, name, number, reason, component) -> ValueError:
    return ValueError(
        f"{component}: tuning log {work_dir!r} is corrupt: {name} line {number}: {reason}. "
        "Delete the log and tune again"
    )


def check_complete(work_dir: str, component: str = "tvmamp") -> LogScan:
    """:func:`scan`, refusing a log whose last line was cut short by a killed tuning run."""
    result = scan(work_dir, component)
    if result.truncated:
        raise ValueError(
            f"{component}: tuning log {work_dir!r} is truncated: the last line of "
            f"{' and '.join(result.truncated)} was cut short (a tuning run was killed while "
            "writing). Rerun the same tvmamp tune command to repair it and finish the run"
        )
    return result


def repair(work_dir: str) -> list[str]:
    """Drop a cut-short last line from each database file; returns the files repaired.

    A killed run can leave one partial line; the records before it are complete and kept.
    """
    repaired = []
    for name in (WORKLOADS, RECORDS):
        path = os.path.join(work_dir, name)
        if not os.path.isfile(path):
            continue
        with open(path, "rb") as f:
            data = f.read()
        if data and not data.endswith(b"\n"):
            with open(path, "wb") as f:
                f.write(data[: data.rfind(b"\n") + 1])
            repaired.append(name)
    return repaired
