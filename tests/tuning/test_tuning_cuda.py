"""CUDA without a GPU: candidates are generated and built, nothing is timed or recorded."""

import pytest
import tvm
from tuning_support import tiny_model

from tvmamp.targets import resolve_target
from tvmamp.tuning import tune
from tvmamp.tuning.intrinsics import families_for
from tvmamp.tuning.tasks import tuning_target


def test_only_the_target_family_of_intrinsics_is_loaded():
    assert families_for(resolve_target("llvm")[0]) == ("x86",)
    assert families_for(resolve_target("cuda -arch=sm_80")[0]) == ("cuda",)
    assert families_for(resolve_target("cuda -arch=sm_70")[0]) == ()


def test_cuda_tuning_target_gets_the_gpu_limits_meta_schedule_needs():
    target, notes = tuning_target(resolve_target("cuda -arch=sm_80")[0])
    assert target.attrs["max_threads_per_block"] == 1024
    assert target.attrs["max_shared_memory_per_block"] == 49152
    assert "nvidia/a100" in notes[0]
    named, notes = tuning_target(resolve_target("nvidia/a100")[0])
    assert notes == [] and named.attrs["max_shared_memory_per_block"] == 49152


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
