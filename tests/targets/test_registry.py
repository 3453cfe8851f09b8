"""The target registry: aliases, an entry's defaults, and what the executable takes from it."""

import dataclasses

import pytest
import tvm

import tvmamp
from tvmamp import models, targets
from tvmamp.executable import Executable
from tvmamp.targets import (
    DEFAULT_SPACE,
    REGISTRY,
    TARGET_ALIASES,
    SourceFormat,
    TargetEntry,
    resolve_target,
)
from tvmamp.targets import llvm as llvm_target
from tvmamp.targets.registry import LLVM_SOURCES


@pytest.mark.parametrize(("alias", "kind"), sorted(TARGET_ALIASES.items()))
def test_target_aliases_name_registered_entries(alias, kind):
    target, entry = resolve_target(alias)
    assert entry is REGISTRY[kind] and target.kind.name == kind


def test_an_entry_without_tuning_hooks_gets_neutral_defaults():
    entry = TargetEntry(
        name="minimal",
        make_target=lambda options: tvm.target.Target({"kind": "llvm", "num-cores": 1}),
        default_dtype=lambda target: "float16",
        check=lambda target, dtype: None,
        schedule_passes=lambda target: [],
    )
    target = entry.make_target({})
    assert entry.tuning_target(target) == (target, [])
    assert entry.intrinsic_families(target) is None  # all of TVM's intrinsics
    assert entry.design_space(None, target) is DEFAULT_SPACE
    assert entry.register_log_intrinsics("any text") is None
    assert dict(entry.source_formats) == LLVM_SOURCES
    assert entry.device(target) == tvm.cpu(0)


def test_llvm_and_cuda_entries_carry_their_tuning_knowledge():
    cpu, llvm = resolve_target("llvm -num-cores=1")
    assert llvm.intrinsic_families(cpu) == ("x86",)
    arm = tvm.target.Target({"kind": "llvm", "mtriple": "aarch64-linux-gnu"})
    assert llvm.intrinsic_families(arm) == ("arm_cpu",)
    gpu, cuda = resolve_target("cuda -arch=sm_80")
    assert set(cuda.source_formats) == {"asm", "ll", "cuda", "ptx"}
    assert set(llvm.source_formats) == {"asm", "ll"}
    assert cuda.device(gpu).dlpack_device_type() == tvm.cuda(0).dlpack_device_type()


@pytest.fixture
def shouting():
    """An llvm-based entry with one extra source format: the assembly in capitals."""
    formats = {**LLVM_SOURCES, "shout": SourceFormat("llvm", "asm", lambda t, text: text.upper())}
    entry = dataclasses.replace(llvm_target.ENTRY, name="shouting", source_formats=formats)
    targets.register_target(entry)
    yield entry
    del REGISTRY["shouting"]


def test_get_source_reads_the_formats_of_the_executables_entry(shouting):
    mod, params = models.simple_net(batch=4, hidden=16, layers=1)
    exe = tvmamp.build(mod, "O0", "llvm -num-cores=1", params=params)
    with pytest.raises(ValueError, match="this executable has no llvm module to show as shout"):
        exe.get_source("shout")  # the llvm entry has no such format
    mine = Executable(exe.vm_exec, exe.target, exe.mod, exe.stats, exe.policy, entry=shouting)
    assert mine.get_source("shout") == exe.get_source("asm").upper()
    with pytest.raises(ValueError, match="'sass' is not one of asm, ll, cuda, ptx, shout"):
        mine.get_source("sass")


@pytest.mark.parametrize(
    "target, message",
    [
        ("llvm -mcpu=notacpu", r"does not know the CPU mcpu='notacpu' \(x86 examples"),
        ("llvm -mcpu=znver", r"did you mean znver\d"),
    ],
)
def test_an_unknown_cpu_is_refused(target, message):
    """LLVM only warns about an unknown mcpu and compiles for a generic CPU (so the default
    dtype silently became float16); tvmamp refuses it and names close CPU names."""
    with pytest.raises(ValueError, match=message):
        resolve_target(target)


def test_known_cpus_resolve():
    for cpu in ("znver4", "sapphirerapids", "skylake-avx512", "x86-64-v3"):
        assert str(resolve_target(f"llvm -mcpu={cpu}")[0].attrs["mcpu"]) == cpu
