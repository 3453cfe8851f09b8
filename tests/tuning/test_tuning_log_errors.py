"""Corrupt, truncated and mismatched tuning logs are refused with clear errors."""

import json
import re

import pytest
from tuning_support import DTYPE, LEVEL, TARGET, tiny_model

import tvmamp
from tvmamp.tuning import load_tuning_log

RECORDS = "database_tuning_record.json"


def _convert(level=LEVEL, target=TARGET, dtype=DTYPE):
    mod, params = tiny_model()
    return tvmamp.convert(mod, level, target, dtype, params)


def test_good_log_loads_and_names_untuned_kernels(log_to_apply, converted):
    database, notes = load_tuning_log(log_to_apply, converted)
    assert len(database) == 1  # the best record of the one tuned kernel, in memory
    assert notes[0] == "tuned schedules from the log for 1 of 2 kernels"
    assert re.fullmatch(r"no record for cast\d*: default schedules used", notes[1])


def test_truncated_record_file_is_refused(log_to_apply, converted):
    path = log_to_apply / RECORDS
    path.write_bytes(path.read_bytes()[:-40])  # a run killed in the middle of a line
    with pytest.raises(ValueError, match="truncated.*database_tuning_record.json.*Rerun"):
        load_tuning_log(log_to_apply, converted)


def test_garbage_line_is_refused_with_its_number(log_to_apply, converted):
    path = log_to_apply / RECORDS
    lines = path.read_text().splitlines(keepends=True)
    lines[1] = "{not json\n"
    path.write_text("".join(lines))
    with pytest.raises(ValueError, match="corrupt: database_tuning_record.json line 2"):
        load_tuning_log(log_to_apply, converted)


def test_record_naming_a_missing_workload_is_refused(log_to_apply, converted):
    path = log_to_apply / RECORDS
    record = json.loads(path.read_text().splitlines()[0])
    path.write_text(path.read_text() + json.dumps([5, record[1]]) + "\n")
    with pytest.raises(ValueError, match="line 5: workload index 5 is not one of the 1"):
        load_tuning_log(log_to_apply, converted)


def test_trace_tvm_cannot_replay_is_refused(log_to_apply, converted):
    path = log_to_apply / RECORDS
    path.write_text(path.read_text().replace('"Split"', '"NoSuchInstruction"'))
    with pytest.raises(ValueError, match="corrupt: TVM could not read it"):
        load_tuning_log(log_to_apply, converted)


def test_missing_files_are_clear(log_to_apply, converted, tmp_path):
    with pytest.raises(FileNotFoundError, match="is not a directory"):
        load_tuning_log(tmp_path / "nowhere", converted)
    (log_to_apply / RECORDS).unlink()
    with pytest.raises(FileNotFoundError, match="lacks database_tuning_record.json"):
        load_tuning_log(log_to_apply, converted)
    (log_to_apply / "tvmamp_manifest.json").unlink()
    with pytest.raises(FileNotFoundError, match="no tvmamp_manifest.json"):
        load_tuning_log(log_to_apply, converted)


def test_corrupt_manifest_is_refused(log_to_apply, converted):
    (log_to_apply / "tvmamp_manifest.json").write_text('{"level": "O2", ')
    with pytest.raises(ValueError, match="tvmamp_manifest.json is corrupt or truncated"):
        load_tuning_log(log_to_apply, converted)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"dtype": "float16"}, "dtype: log 'bfloat16', build 'float16'"),
        ({"level": "O1"}, "level: log 'O2', build 'O1'"),
        ({"target": "another cpu"}, "target: log .*, build .*"),
    ],
)
def test_log_for_another_configuration_is_refused(log_to_apply, kwargs, message):
    if kwargs.get("target"):
        host = json.loads((log_to_apply / "tvmamp_manifest.json").read_text())["target"]["mcpu"]
        other = "sapphirerapids" if host == "cooperlake" else "cooperlake"  # both have bf16
        kwargs = {"target": f"llvm -mcpu={other} -num-cores=1"}
    converted = _convert(**kwargs)
    with pytest.raises(ValueError, match=message):
        load_tuning_log(log_to_apply, converted)
    database, notes = load_tuning_log(log_to_apply, converted, override=True)
    assert notes[0].startswith("override: log applied although")


def test_other_thread_count_is_a_note_not_an_error(log_to_apply):
    _, notes = load_tuning_log(log_to_apply, _convert(target="llvm -num-cores=2"))
    assert any("num-cores=1" in n and "num-cores=2" in n for n in notes)


def test_records_for_another_target_than_the_manifest_are_refused(log_to_apply, converted):
    path = log_to_apply / RECORDS
    path.write_text(path.read_text().replace('"kind":"llvm"', '"kind":"c"', 1))
    text = path.read_text()
    assert '"kind":"c"' in text, "the record file's target spelling changed"
    with pytest.raises(ValueError, match="inconsistent: record line 1 was tuned for"):
        load_tuning_log(log_to_apply, converted)
