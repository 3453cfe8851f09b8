"""A readable summary of a tuning log (``tvmamp logs show``)."""

from __future__ import annotations

import json

from . import logfile
from .manifest import read_manifest


def describe_log(path: str) -> str:
    """The log's target, level, dtype and versions, then each kernel's trials and best time.

    Kernels are named from the manifest; a workload the manifest does not name (tuned under
    another model) is shown by its index. A cut-short last line is reported, not hidden.
    """
    manifest = read_manifest(path, "tvmamp logs")
    scan = logfile.scan(path, "tvmamp logs")
    lines = [
        f"tuning log {path}",
        f"  target  {json.dumps(manifest.target)}",
        f"  level   {manifest.level}    dtype {manifest.dtype}",
        f"  tvmamp  {manifest.tvmamp_version}    TVM {manifest.tvm_version}",
        f"  models  {', '.join(manifest.models or [manifest.model_hash])}",
        "",
        _table(manifest, scan),
    ]
    if scan.truncated:
        lines.append(
            f"warning: the last line of {' and '.join(scan.truncated)} is cut short "
            "(a killed run); rerun the same tvmamp tune command to repair it"
        )
    return "\n".join(lines)


def _table(manifest, scan) -> str:
    named = {t.get("workload"): t for t in manifest.tasks}
    rows = [
        f"{'kernel':<40} {'calls':>5} {'trials':>9} {'best ms':>9} {'GFLOP/s':>8} {'default':>8}"
    ]
    total_ms = 0.0
    for index, workload in enumerate(scan.workloads):
        task = named.get(workload, {})
        best = scan.best_secs.get(index)
        budget = task.get("trials")
        trials = f"{scan.trials.get(index, 0)}/{budget if budget is not None else '?'}"
        best_ms = f"{best * 1e3:.4g}" if best is not None else "-"
        flops = task.get("flops", 0.0) / max(task.get("weight", 1), 1)
        speed = f"{flops / best / 1e9:.1f}" if best and flops else "-"
        name = task.get("name", f"workload #{index}")
        default = task.get("default_ms")
        default = f"{default:.4g}" if default is not None else "-"
        calls = task.get("weight", "?")
        rows.append(f"{name:<40} {calls:>5} {trials:>9} {best_ms:>9} {speed:>8} {default:>8}")
        total_ms += (best or 0.0) * 1e3 * task.get("weight", 1)
    untuned = [t["name"] for t in manifest.tasks if t.get("workload") not in scan.workloads]
    rows.append(f"sum of best times x calls: {total_ms:.4g} ms over {len(scan.workloads)} kernels")
    if untuned:
        rows.append(f"no records (default schedules): {', '.join(untuned)}")
    rows.append(
        "default: the untuned schedule's time, measured while tuning; a build keeps it "
        "where it beats the best record"
    )
    return "\n".join(rows)
