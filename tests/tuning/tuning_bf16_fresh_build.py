"""Build a tuned bf16 SimpleNet in a fresh process (run by test_tuning_bf16_end_to_end.py).

Nothing from the tuning process (registered intrinsics, databases) is present here, so the log's
traces are replayed as a user's build replays them. Besides the log's own build, it builds with
one register-tile record per kernel alone (the vdpbf16ps path), then prints one JSON line:
which kernels each build scheduled from its database (seen by a pass instrument inside the
build, and compared with the records replayed on their own), instructions, where weights are
packed, and the tuned/untuned time ratio. The outputs and the float64 reference are saved to
RESULT (an .npz) for the test to compare elementwise.

Usage: python tuning_bf16_fresh_build.py LOG TARGET MODEL_JSON RESULT
"""

import json
import sys

import numpy as np
import tvm
import tvm_ffi
from tvm import relax, tirx
from tvm.s_tir import meta_schedule as ms

import tvmamp
from tvmamp import models
from tvmamp.benchmark import paired_medians
from tvmamp.executable import Executable
from tvmamp.pipeline import relax_pipeline, run_front_phases
from tvmamp.tuning import load_tuning_log


def scheduled(mod):
    """The kernels of ``mod`` that have a schedule (after MetaScheduleApplyDatabase: tuned)."""
    return {
        gv.name_hint: f
        for gv, f in mod.functions_items()
        if isinstance(f, tirx.PrimFunc) and f.attrs.get("tirx.is_scheduled", False)
    }


@tvm.instrument.pass_instrument
class AppliedKernels:
    """Keeps the kernels that MetaScheduleApplyDatabase scheduled, each time it runs."""

    def __init__(self):
        self.runs = []

    def run_after_pass(self, mod, info):
        if info.name == "MetaScheduleApplyDatabase":
            self.runs.append(scheduled(mod))


def applied(build, converted, database):
    """Run ``build()`` under the instrument: (its result, the kernels it applied from
    ``database``, whether each equals the record replayed on its own)."""
    instrument = AppliedKernels()
    with tvm.transform.PassContext(instruments=[instrument]):
        exe = build()
    (built,) = instrument.runs
    with converted.target, database:
        replayed = scheduled(
            relax.transform.MetaScheduleApplyDatabase()(run_front_phases(converted))
        )
    same = all(tvm_ffi.structural_equal(f, replayed.get(n)) for n, f in built.items())
    return exe, sorted(built), same and sorted(built) == sorted(replayed)


def reference(params, layers, x):
    """SimpleNet in float64 numpy."""
    out = x.astype("float64")
    for i in range(layers):
        w, b = params[f"linear{i}.weight"], params[f"linear{i}.bias"]
        out = out @ w.T.astype("float64") + b
        out = np.maximum(out, 0) if i < layers - 1 else out
    return out


def packing(converted, database):
    """(constants packed at run time, constants already in the [.., 16, 2] pair layout)."""
    with converted.target, database:
        mod = relax.transform.MetaScheduleApplyDatabase()(run_front_phases(converted))
        mod = tvm.transform.Sequential(converted.entry.schedule_passes(converted.target))(mod)
    calls = []

    def visit(e):
        if isinstance(e, relax.Call) and e.op.name == "relax.call_tir":
            calls.append(e)

    relax.analysis.post_order_visit(mod["main"].body, visit)
    packs = [c for c in calls if c.args[0].name_hint.endswith("_prepack")]
    pairs = [a for a in constants(calls) if tuple(a.value.shape[-2:]) == (16, 2)]
    return len(constants(packs)), len(pairs)


def constants(calls):
    args = [a for c in calls for a in c.args[1].fields]
    return [a for a in args if isinstance(a, tvm.ir.expr.Constant)]


def register_tile_records(log):
    """A database with, per kernel, the log's first vdpbf16ps register-tile record alone."""
    raw, tiles = ms.database.JSONDatabase(work_dir=log), ms.database.MemoryDatabase()
    records = raw.get_all_tuning_records()
    for workload in {str(r.workload.as_json()[0]) for r in records}:
        mine = [r for r in records if str(r.workload.as_json()[0]) == workload]
        tile = next(r for r in mine if "dpbf16ps_16x2" in str(r.trace))
        record = ms.database.TuningRecord(
            tile.trace,
            tiles.commit_workload(tile.workload.mod),
            tile.run_secs,
            tile.target,
            tile.args_info,
        )
        tiles.commit_tuning_record(record)
    return tiles


def build_with(converted, database):
    """Compile as tvmamp.build does, with ``database`` applied in phase 3."""
    pipeline = relax_pipeline(converted.target, converted.entry, converted.policy, database)
    with database:
        vm_exec = tvm.compile(
            converted.mod,
            target=converted.target,
            relax_pipeline=pipeline,
            tir_pipeline=converted.entry.tir_pipeline(converted.target),
        )
    c = converted
    return Executable(vm_exec, c.target, c.mod, c.report, c.policy)


def main():
    log, target, model = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    mod, params = models.simple_net(**model)
    x = models.example_inputs(mod)[0]
    converted = tvmamp.convert(mod, "O2", target, "bfloat16", params)
    database, _ = load_tuning_log(log, converted)
    exe, built, same = applied(
        lambda: tvmamp.build(mod, "O2", target, "bfloat16", params, tuning_log=log),
        converted,
        database,
    )
    untuned = tvmamp.build(mod, "O2", target, "bfloat16", params)
    tiles = register_tile_records(log)
    tiled, tile_built, tile_same = applied(lambda: build_with(converted, tiles), converted, tiles)
    tuned_s, untuned_s = paired_medians([lambda: exe(x), lambda: untuned(x)], 25)
    np.savez(sys.argv[4], out=exe(x), tile_out=tiled(x), ref=reference(params, model["layers"], x))
    out = {
        "notes": exe.notes,
        "built": built,
        "same": same,
        "tile_built": tile_built,
        "tile_same": tile_same,
        "asm": [k for k in ("tdpbf16ps", "vdpbf16ps") if k in exe.get_source("asm")],
        "packing": packing(converted, database),
        "tile_asm": "vdpbf16ps" in tiled.get_source("asm"),
        "tile_packing": packing(converted, tiles),
        "ratio": tuned_s / untuned_s,
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
