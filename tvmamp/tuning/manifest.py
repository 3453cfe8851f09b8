"""The manifest of a tuning log: what the log was tuned for, checked before it is applied."""

from __future__ import annotations

import dataclasses
import json
import os
import time

import tvm
import tvm_ffi

FILENAME = "tvmamp_manifest.json"
FORMAT = "tvmamp-tuning-log/1"
# Target keys that say how a kernel runs, not which hardware it is for: a log tuned with another
# thread count still holds correct kernels, so a difference there is a note, not a refusal.
SOFT_TARGET_KEYS = ("num-cores",)


@dataclasses.dataclass
class Manifest:
    """What a tuning log was made for (written next to the meta_schedule database files)."""

    tvmamp_version: str
    tvm_version: str
    target: dict
    level: str
    dtype: str
    model_hash: str
    models: list = dataclasses.field(default_factory=list)
    trials: int = 0
    tasks: list = dataclasses.field(default_factory=list)
    created: str = ""
    format: str = FORMAT


def target_json(target: tvm.target.Target) -> dict:
    """The target as the JSON dict TVM 0.27 builds targets from."""
    return json.loads(str(target))


def model_hash(mod: tvm.IRModule) -> str:
    """TVM's structural hash of the converted module (constants included), as 16 hex digits."""
    return f"{tvm_ffi.structural_hash(mod) & (2**64 - 1):016x}"


def make_manifest(converted, tasks, trials: int) -> Manifest:
    """The manifest for tuning ``converted`` (a ``tvmamp.Converted``)."""
    import tvmamp

    digest = model_hash(converted.mod)
    return Manifest(
        tvmamp_version=tvmamp.__version__,
        tvm_version=tvm.__version__,
        target=target_json(converted.target),
        level=converted.policy.level,
        dtype=converted.policy.low_dtype,
        model_hash=digest,
        models=[digest],
        trials=trials,
        tasks=[_task_entry(t) for t in tasks],
        created=time.strftime("%Y-%m-%dT%H:%M:%S"),
    )


def _task_entry(task) -> dict:
    return {
        "name": task.name,
        "workload": task.workload,
        "weight": task.weight,
        "flops": task.flops,
        "trials": task.trials,
        "space": task.space,
    }


def write_manifest(work_dir: str, manifest: Manifest) -> None:
    """Write the manifest atomically (a killed run never leaves half a manifest)."""
    path = os.path.join(work_dir, FILENAME)
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(dataclasses.asdict(manifest), f, indent=1)
    os.replace(path + ".tmp", path)


def read_manifest(work_dir: str, component: str = "tvmamp") -> Manifest:
    """Read and check a log's manifest; a missing or malformed one is a clear error."""
    path = os.path.join(work_dir, FILENAME)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{component}: tuning log {work_dir!r} has no {FILENAME}; "
            "it was not written by tvmamp.tune (create one with tvmamp.tune(..., work_dir=...))"
        )
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        fields = {f.name for f in dataclasses.fields(Manifest)}
        manifest = Manifest(**{k: v for k, v in data.items() if k in fields})
    except (json.JSONDecodeError, TypeError, AttributeError, UnicodeDecodeError) as err:
        raise ValueError(f"{component}: {path} is corrupt or truncated ({err})") from None
    if manifest.format != FORMAT or not isinstance(manifest.target, dict):
        raise ValueError(
            f"{component}: {path} has format {manifest.format!r}; this tvmamp reads {FORMAT!r}"
        )
    return manifest


def compare(manifest: Manifest, converted) -> tuple[list[str], list[str]]:
    """``(mismatches, notes)`` of a log's manifest against the build of ``converted``.

    Mismatches (another target, level or dtype) make the log unsafe to apply without an
    override; notes (another thread count, another model, another TVM) are only reported.
    """
    want = target_json(converted.target)
    hard = {k: v for k, v in want.items() if k not in SOFT_TARGET_KEYS}
    have = {k: v for k, v in manifest.target.items() if k not in SOFT_TARGET_KEYS}
    mismatches = []
    if hard != have:
        mismatches.append(f"target: log {json.dumps(manifest.target)}, build {json.dumps(want)}")
    for name, logged, built in (
        ("level", manifest.level, converted.policy.level),
        ("dtype", manifest.dtype, converted.policy.low_dtype),
    ):
        if logged != built:
            mismatches.append(f"{name}: log {logged!r}, build {built!r}")
    return mismatches, _notes(manifest, converted, want)


def _notes(manifest: Manifest, converted, want: dict) -> list[str]:
    notes = []
    for key in SOFT_TARGET_KEYS:
        if manifest.target.get(key) != want.get(key):
            notes.append(
                f"the log was tuned with {key}={manifest.target.get(key)}, this build uses "
                f"{key}={want.get(key)}: its kernels are correct but were timed differently"
            )
    if model_hash(converted.mod) not in (manifest.models or [manifest.model_hash]):
        notes.append("the log was tuned for another model: only kernels they share are applied")
    if manifest.tvm_version != tvm.__version__:
        notes.append(f"the log was made with TVM {manifest.tvm_version}, this is {tvm.__version__}")
    return notes
