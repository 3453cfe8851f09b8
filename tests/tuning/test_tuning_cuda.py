"""CUDA without a GPU: candidates are generated and built, nothing is timed or recorded."""

import pytest
import tvm
from tuning_support import tiny_model

from tvmamp.targets import resolve_target
from tvmamp.tuning import tune


def _families(spec):
    target, entry = resolve_target(spec)
    return entry.intrinsic_families(target)


def _tuning_target(spec):
    target, entry = resolve_target(spec)
    return entry.tuning_target(target)


def test_only_the_target_family_of_intrinsics_is_loaded():
    assert _families("llvm") == ("x86",)
    assert _families("npu") == ("x86",)  # host code: the llvm entry's family
    assert _families("cuda -arch=sm_80") == ("cuda",)
    assert _families("cuda -arch=sm_70") == ()


def test_cuda_tuning_target_gets_the_gpu_limits_meta_schedule_needs():
    target, notes = _tuning_target("cuda -arch=sm_80")
    assert target.attrs["max_threads_per_block"] == 1024
    assert target.attrs["max_shared_memory_per_block"] == 49152
    assert "nvidia/a100" in notes[0]
    named, notes = _tuning_target("nvidia/a100")
    assert notes == [] and named.attrs["max_shared_memory_per_block"] == 49152
    cpu, entry = resolve_target("llvm")
    assert entry.tuning_target(cpu) == (cpu, [])  # CPUs: the target as it is


@pytest.mark.slow
def test_cuda_without_gpu_builds_candidates_and_records_nothing(tmp_path):
    if tvm.cuda(0).exist:
        pytest.skip("a local GPU would measure for real")
    mod, params = tiny_model()
    work_dir = tmp_path / "log"
    result = tune(mod, "cuda -arch=sm_70", "O2", "float16", work_dir, 4, params, progress=False)
    assert not result.measured and result.new_trials == 0
    assert result.notes[1].endswith("built 4 of 4 candidates (not timed)")
    assert result.notes[-1].startswith("measuring needs a device: there is no local cuda device")
    assert not work_dir.exists()  # no log, so no log with made-up timings
