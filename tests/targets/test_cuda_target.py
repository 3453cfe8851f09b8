"""The CUDA target entry: arch names, the local GPU, its phases and a deployable library."""

import pytest
import tvm

import tvmamp
from tvmamp import models
from tvmamp.targets import cuda, resolve_target


@pytest.mark.parametrize(
    "spec,cc",
    [
        ("cuda -arch=sm_70", 70),
        ("cuda -arch=sm_80", 80),
        ("cuda -arch=sm_90", 90),
        ("nvidia/a100", 80),
        ("nvidia/h100", 90),  # sm_90a
        ("nvidia/v100", 70),
    ],
)
def test_compute_capability_of_arch_strings_and_named_gpus(spec, cc):
    target, entry = resolve_target(spec)
    assert entry is cuda.ENTRY and cuda.compute_capability(target) == cc


class FakeDevice:
    exist = True
    compute_version = "8.6"


def test_plain_cuda_uses_the_local_gpu_arch(monkeypatch):
    monkeypatch.setattr(tvm, "cuda", lambda index=0: FakeDevice())
    assert resolve_target("cuda")[0].attrs["arch"] == "sm_86"
    assert resolve_target("cuda -arch=sm_90")[0].attrs["arch"] == "sm_90"


def test_plain_cuda_without_a_gpu_targets_sm_80(monkeypatch):
    monkeypatch.setattr(tvm, "cuda", lambda index=0: type("NoDevice", (), {"exist": False})())
    assert resolve_target("cuda")[0].attrs["arch"] == "sm_80"


def test_bf16_below_sm_80_is_an_error_naming_the_arch():
    mod, params = models.simple_net(batch=16, hidden=32, layers=2)
    with pytest.raises(ValueError, match="bfloat16 needs compute capability 8.0.*sm_75"):
        tvmamp.build(mod, "O2", "cuda -arch=sm_75", "bfloat16", params=params)


def test_paddle_warning_below_sm_70():
    mod, params = models.simple_net(batch=16, hidden=32, layers=2)
    message = "AMP only support NVIDIA GPU with Compute Capability 7.0 or higher, current GPU is"
    with pytest.warns(UserWarning, match=message):
        tvmamp.convert(mod, "O2", "cuda -arch=sm_61", "float16", params=params)


@pytest.mark.parametrize("arch,async_copy", [("sm_75", False), ("sm_80", True), ("sm_90a", True)])
def test_pass_config_turns_on_cp_async_from_sm_80(arch, async_copy):
    target = resolve_target(f"cuda -arch={arch}")[0]
    assert cuda.pass_config(target) == {"tirx.use_async_copy": async_copy}


def test_export_library_writes_a_shared_object_with_the_tensor_core_kernels(tmp_path):
    """The .so is what a CUDA machine loads (``tvm.runtime.load_module``); here it is only
    written and read back as bytes, since loading it needs TVM's CUDA runtime and a GPU."""
    mod, params = models.simple_net(batch=32, hidden=64, layers=2)
    exe = tvmamp.build(mod, "O2", "nvidia/a100", "bfloat16", params=params)
    path = exe.export_library(str(tmp_path / "model.so"))
    blob = open(path, "rb").read()
    assert blob[:4] == b"\x7fELF"
    assert b"mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in blob


def test_build_applies_the_entrys_pass_config_for_cp_async():
    import tvmamp
    from tvmamp import models

    mod, params = models.simple_net(batch=64, hidden=128, layers=1)
    exe = tvmamp.build(mod, "O2", "cuda -arch=sm_80", dtype="float16", params=params)
    assert "cp.async" in exe.get_source("ptx")
