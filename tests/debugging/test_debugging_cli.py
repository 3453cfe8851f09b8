"""``tvmamp stats`` and ``tvmamp compare`` (registered on the real CLI by monkeypatching)."""

import csv

import pytest

from tvmamp import cli

TINY_MODELS = """
from tvmamp import models


def tiny_mlp():
    return models.simple_net(batch=4, hidden=16, layers=3)


def tiny_conv():
    return models.conv_net(batch=1, channels=4, size=8, blocks=2)
"""


@pytest.fixture
def tiny(tmp_path):
    path = tmp_path / "tiny.py"
    path.write_text(TINY_MODELS)
    return lambda name: f"{path}:{name}"


@pytest.fixture
def tvmamp_main(monkeypatch):
    names = tuple(dict.fromkeys((*cli.SUBCOMMANDS, "stats", "compare")))
    monkeypatch.setattr(cli, "SUBCOMMANDS", names)
    return cli.main


def test_stats_prints_the_table(tvmamp_main, capsys):
    assert tvmamp_main(["stats", "simplenet", "--level", "O2", "--dtype", "float16"]) == 0
    out = capsys.readouterr().out
    assert "FP16 Calls" in out
    assert "  matmul                                  |  9                |  0" in out


def test_stats_executed_as_json(tvmamp_main, tiny, capsys):
    args = [
        "stats",
        tiny("tiny_conv"),
        "--level",
        "O2",
        "--dtype",
        "bfloat16",
        "--executed",
        "--json",
    ]
    assert tvmamp_main(args) == 0
    out = capsys.readouterr().out
    assert '"nn.conv2d": {\n  "FP16": 0,\n  "BF16": 2' in out
    assert '"nn.batch_norm"' not in out  # folded into the convs' weights (FoldBatchNorm)


def test_compare_writes_csv_and_png(tvmamp_main, tiny, tmp_path, capsys):
    args = ["compare", tiny("tiny_mlp"), "--level", "O2", "--dtype", "float16", "-o", str(tmp_path)]
    assert tvmamp_main(args) == 0
    assert "no op exceeds 0.01" in capsys.readouterr().out
    with open(tmp_path / "accuracy.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["op"] for r in rows[:3]] == ["matmul", "add", "nn.relu"]
    assert all(float(r["max_rel_err"]) < 1e-2 for r in rows)
    assert (tmp_path / "accuracy.png").stat().st_size > 10_000


def test_bad_model_is_a_clear_error(tvmamp_main, capsys):
    assert tvmamp_main(["stats", "nosuchmodel"]) == 2
    assert "cannot load model 'nosuchmodel'" in capsys.readouterr().err
