"""Tune a tiny model, then build with the log in a fresh process: every record applies."""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
from tolerances import assert_close, tolerance
from tuning_support import DTYPE, LEVEL, TARGET, TRIALS

# Runs in a fresh interpreter: nothing from the tuning process (databases, registered
# intrinsics, caches) can leak into the build. It builds with tuning_log= under a pass
# instrument that keeps the kernels MetaScheduleApplyDatabase scheduled inside that build, and
# checks each against the log's record replayed on its own (structural equality).
FRESH_BUILD = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    import tvm
    import tvm_ffi
    from tvm import relax, tirx
    import tvmamp
    from tvmamp import models
    from tvmamp.tuning import load_tuning_log
    from tvmamp.pipeline import run_front_phases

    def scheduled(mod):
        return {gv.name_hint: f for gv, f in mod.functions_items()
                if isinstance(f, tirx.PrimFunc) and f.attrs.get("tirx.is_scheduled", False)}

    @tvm.instrument.pass_instrument
    class AppliedKernels:
        def __init__(self):
            self.runs = []
        def run_after_pass(self, mod, info):
            if info.name == "MetaScheduleApplyDatabase":
                self.runs.append(scheduled(mod))

    log, target, level, dtype, result = sys.argv[1:6]
    mod, params = models.simple_net(batch=16, hidden=64, layers=1, seed=3)
    converted = tvmamp.convert(mod, level, target, dtype, params)
    database, notes = load_tuning_log(log, converted)
    with converted.target, database:
        replayed = scheduled(
            relax.transform.MetaScheduleApplyDatabase()(run_front_phases(converted))
        )
    instrument = AppliedKernels()
    with tvm.transform.PassContext(instruments=[instrument]):
        exe = tvmamp.build(mod, level, target, dtype, params, tuning_log=log)
    (built,) = instrument.runs  # the database was applied once, in this build
    same = {name: tvm_ffi.structural_equal(f, replayed.get(name)) for name, f in built.items()}
    x = np.random.default_rng(7).standard_normal((16, 64)).astype("float32")
    w, b = params["linear0.weight"].astype("float64"), params["linear0.bias"].astype("float64")
    np.savez(result, out=exe(x), ref=x.astype("float64") @ w.T + b)
    print(json.dumps({"replayed": sorted(replayed), "built": sorted(built), "same": same,
                      "notes": notes, "exe_notes": exe.notes}))
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


def test_fresh_process_build_applies_every_record(tuned_log, log_to_apply, tmp_path):
    work_dir, result = log_to_apply, tuned_log[1]
    env = dict(os.environ, TVM_NUM_THREADS="1")
    arrays = tmp_path / "result.npz"
    args = [sys.executable, "-c", FRESH_BUILD, str(work_dir), TARGET, LEVEL, DTYPE, str(arrays)]
    proc = subprocess.run(args, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    logged = sorted(t.name for t in result.tasks if t.done > 0)
    assert out["replayed"] == logged  # every kernel with a record has a tuned schedule
    # build(tuning_log=...) itself scheduled exactly those kernels, each as its record says
    assert out["built"] == logged and all(out["same"].values()), out
    coverage = f"tuned schedules from the log for 1 of {len(result.tasks)} kernels"
    assert out["exe_notes"][0] == coverage and out["exe_notes"] == out["notes"]
    with np.load(arrays) as data:  # bf16 against float64 numpy, elementwise
        assert_close(data["out"], data["ref"], **tolerance("bfloat16"), what="tuned build")


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
