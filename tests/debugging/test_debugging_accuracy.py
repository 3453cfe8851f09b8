"""Accuracy comparison (fp32 against AMP, op by op), dumps, and the PNG plots."""

import csv

import numpy as np
import pytest
from tvm import relax

from tvmamp import debugging
from tvmamp.pipeline import instrumentation_hooks

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(autouse=True)
def _no_hooks_left():
    yield
    assert not instrumentation_hooks()


def one_overflowing_op():
    """x * 8 -> square (overflows fp16 for |x| > 32) -> tanh -> exp, all low at O3."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((16,), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            a = bb.emit(relax.op.multiply(x, relax.const(8.0, "float32")))
            sq = bb.emit(relax.op.multiply(a, a), name_hint="square")
            t = bb.emit(relax.op.tanh(relax.op.multiply(sq, relax.const(1e-5, "float32"))))
            out = bb.emit_output(relax.op.exp(t))
        bb.emit_func_output(out)
    return bb.get()


def test_compare_points_at_the_overflowing_op(tmp_path, rng):
    x = rng.uniform(1.0, 20.0, 16).astype("float32")
    x[5] = 40.0  # (8 * 40) ** 2 = 102400 > 65504
    report = debugging.compare_accuracy(
        one_overflowing_op(), [x], level="O3", dtype="float16", output_path=tmp_path
    )
    bad = report.first_bad
    assert (bad.op, bad.var, bad.dtype) == ("multiply", "square", "float16")
    assert bad.overflow == 1 and bad.nonfinite == 1 and bad.max_rel_err == np.inf
    first = report.rows[0]
    assert first.op == "multiply" and first.max_rel_err < 1e-2 and first.overflow == 0
    with open(report.csv_path, newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["op"] for r in rows] == [r.op for r in report.rows]
    assert rows[1]["var"] == "square" and rows[1]["overflow"] == "1"
    data = open(report.png_path, "rb").read()
    assert data.startswith(PNG_MAGIC) and len(data) > 10_000
    assert "first op over 0.01: multiply (square" in report.summary()


def test_dumps_round_trip_and_compare(tmp_path, rng):
    x = rng.uniform(0.5, 2.0, 16).astype("float32")
    model = one_overflowing_op()
    ref = debugging.record_op_outputs(model, [x], level="O0")
    amp = debugging.record_op_outputs(model, [x], level="O3", dtype="bfloat16")
    ref.save(tmp_path / "ref")
    amp.save(tmp_path / "amp")
    report = debugging.compare_accuracy(tmp_path / "ref", tmp_path / "amp", plot=False)
    assert [r.op for r in report.rows] == ["multiply", "multiply", "multiply", "tanh", "exp"]
    assert {r.dtype for r in report.rows} == {"bfloat16"}
    assert report.first_bad is None and 0 < max(r.max_rel_err for r in report.rows) < 5e-2
    np.testing.assert_allclose(ref.records[0].value, x * 8, rtol=1e-6)
    with pytest.raises(FileNotFoundError, match="is not an op dump"):
        debugging.compare_accuracy(tmp_path, tmp_path / "amp")


def sample_history():
    history, scale = [], 2.0**16
    for step in range(40):
        found_inf = step in (3, 4, 20)
        history.append(
            {
                "step": step,
                "loss": 1.0 / (step + 1),
                "loss_scale": scale,
                "found_inf": found_inf,
                "skipped": found_inf,
            }
        )
        scale = scale / 2 if found_inf else (scale * 2 if step % 10 == 9 else scale)
    return history


def test_loss_scale_plot_is_written(tmp_path):
    path = debugging.plot_loss_scale(sample_history(), tmp_path / "scale.png")
    data = open(path, "rb").read()
    assert data.startswith(PNG_MAGIC) and len(data) > 10_000


def test_loss_scale_history_needs_the_trainer_keys(tmp_path):
    with pytest.raises(ValueError, match="history entry 0 lacks found_inf, skipped"):
        debugging.plot_loss_scale([{"step": 0, "loss": 1.0, "loss_scale": 2.0}], tmp_path / "x.png")
    with pytest.raises(ValueError, match="history is empty"):
        debugging.plot_loss_scale([], tmp_path / "x.png")
