"""The CPU feature guard: code built for a CPU this host is not raises a clear error, never SIGILL.

The unrunnable target is chosen from this host's features (``host_cpu_features``), so the tests
hold on any x86 machine: Sapphire Rapids where the host has no AMX, Granite Rapids (amx-fp16)
where it has Sapphire Rapids' AMX. Everything that might execute such code runs in a
subprocess, so a missing guard fails the test instead of killing the pytest run.
"""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

import tvmamp
from tvmamp import models
from tvmamp.targets import resolve_target
from tvmamp.targets.cpu_features import (
    FEATURE_NAMES,
    GUARD_MESSAGE,
    check_cpu_features,
    cpu_level_features,
    cpuinfo_vendor,
    host_cpu_features,
    missing_cpu_features,
    suggest_cpu,
    target_cpu_features,
)
from tvmamp.targets.cpu_guard import (
    GUARD_FUNC,
    CpuFeatureGuard,
    compiled_features,
    feature_mask,
    mask_features,
)

# Newest first; the first with a feature the host lacks is the one the tests cannot run.
CANDIDATES = ("sapphirerapids", "graniterapids", "znver4", "skylake-avx512", "x86-64-v3")


def _host():
    host = host_cpu_features()
    if host is None:
        pytest.skip("no /proc/cpuinfo: this host's CPU features are unknown")
    return host


@pytest.fixture(scope="module")
def unrunnable():
    """(cpu, the features it has that this host lacks)."""
    host = _host()
    for cpu in CANDIDATES:
        missing = [f for f in cpu_level_features(cpu) if f not in host]
        if missing:
            return cpu, missing
    pytest.skip(f"this host has every feature of {', '.join(CANDIDATES)}: nothing to refuse")


def small_net():
    return models.simple_net(batch=4, hidden=64, layers=2)


def expected_message(cpu, missing):
    return GUARD_MESSAGE.format(
        target=f"llvm -mcpu={cpu}",
        missing=", ".join(missing),
        suggest=suggest_cpu(_host(), cpuinfo_vendor()),
    )


@pytest.fixture(scope="module")
def unrunnable_library(unrunnable, tmp_path_factory):
    """The small net built at O2 for the unrunnable CPU and exported (building runs nothing)."""
    cpu, _ = unrunnable
    mod, params = small_net()
    exe = tvmamp.build(mod, level="O2", target=f"llvm -mcpu={cpu}", params=params, dtype="float16")
    path = tmp_path_factory.mktemp("guard") / f"{cpu}.so"
    exe.export_library(str(path))
    x_path = path.with_suffix(".npy")
    np.save(x_path, models.example_inputs(mod)[0])
    return path, x_path


def run_python(code: str, env=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **(env or {})},
    )


def assert_refused(result, message):
    """The process exited normally (no signal) and printed the guard's message."""
    assert result.returncode >= 0, f"killed by signal {-result.returncode}:\n{result.stderr}"
    assert message in result.stdout + result.stderr, result.stdout + result.stderr


# --- which features --------------------------------------------------------------------------


def test_target_features_come_from_mcpu_and_mattr():
    spr = target_cpu_features(tvm.target.Target({"kind": "llvm", "mcpu": "sapphirerapids"}))
    assert {"amx-tile", "amx-bf16", "amx-int8", "avx512fp16", "avx512bf16"} <= set(spr)
    zen4 = target_cpu_features(tvm.target.Target({"kind": "llvm", "mcpu": "znver4"}))
    assert "avx512bf16" in zen4 and not {"amx-bf16", "avx512fp16"} & set(zen4)
    v3 = {"kind": "llvm", "mcpu": "x86-64-v3"}
    assert {"avx2", "fma", "f16c"} <= set(target_cpu_features(tvm.target.Target(v3)))
    assert "avx512f" not in target_cpu_features(tvm.target.Target(v3))
    with_512 = tvm.target.Target({**v3, "mattr": ["+avx512f"]})
    assert "avx512f" in target_cpu_features(with_512)
    assert target_cpu_features(tvm.target.Target({"kind": "llvm", "mcpu": "x86-64"})) == ()


def _mask_any_reduction() -> tvm.IRModule:
    """torch's safe softmax asks whether a row has any key left: ``max(int8(x != -inf))``."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((2, 4, 5, 7), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            kept = relax.op.not_equal(x, relax.const(float("-inf"), "float32"))
            out = bb.emit_output(relax.op.max(relax.op.astype(kept, "int8"), -1, keepdims=True))
        bb.emit_func_output(out)
    return bb.get()


def _llvm_asm(mod: tvm.IRModule, target: dict) -> str:
    """The assembly of ``mod`` compiled by TVM alone (its kernels unscheduled loops, which
    LLVM vectorises itself)."""
    lib = tvm.compile(mod, target=tvm.target.Target(target)).mod
    modules, found = [lib], []
    while modules:
        module = modules.pop()
        modules.extend(module.imports)
        if module.kind == "llvm":
            found.append(module.inspect_source("asm"))
    return "\n".join(found)


def test_amd_only_instructions_are_features_of_the_code():
    """LLVM's znver models shuffle bytes with sse4a's ``insertq``, which no Intel CPU has: a
    torch attention built for znver4 stopped an Emerald Rapids with SIGILL, past a guard that
    did not list sse4a. It is a feature of such code now; ``-mattr=-sse4a`` leaves it out.
    (The kernel that showed it, a bare row maximum of bytes, was an unscheduled loop that LLVM
    vectorised; tvmamp's row-reduction rule schedules it now, so the assembly is TVM's own.)"""
    znver4 = {"kind": "llvm", "mcpu": "znver4", "num-cores": 1}
    portable = {**znver4, "mattr": ["-sse4a"]}
    asm = {
        name: _llvm_asm(_mask_any_reduction(), t)
        for name, t in (("znver4", znver4), ("portable", portable))
    }
    assert "insertq" in asm["znver4"] and "insertq" not in asm["portable"]
    intel = frozenset(cpu_level_features("sapphirerapids"))
    assert missing_cpu_features(target_cpu_features(tvm.target.Target(znver4)), intel) == ("sse4a",)
    assert missing_cpu_features(target_cpu_features(tvm.target.Target(portable)), intel) == ()
    bulldozer = target_cpu_features(tvm.target.Target({"kind": "llvm", "mcpu": "bdver4"}))
    assert {"sse4a", "xop", "fma4", "tbm"} <= set(bulldozer)


def test_the_host_target_needs_nothing_the_host_lacks():
    target, _ = resolve_target("llvm")
    missing = set(target_cpu_features(target)) - _host()
    assert not missing, f"'llvm' resolved to {target.attrs['mcpu']}, which needs {missing}"


def test_mask_round_trips_feature_names():
    names = ["avx2", "amx-bf16", "avx512fp16"]
    assert mask_features(feature_mask(names)) == sorted(names, key=FEATURE_NAMES.index)


# --- the Relax pass --------------------------------------------------------------------------


def test_guard_pass_prepends_the_check_to_public_functions_only():
    @I.ir_module
    class Before:
        @R.function(pure=False)
        def main(x: R.Tensor((4,), "float32")) -> R.Tensor((4,), "float32"):
            R.func_attr({"global_symbol": "main"})
            y = Before.helper(x)
            return y

        @R.function(private=True, pure=False)
        def helper(x: R.Tensor((4,), "float32")) -> R.Tensor((4,), "float32"):
            return x

    mask = feature_mask(["avx2", "fma"])

    @I.ir_module
    class Expected:
        @R.function(pure=False)
        def main(x: R.Tensor((4,), "float32")) -> R.Tensor((4,), "float32"):
            R.func_attr({"global_symbol": "main"})
            _ = R.call_packed(
                GUARD_FUNC, R.prim_value(mask), R.str("llvm -mcpu=t"), ty_args=R.Object
            )
            y = Expected.helper(x)
            return y

        @R.function(private=True, pure=False)
        def helper(x: R.Tensor((4,), "float32")) -> R.Tensor((4,), "float32"):
            return x

    after = CpuFeatureGuard(["avx2", "fma"], "llvm -mcpu=t")(Before)
    tvm.ir.assert_structural_equal(after, Expected)


def test_main_checks_the_cpu_first_and_baseline_code_has_no_guard():
    mod, params = small_net()
    exe = tvmamp.build(mod, level="O1", target="llvm -mcpu=x86-64-v3", params=params)
    functions = [f for f in exe.vm_exec.as_text().split("\n\n") if f.startswith("@main:")]
    first = functions[0].splitlines()[1].split()
    assert first[:2] == ["call", GUARD_FUNC], functions[0]
    plain = tvmamp.build(mod, level="O1", target="llvm -mcpu=x86-64", params=params)
    assert GUARD_FUNC not in plain.vm_exec.as_text()


# --- refused where the host cannot run it ----------------------------------------------------


def test_executable_refuses_in_process_without_sigill(unrunnable):
    """Executable, its vm and a plain relax.VirtualMachine on its vm_exec all raise the message."""
    cpu, missing = unrunnable
    result = run_python(
        f"""
        import numpy as np, tvm, tvmamp
        from tvm import relax
        from tvmamp import models
        mod, params = models.simple_net(batch=4, hidden=64, layers=2)
        exe = tvmamp.build(mod, level="O2", target="llvm -mcpu={cpu}", params=params,
                           dtype="float16")
        x = models.example_inputs(mod)[0]
        for attempt in (lambda: exe(x), lambda: exe.vm,
                        lambda: relax.VirtualMachine(exe.vm_exec, tvm.cpu())["main"](
                            tvm.runtime.tensor(x))):
            try:
                attempt()
                raise SystemExit("ran code the host cannot run")
            except RuntimeError as err:
                print(err)
        """
    )
    assert_refused(result, expected_message(cpu, missing))
    assert result.stdout.count("uses CPU features this machine lacks") == 3, result.stdout


def test_exported_library_refuses_with_only_the_tvm_runtime(unrunnable, unrunnable_library):
    """tvm.runtime.load_module + VirtualMachine, no tvmamp, libtvm_runtime only."""
    cpu, missing = unrunnable
    path, x_path = unrunnable_library
    result = run_python(
        f"""
        import sys
        import numpy as np, tvm.runtime
        from tvm.runtime.vm import VirtualMachine
        vm = VirtualMachine(tvm.runtime.load_module({str(path)!r}), tvm.runtime.cpu())
        try:
            vm["main"](tvm.runtime.tensor(np.load({str(x_path)!r})))
            raise SystemExit("ran code the host cannot run")
        except RuntimeError as err:
            print(err)
        assert not any(m.startswith("tvmamp") for m in sys.modules), "tvmamp was imported"
        assert "tvm.relax" not in sys.modules
        """,
        env={"TVM_USE_RUNTIME_LIB": "1"},
    )
    assert_refused(result, expected_message(cpu, missing))


def test_python_and_c_guards_print_the_same_message(unrunnable, unrunnable_library):
    cpu, missing = unrunnable
    with pytest.raises(RuntimeError) as err:
        check_cpu_features(tvm.target.Target({"kind": "llvm", "mcpu": cpu}))
    assert str(err.value) == expected_message(cpu, missing)
    record = compiled_features(tvm.runtime.load_module(str(unrunnable_library[0])))
    assert record == {"target": f"llvm -mcpu={cpu}", "features": list(cpu_level_features(cpu))}


def test_tvmamp_run_refuses_with_the_message(unrunnable, unrunnable_library):
    cpu, missing = unrunnable
    path, x_path = unrunnable_library
    result = subprocess.run(
        [sys.executable, "-m", "tvmamp", "run", str(path), "--inputs", str(x_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 2, result.stderr
    # the CLI says its own prefix once: "tvmamp run: error: this code was compiled ..."
    message = expected_message(cpu, missing).removeprefix("tvmamp: ")
    assert_refused(result, "tvmamp run: error: " + message)


# --- runs where the host can -----------------------------------------------------------------


@pytest.mark.parametrize("target", ["llvm", "llvm -mcpu=x86-64-v3"])
def test_host_and_subset_builds_run_in_process_and_exported(target, tmp_path):
    mod, params = small_net()
    x = models.example_inputs(mod)[0]
    ref = tvmamp.build(mod, level="O0", target="llvm -mcpu=x86-64", params=params)(x)
    exe = tvmamp.build(mod, level="O2", target=target, params=params, dtype="float16")
    np.testing.assert_allclose(exe(x), ref, rtol=2e-2, atol=2e-2 * np.abs(ref).max())
    path = exe.export_library(str(tmp_path / "model.so"))
    np.save(tmp_path / "x.npy", x)
    result = run_python(
        f"""
        import json, numpy as np, tvm.runtime
        from tvm.runtime.vm import VirtualMachine
        lib = tvm.runtime.load_module({path!r})
        print(lib.get_function("tvmamp_compiled_cpu_features", query_imports=True)())
        x = tvm.runtime.tensor(np.load({str(tmp_path / "x.npy")!r}))
        y = VirtualMachine(lib, tvm.runtime.cpu())["main"](x).numpy()
        np.save({str(tmp_path / "y.npy")!r}, y)
        """,
        env={"TVM_USE_RUNTIME_LIB": "1"},
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["features"] == list(target_cpu_features(exe.target))
    np.testing.assert_array_equal(np.load(tmp_path / "y.npy"), exe(x))
