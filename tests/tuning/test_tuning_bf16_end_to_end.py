"""Tune a bf16 model in the vdpbf16ps/AMX space, then build with the log in a fresh process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from tolerances import assert_close, tolerance

from tvmamp import models

TARGET = "llvm -num-cores=1"
MODEL = {"batch": 64, "hidden": 256, "layers": 2, "seed": 5}

# Run in a fresh interpreter: nothing from the tuning process can leak into the build.
FRESH_BUILD = os.path.join(os.path.dirname(__file__), "tuning_bf16_fresh_build.py")


@pytest.mark.slow  # 1-3 minutes here: 14 candidates built and timed, then four builds
def test_tuned_bf16_log_applies_in_a_fresh_build(tmp_path):
    from tvmamp.schedules.cpu.bf16_common import has_amx_bf16, has_avx512bf16
    from tvmamp.targets import resolve_target
    from tvmamp.tuning import tune

    host = resolve_target(TARGET)[0]
    if not has_avx512bf16(host):
        pytest.skip("the host CPU has no avx512_bf16: the bf16 GEMM space is not used")
    mod, params = models.simple_net(**MODEL)
    work_dir = tmp_path / "log"
    result = tune(mod, TARGET, "O2", "bfloat16", work_dir, 40, params, progress=False, seed=2)
    gemms = [t for t in result.tasks if t.trials > 0]
    assert len(gemms) == 2 and all("matmul" in t.name for t in gemms)
    # the space has 6 distinct kernels here (six register tiles), 7 with AMX (one AMX blocking
    # as well): each is measured once, and the rest of the 40 trials is not spent on repeats
    size = 7 if has_amx_bf16(host) else 6
    assert [(t.trials, t.done) for t in gemms] == [(size, size), (size, size)]
    manifest = json.loads((work_dir / "tvmamp_manifest.json").read_text())
    (space,) = {t["space"] for t in manifest["tasks"] if t["trials"]}
    assert space.startswith("bf16-gemm:")  # the name carries the version of the choices
    env = dict(os.environ, TVM_NUM_THREADS="1")
    arrays = tmp_path / "result.npz"
    args = [sys.executable, FRESH_BUILD, str(work_dir), TARGET, json.dumps(MODEL), str(arrays)]
    proc = subprocess.run(args, capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    # build(tuning_log=...) scheduled every kernel whose record the log keeps, as the record
    # says; the others are the gemms whose default was timed faster (a note names each)
    kept = [n for n in out["notes"] if n.startswith("kept the default schedule of")]
    assert out["same"] and len(out["built"]) + len(kept) == len(gemms), out
    (coverage,) = [n for n in out["notes"] if n.startswith("tuned schedules from the log for")]
    assert coverage.startswith(f"tuned schedules from the log for {len(out['built'])} of"), out
    assert out["tile_same"] and len(out["tile_built"]) == len(gemms), out  # one record per gemm
    with np.load(arrays) as data:  # bf16 against float64 numpy, elementwise
        for name in ("out", "tile_out"):
            assert_close(data[name], data["ref"], **tolerance("bfloat16"), what=name)
    assert out["asm"] and out["tile_asm"], out
    # weights are packed once, at compile time, whichever record is applied: no weight goes
    # through a packing function at run time, and each kernel gets a constant packed in pairs
    assert out["packing"] == [0, 2] and out["tile_packing"] == [0, 2], out
    # the log keeps a default kernel that was timed faster, so it never slows the build down
    assert out["ratio"] <= 1.25, out
