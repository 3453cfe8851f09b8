"""tvmamp.tune asks the target entry: a target registered from a test steers tuning unchanged."""

import dataclasses

import pytest
from tuning_support import tiny_model

import tvmamp
from tvmamp import targets
from tvmamp.targets import REGISTRY, DesignSpace
from tvmamp.targets import llvm as llvm_target
from tvmamp.tuning import tune
from tvmamp.tuning.intrinsics import register_log_intrinsics
from tvmamp.tuning.logfile import RECORDS
from tvmamp.tuning.tasks import extract_tasks

NOTE = "tuned for the toy target's pretend limits"


@pytest.fixture
def toy():
    """An llvm-based entry whose tuning hooks record their calls."""
    calls = {"design_space": [], "log": []}

    def design_space(mod, target):
        calls["design_space"].append((mod["main"], str(target)))
        return DesignSpace("toy-space", 2)

    entry = dataclasses.replace(
        llvm_target.ENTRY,
        name="toy_tuning",
        tuning_target=lambda target: (target, [NOTE]),
        design_space=design_space,
        register_log_intrinsics=calls["log"].append,
    )
    targets.register_target(entry)
    yield calls
    del REGISTRY["toy_tuning"]


def test_tasks_get_the_design_space_of_the_target_entry(toy):
    mod, params = tiny_model()
    converted = tvmamp.convert(mod, "O2", "toy_tuning -num-cores=1", "float16", params)
    tasks = extract_tasks(converted)
    assert tasks and {(t.space, t.space_size) for t in tasks} == {("toy-space", 2)}
    assert len(toy["design_space"]) == len(tasks)
    assert {target for _, target in toy["design_space"]} == {str(converted.target)}


def test_tune_reports_the_notes_of_the_entrys_tuning_target(toy, tmp_path):
    mod, params = tiny_model()
    result = tune(
        mod, "toy_tuning -num-cores=1", "O2", "float16", tmp_path, 0, params, progress=False
    )
    assert NOTE in result.notes and result.measured and result.new_trials == 0


def test_every_entry_registers_the_intrinsics_its_log_names(toy, tmp_path):
    text = '[0, [[["Tensorize", ["toy_intrinsic"]]]]]\n'
    (tmp_path / RECORDS).write_text(text)
    register_log_intrinsics(str(tmp_path))
    assert toy["log"] == [text]
    register_log_intrinsics(str(tmp_path / "missing"))  # no records: nothing to register
    assert toy["log"] == [text]
