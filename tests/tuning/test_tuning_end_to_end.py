"""Tune a tiny model, then build with the log in a fresh process: every record applies."""

import json
import os
import subprocess
import sys
import textwrap

from tuning_support import DTYPE, LEVEL, TARGET, TRIALS

# Runs in a fresh interpreter: nothing from the tuning process (databases, registered
# intrinsics, caches) can leak into the build.
FRESH_BUILD = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    import tvm
    from tvm import relax, tirx
    import tvmamp
    from tvmamp import models
    from tvmamp.benchmark import max_rel_error
    from tvmamp.tuning import load_tuning_log
    from tvmamp.tuning.tasks import lower_for_tuning

    log, target, level, dtype = sys.argv[1:5]
    mod, params = models.simple_net(batch=16, hidden=64, layers=1, seed=3)
    converted = tvmamp.convert(mod, level, target, dtype, params)
    database, notes = load_tuning_log(log, converted)
    with converted.target, database:
        applied = relax.transform.MetaScheduleApplyDatabase()(lower_for_tuning(converted))
    tuned = sorted(gv.name_hint for gv, f in applied.functions_items()
                   if isinstance(f, tirx.PrimFunc) and f.attrs.get("tirx.is_scheduled", False))
    exe = tvmamp.build(mod, level, target, dtype, params, tuning_log=log)
    x = np.random.default_rng(7).standard_normal((16, 64)).astype("float32")
    w, b = params["linear0.weight"].astype("float64"), params["linear0.bias"].astype("float64")
    ref = x.astype("float64") @ w.T + b
    print(json.dumps({"tuned": tuned, "notes": notes, "err": max_rel_error(exe(x), ref)}))
    """
)


def test_tuning_writes_log_and_manifest(tuned_log):
    work_dir, result = tuned_log
    assert result.measured and result.new_trials == TRIALS
    names = {"database_workload.json", "database_tuning_record.json", "tvmamp_manifest.json"}
    assert names <= set(os.listdir(work_dir))
    manifest = json.loads((work_dir / "tvmamp_manifest.json").read_text())
    assert (manifest["level"], manifest["dtype"]) == (LEVEL, DTYPE)
    assert manifest["target"]["kind"] == "llvm" and manifest["target"]["num-cores"] == 1
    assert {"tvmamp_version", "tvm_version", "model_hash"} <= set(manifest)
    (matmul,) = [t for t in result.tasks if t.trials > 0]  # all the FLOPs are in the matmul
    assert "matmul" in matmul.name and matmul.done == TRIALS and matmul.best_ms > 0
    assert matmul.default_ms > 0  # the untuned schedule, timed by the same runner


def test_fresh_process_build_applies_every_record(tuned_log, log_to_apply):
    work_dir, result = log_to_apply, tuned_log[1]
    env = dict(os.environ, TVM_NUM_THREADS="1")
    args = [sys.executable, "-c", FRESH_BUILD, str(work_dir), TARGET, LEVEL, DTYPE]
    proc = subprocess.run(args, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    logged = sorted(t.name for t in result.tasks if t.done > 0)
    assert out["tuned"] == logged  # every kernel with a record got its tuned schedule
    assert out["notes"][0] == f"tuned schedules from the log for 1 of {len(result.tasks)} kernels"
    assert out["err"] < 1e-2  # bf16 against float64 numpy


def test_default_schedule_is_kept_where_it_was_faster(log_copy, converted):
    from tvmamp.tuning import load_tuning_log

    path = log_copy / "tvmamp_manifest.json"
    manifest = json.loads(path.read_text())
    (task,) = [t for t in manifest["tasks"] if t["trials"]]
    for default_ms, kept in ((1e-6, False), (1e6, True)):
        task["default_ms"] = default_ms
        path.write_text(json.dumps(manifest))
        database, notes = load_tuning_log(log_copy, converted)
        assert len(database) == int(kept)
        assert (
            any(n.startswith(f"kept the default schedule of {task['name']}") for n in notes) != kept
        )
