"""The ``tvmamp tune`` and ``tvmamp logs show`` commands."""

import os

import pytest
from tuning_support import DTYPE, LEVEL, TRIALS

from tvmamp import cli


@pytest.fixture
def main(monkeypatch):
    """tvmamp's CLI entry point with the tuning subcommands registered."""
    names = tuple(dict.fromkeys([*cli.SUBCOMMANDS, "tune", "logs"]))
    monkeypatch.setattr(cli, "SUBCOMMANDS", names)
    return cli.main


def test_logs_show_prints_target_level_dtype_and_kernels(main, tuned_log, capsys):
    work_dir, result = tuned_log
    assert main(["logs", "show", str(work_dir)]) == 0
    out = capsys.readouterr().out
    assert f"level   {LEVEL}    dtype {DTYPE}" in out and '"kind": "llvm"' in out
    (tuned,) = [t for t in result.tasks if t.done]
    row = next(line for line in out.splitlines() if line.startswith(tuned.name))
    assert row.split()[2] == f"{tuned.done}/{tuned.trials}"
    assert float(row.split()[3]) == pytest.approx(tuned.best_ms, rel=1e-3)
    assert "no records (default schedules): cast" in out


def test_logs_show_on_a_missing_log_is_an_error(main, tmp_path, capsys):
    assert main(["logs", "show", str(tmp_path)]) == 2
    assert "has no tvmamp_manifest.json" in capsys.readouterr().err


def test_tune_command_continues_a_complete_log(main, log_copy, capsys):
    model = f"{os.path.join(os.path.dirname(__file__), 'tuning_support.py')}:tiny_model"
    args = ["tune", model, "--target", "llvm -num-cores=1", "--level", LEVEL, "--dtype", DTYPE]
    args += ["--work-dir", str(log_copy), "--trials", str(TRIALS), "--no-progress"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "measured 0 new candidates" in out and f"{TRIALS}/{TRIALS}" in out


def test_tune_command_checks_rpc_options(main, capsys):
    assert main(["tune", "simplenet", "--rpc-tracker", "127.0.0.1:9190"]) == 2
    assert "--rpc-tracker and --rpc-key go together" in capsys.readouterr().err
