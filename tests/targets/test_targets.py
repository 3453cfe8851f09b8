"""Target strings, dicts and Target objects resolve to TVM 0.27 targets and their entries."""

import pytest
import tvm

from tvmamp.targets import REGISTRY, resolve_target
from tvmamp.targets.llvm import host_cpu


def test_llvm_strings_become_dicts_with_a_resolved_cpu():
    target, entry = resolve_target("llvm")
    assert entry.name == "llvm" and target.attrs["mcpu"] == host_cpu() != "native"
    target, _ = resolve_target("llvm -mcpu=znver4 -num-cores=1")
    assert target.attrs["mcpu"] == "znver4" and int(target.attrs["num-cores"]) == 1


def test_llvm_dicts_resolve_like_strings():
    """Before, a dict without ``mcpu`` compiled for LLVM's generic CPU: no AVX-512, no bf16
    kernels (a TransformerEncoderLayer at O2 took 12x torch's time instead of 0.9x)."""
    target, entry = resolve_target({"kind": "llvm", "num-cores": 1})
    assert entry.name == "llvm" and target.attrs["mcpu"] == host_cpu()
    assert int(target.attrs["num-cores"]) == 1
    target, _ = resolve_target({"kind": "llvm", "mcpu": "znver4", "mattr": ["-avx512bf16"]})
    assert target.attrs["mcpu"] == "znver4" and list(target.attrs["mattr"]) == ["-avx512bf16"]
    with pytest.raises(ValueError, match="does not know the CPU mcpu='znver9'"):
        resolve_target({"kind": "llvm", "mcpu": "znver9"})


@pytest.mark.parametrize(
    "spec", ["llvm -mtriple=aarch64-linux-gnu", {"kind": "llvm", "mtriple": "aarch64-linux-gnu"}]
)
def test_a_cross_triple_gets_its_own_generic_cpu_not_the_hosts(spec):
    """Before, the host's mcpu (znver5) was put beside an aarch64 triple, and the build was
    refused with "LLVM does not know the CPU mcpu='znver5'", a CPU the user never named."""
    target, _ = resolve_target(spec)
    assert "mcpu" not in target.attrs and target.attrs["mtriple"] == "aarch64-linux-gnu"


def test_host_cpu_has_the_hosts_vector_features():
    flags = open("/proc/cpuinfo").read()
    cpu = tvm.target.Target({"kind": "llvm", "mcpu": host_cpu()})
    has = tvm.target.codegen.llvm_cpu_has_features
    if " avx512_bf16" in flags:
        assert has(["avx512bf16"], cpu)
    if " avx2" in flags:
        assert has(["avx2"], cpu)


_NO_AMX = {"amx-bf16", "amx-tile", "amx-int8", "amx-fp16", "amx-complex"}


@pytest.mark.parametrize(
    "system,vendor,hidden,expected",
    [
        # an Intel Xeon whose hypervisor hides AMX: before, znver5 (an AMD model)
        ("emeraldrapids", "GenuineIntel", _NO_AMX, "cooperlake"),
        ("sapphirerapids", "GenuineIntel", _NO_AMX, "cooperlake"),
        ("sapphirerapids", "GenuineIntel", set(), "sapphirerapids"),
        ("znver5", "AuthenticAMD", set(), "znver5"),
        ("znver4", "AuthenticAMD", {"avx512bf16"}, "znver3"),
    ],
)
def test_host_cpu_is_a_model_of_the_hosts_vendor(monkeypatch, system, vendor, hidden, expected):
    from tvmamp.targets import llvm
    from tvmamp.targets.cpu_features import cpu_level_features

    host = frozenset(cpu_level_features(system)) - set(hidden)
    monkeypatch.setattr(llvm, "host_cpu_features", lambda: host)
    monkeypatch.setattr(llvm, "cpuinfo_vendor", lambda: vendor, raising=False)
    monkeypatch.setattr(llvm.codegen, "llvm_get_system_cpu", lambda: system)
    host_cpu.cache_clear()
    try:
        assert host_cpu() == expected
    finally:
        host_cpu.cache_clear()  # the real host's, for the tests after this one


def test_the_rebuild_suggestion_is_a_model_of_the_hosts_vendor():
    from tvmamp.targets.cpu_features import cpu_level_features, suggest_cpu

    intel = frozenset(cpu_level_features("emeraldrapids")) - _NO_AMX
    assert suggest_cpu(intel, "GenuineIntel") == "cooperlake"
    assert suggest_cpu(frozenset(cpu_level_features("znver4")), "AuthenticAMD") == "znver4"
    # vendor unknown: the newest model that fits; znver5 needs AMD's sse4a, which Intel lacks
    assert suggest_cpu(intel) == "cooperlake"


@pytest.mark.parametrize(
    "spec,arch",
    [
        ("cuda -arch=sm_80", "sm_80"),
        ("cuda -arch=sm_90", "sm_90"),
        ("nvidia/a100", "sm_80"),
        ("nvidia/h100", "sm_90a"),
        ({"kind": "cuda", "arch": "sm_75"}, "sm_75"),
    ],
)
def test_cuda_targets(spec, arch):
    target, entry = resolve_target(spec)
    assert entry.name == "cuda" and target.attrs["arch"] == arch


def test_target_objects_and_json_text_pass_through():
    target = tvm.target.Target({"kind": "llvm", "mcpu": "haswell"})
    assert resolve_target(target)[0] is target
    assert resolve_target('{"kind": "llvm", "mcpu": "haswell"}')[0].attrs["mcpu"] == "haswell"


@pytest.mark.parametrize(
    "spec,message",
    [
        ("tpu", "unknown target 'tpu'"),
        ("llvn", "did you mean llvm"),
        ("cuda -arch=80", "is not of the form sm_XY"),
        ("nvidia/b999", "unknown GPU 'nvidia/b999'"),
        ("llvm mcpu", "must look like -key=value"),
        ({"mcpu": "x"}, "has no 'kind'"),
        ("{bad json", "is not valid JSON"),
    ],
)
def test_bad_targets(spec, message):
    with pytest.raises(ValueError, match=message):
        resolve_target(spec)
    with pytest.raises(TypeError, match="target must be"):
        resolve_target(42)


def test_registry_has_one_entry_per_kind():
    assert {"llvm", "cuda"} <= set(REGISTRY)


def test_an_amd_guest_without_sse4a_keeps_its_model(monkeypatch):
    """A hypervisor may hide AMD's sse4a from a Zen 4 guest. Since the guard counts sse4a
    (LLVM's znver models emit insertq), such a host fell to x86-64-v3 (no AVX-512, no bf16);
    it keeps znver4 with sse4a turned off, and that code needs nothing the host lacks."""
    from tvmamp.targets import llvm
    from tvmamp.targets.cpu_features import cpu_level_features, target_cpu_features

    host = frozenset(cpu_level_features("znver4")) - {"sse4a"}
    monkeypatch.setattr(llvm, "host_cpu_features", lambda: host)
    monkeypatch.setattr(llvm, "cpuinfo_vendor", lambda: "AuthenticAMD", raising=False)
    monkeypatch.setattr(llvm.codegen, "llvm_get_system_cpu", lambda: "znver4")
    host_cpu.cache_clear()
    try:
        assert host_cpu() == "znver4"
        target = llvm.make_target({"num-cores": 1})
        assert list(target.attrs["mattr"]) == ["-sse4a"]
        assert set(target_cpu_features(target)) <= host
        given = llvm.make_target({"num-cores": 1, "mattr": "+avx512bf16"})
        assert list(given.attrs["mattr"]) == ["+avx512bf16", "-sse4a"]
    finally:
        host_cpu.cache_clear()
