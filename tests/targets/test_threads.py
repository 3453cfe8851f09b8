"""The default thread count: every physical core, unless the user set one."""

from __future__ import annotations

import os
import subprocess
import sys

from tvmamp.targets.cpu_features import physical_cores

PRINT_THREADS = (
    "import os, tvmamp, tvm; "
    "from tvmamp.targets import resolve_target; "
    "print(os.environ.get('TVM_NUM_THREADS', '-'), resolve_target('llvm')[0].attrs['num-cores'])"
)


def _threads(**env) -> list[str]:
    clean = {k: v for k, v in os.environ.items() if k not in ("TVM_NUM_THREADS", "OMP_NUM_THREADS")}
    out = subprocess.run(
        [sys.executable, "-c", PRINT_THREADS],
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return out.stdout.split()


def test_physical_cores_is_within_the_logical_cpus():
    allowed = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert 1 <= physical_cores() <= allowed


def test_unset_means_every_physical_core_for_runtime_and_target():
    """TVM alone would take half the logical CPUs on x86 (one of this VM's two cores)."""
    cores = str(physical_cores())
    assert _threads() == [cores, cores]


def test_a_thread_count_the_user_set_is_kept():
    assert _threads(TVM_NUM_THREADS="1") == ["1", "1"]
    assert _threads(OMP_NUM_THREADS="3") == ["-", "3"]  # the runtime reads OMP_NUM_THREADS
