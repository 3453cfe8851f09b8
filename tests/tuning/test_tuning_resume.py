"""Resuming a tuning log: finished records are kept, nothing is measured twice, budgets split."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import tvm_ffi
from tuning_support import DTYPE, LEVEL, TARGET, TRIALS, tiny_model

from tvmamp.tuning import tune
from tvmamp.tuning.tasks import Task, split_budget

RECORDS = "database_tuning_record.json"


def _task(name, flops):
    return Task(name, None, 1, flops, name)


def test_budget_follows_the_share_of_flops():
    tasks = [_task("a", 6e9), _task("b", 3e9), _task("c", 1e9), _task("cast", 0.0)]
    assert [t.trials for t in split_budget(tasks, 100)] == [60, 30, 10, 0]
    assert [t.trials for t in split_budget(tasks, 7)] == [4, 2, 1, 0]  # largest remainder
    assert sum(t.trials for t in split_budget(tasks, 513)) == 513
    assert [t.trials for t in split_budget(tasks, 0)] == [0, 0, 0, 0]
    with pytest.raises(ValueError, match="trials must be a non-negative integer, got -1"):
        split_budget(tasks, -1)


def _tune_again(work_dir, trials=TRIALS):
    mod, params = tiny_model()
    return tune(mod, TARGET, LEVEL, DTYPE, work_dir, trials, params, progress=False)


def test_rerun_with_the_same_budget_measures_nothing(log_copy):
    before = (log_copy / RECORDS).read_bytes()
    result = _tune_again(log_copy)
    assert result.new_trials == 0
    assert (log_copy / RECORDS).read_bytes() == before


def test_rerun_drops_a_cut_short_line_and_keeps_the_rest(log_copy):
    path = log_copy / RECORDS
    complete = path.read_bytes()
    path.write_bytes(complete + complete.splitlines()[0][:25])  # killed while appending
    result = _tune_again(log_copy)
    assert result.notes == [f"dropped the cut-short last line of {RECORDS} (a killed run)"]
    assert path.read_bytes() == complete and result.new_trials == 0


def test_work_dir_of_another_configuration_is_refused(log_copy):
    mod, params = tiny_model()
    with pytest.raises(ValueError, match="holds a log for another configuration.*dtype"):
        tune(mod, TARGET, LEVEL, "float16", log_copy, TRIALS, params, progress=False)


KILLABLE_RUN = textwrap.dedent(
    """
    import sys
    from tvmamp import models
    from tvmamp.tuning import tune
    mod, params = models.simple_net(batch=16, hidden=64, layers=1, seed=3)
    tune(mod, sys.argv[2], "O2", "bfloat16", sys.argv[1], int(sys.argv[3]), params,
         progress=False, num_trials_per_iter=2)
    """
)


def _scheduled_hashes(work_dir):
    from tvm.s_tir import meta_schedule as ms

    database = ms.database.JSONDatabase(work_dir=str(work_dir), allow_missing=False)
    records = database.get_all_tuning_records()
    return [tvm_ffi.structural_hash(_replayed(r)) for r in records]


def _replayed(record):
    """The record's schedule (as_measure_candidate fails on padded bf16 weight packing)."""
    from tvm import s_tir

    sch = s_tir.Schedule(record.workload.mod)
    record.trace.apply_to_schedule(sch, remove_postproc=False)
    return sch.mod


@pytest.mark.slow
def test_killed_run_resumes_without_redoing_or_losing_trials(tmp_path):
    work_dir, trials = tmp_path / "log", 6
    env = dict(os.environ, TVM_NUM_THREADS="1")
    args = [sys.executable, "-c", KILLABLE_RUN, str(work_dir), TARGET, str(trials)]
    proc = subprocess.Popen(args, env=env, start_new_session=True)
    deadline = time.monotonic() + 500
    path = work_dir / RECORDS
    while time.monotonic() < deadline and proc.poll() is None:
        if path.exists() and path.read_bytes().count(b"\n") >= 2:
            break
        time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGKILL)  # the run and its builder/runner workers
    proc.wait()
    kept = path.read_bytes()
    finished = kept[: kept.rfind(b"\n") + 1]
    assert 2 <= finished.count(b"\n") < trials, "the run was not killed part-way"
    result = _tune_again(work_dir, trials)
    assert path.read_bytes().startswith(finished)  # no finished record lost
    hashes = _scheduled_hashes(work_dir)
    assert len(hashes) == trials and len(set(hashes)) == trials  # none measured twice
    assert result.new_trials == trials - finished.count(b"\n")
    assert json.loads((work_dir / "tvmamp_manifest.json").read_text())["trials"] == trials
