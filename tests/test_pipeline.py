"""The pipeline: one lowering per build, the same program as one pass, instrumentation hooks."""

import collections
import re

import numpy as np
import pytest
import tvm

import tvmamp
from tvmamp import models
from tvmamp.executable import Executable
from tvmamp.pipeline import (
    add_instrumentation_hook,
    compile_converted,
    instrumentation_hooks,
    relax_pipeline,
    remove_instrumentation_hook,
)

TARGET = "llvm -num-cores=1"


@tvm.instrument.pass_instrument
class PassCounter:
    """Counts how often each pass runs under the PassContext it is installed in."""

    def __init__(self):
        self.runs = collections.Counter()

    def run_before_pass(self, _mod, info):
        self.runs[info.name] += 1


def _model():
    return models.simple_net(batch=16, hidden=64, layers=1, seed=3)


@pytest.fixture(scope="module")
def tuned_log(tmp_path_factory):
    mod, params = _model()
    work_dir = tmp_path_factory.mktemp("pipeline") / "log"
    tvmamp.tune(mod, TARGET, "O2", "bfloat16", work_dir, 4, params, progress=False, seed=1)
    return work_dir


def test_a_build_with_a_tuning_log_lowers_the_model_once(tuned_log):
    """The log's coverage check sees the module the pipeline goes on compiling."""
    mod, params = _model()
    counter = PassCounter()
    with tvm.transform.PassContext(instruments=[counter]):
        exe = tvmamp.build(mod, "O2", TARGET, "bfloat16", params, tuning_log=tuned_log)
    assert counter.runs["LegalizeOps"] == 1
    assert counter.runs["FuseTIR"] == 1
    assert any(n.startswith("tuned schedules from the log for") for n in exe.notes), exe.notes


def test_check_kernels_gets_the_lowered_module_and_gives_the_notes():
    mod, params = _model()
    converted = tvmamp.convert(mod, "O2", TARGET, "bfloat16", params)
    seen = []

    def check(lowered):
        seen.append(lowered)
        return ["checked"]

    exe = compile_converted(converted, check_kernels=check)
    (lowered,) = seen
    prim_funcs = [gv for gv, f in lowered.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    assert any("matmul" in gv.name_hint for gv in prim_funcs), prim_funcs
    assert exe.notes == ["checked"]


def test_compile_converted_is_the_whole_pipeline_as_one_pass():
    """Lowering phases 1-2 first, then 3-5, compiles the same VM program as all five at once."""
    mod, params = _model()
    converted = tvmamp.convert(mod, "O2", TARGET, "bfloat16", params)
    exe = compile_converted(converted)
    whole = relax_pipeline(converted.target, converted.entry, converted.policy)
    vm_exec = tvm.compile(
        converted.mod,
        target=converted.target,
        relax_pipeline=whole,
        tir_pipeline=converted.entry.tir_pipeline(converted.target),
    )
    assert exe.vm_exec.as_text() == vm_exec.as_text()
    at_once = Executable(vm_exec, converted.target, converted.mod, None, converted.policy)
    assert _llvm_ir(exe) == _llvm_ir(at_once)


def _llvm_ir(exe) -> str:
    """The generated LLVM IR, with the object addresses LLVM writes in TBAA names blanked."""
    return re.sub(r"0x[0-9a-f]+", "0x_", exe.get_source("ll"))


def test_instrumentation_hooks_rewrite_only_while_registered(rng):
    mod, params = _model()
    converted = tvmamp.convert(mod, "O1", TARGET, "bfloat16", params)
    calls = []

    def hook(c):
        calls.append(c.policy.level)
        return c.mod

    add_instrumentation_hook(hook)
    add_instrumentation_hook(hook)  # registered once
    try:
        assert instrumentation_hooks() == (hook,)
        exe = compile_converted(converted)
    finally:
        remove_instrumentation_hook(hook)
    assert instrumentation_hooks() == ()
    compile_converted(converted)
    assert calls == ["O1"]
    x = rng.standard_normal((16, 64)).astype("float32")
    np.testing.assert_array_equal(exe(x), compile_converted(converted)(x))
