"""Register the tvmamp tensor intrinsics a tuning log names, before TVM replays its traces."""

from __future__ import annotations

import os

from tvmamp.targets import REGISTRY

from . import logfile


def register_log_intrinsics(work_dir: str) -> None:
    """Register the tvmamp tensor intrinsics that the traces of a tuning log name.

    TVM replays every trace when it opens a log (and again when it applies one); a tensorize
    step whose intrinsic is not registered in this process would fail. tvmamp's kernels
    register theirs lazily, so a fresh process must do it before opening the log: each target
    entry registers those of its own that the records name.
    """
    path = os.path.join(work_dir, logfile.RECORDS)
    if not os.path.isfile(path):
        return
    with open(path, encoding="utf-8", errors="replace") as f:
        text = f.read()
    for hook in dict.fromkeys(e.register_log_intrinsics for e in REGISTRY.values()):
        hook(text)
