"""Operator statistics: static counts from the IR and calls executed by an instrumented build."""

import numpy as np
import pytest
from tvm.script import ir as I
from tvm.script import relax as R

import tvmamp
from tvmamp import debugging, models
from tvmamp.pipeline import instrumentation_hooks


@pytest.fixture(autouse=True)
def _no_hooks_left():
    yield
    debugging.disable_operator_stats_collection(verbose=False)
    assert not instrumentation_hooks()


@I.ir_module
class Known:
    @R.function
    def main(x: R.Tensor((4, 8), "float32"), w: R.Tensor((8, 8), "float16")):
        with R.dataflow():
            a = R.astype(x, "float16")
            b = R.matmul(a, w)
            c = R.matmul(a, w, out_dtype="float32")
            d = R.nn.relu(c)
            e = R.astype(b, "bfloat16")
            f = R.exp(e)
            i = R.argmax(d, axis=1)
            j = R.add(i, i)
            k = R.add(d, R.const(1.0, "float32"))
            t = R.permute_dims(R.const(np.ones((2, 3), "float32")))
            R.output(f, j, k, t)
        return (f, j, k, t)


# Counted by hand from Known: (op, FP16, BF16, FP32, Other); the permute_dims of a constant is
# folded at compile time and not counted.
HAND_COUNTS = {
    "astype": (1, 0, 1, 0),
    "matmul": (2, 0, 0, 0),
    "nn.relu": (0, 0, 1, 0),
    "exp": (0, 1, 0, 0),
    "argmax": (0, 0, 1, 0),
    "add": (0, 0, 1, 1),
}


def test_static_counts_match_hand_counts(capsys):
    stats = debugging.collect_operator_stats(Known)
    assert {op: tuple(row.values()) for op, row in stats.as_dict().items()} == HAND_COUNTS
    table = capsys.readouterr().out
    assert "Op Name" in table and "FP16 Calls" in table and "op count: 6" in table
    assert "  matmul                                  |  2                |  0" in table


def test_counts_of_an_amp_build_follow_the_policy():
    mod, params = models.simple_net(batch=4, hidden=16, layers=3)
    exe = tvmamp.build(mod, level="O2", dtype="float16", params=params)
    stats = debugging.collect_operator_stats(exe, verbose=False)
    assert stats.calls("matmul", "FP16") == 3 and stats.calls("matmul") == 3
    assert stats.calls("nn.relu", "FP16") == 2
    assert stats.calls("permute_dims") == 0  # transposes of bound weights are folded
    ops = {op: dict(c) for op, c in exe.stats.ops.items()}
    assert ops["relax.matmul"] == {"float16": 3}


@I.ir_module
class Branchy:
    @R.function(private=True)
    def layer(x: R.Tensor((4,), "float32")) -> R.Tensor((4,), "float32"):
        with R.dataflow():
            y = R.nn.relu(x)
            R.output(y)
        return y

    @R.function
    def main(x: R.Tensor((4,), "float32"), flag: R.Tensor((), "bool")):
        cls = Branchy
        a = cls.layer(x)
        b = cls.layer(a)
        if flag:
            y = R.exp(b)
        else:
            y = R.log(b)
        return y


def test_executed_counts_differ_from_static_ones(rng):
    static = debugging.collect_operator_stats(Branchy, verbose=False)
    assert static.calls("nn.relu") == 1 and static.calls("exp") == 1 and static.calls("log") == 1
    with debugging.operator_stats_collection(verbose=False) as executed:
        exe = tvmamp.build(Branchy, level="O0")
        x = rng.uniform(1.0, 2.0, 4).astype("float32")
        out = exe(x, np.array(True))
        exe(x, np.array(True))
    np.testing.assert_allclose(out, np.exp(x), rtol=1e-6)
    assert executed.as_dict() == {
        "exp": {"FP16": 0, "BF16": 0, "FP32": 2, "Other": 0},
        "nn.relu": {"FP16": 0, "BF16": 0, "FP32": 4, "Other": 0},
    }


def test_disable_prints_and_later_builds_are_not_counted(capsys, rng):
    debugging.enable_operator_stats_collection()
    exe = tvmamp.build(Branchy, level="O0")
    exe(rng.uniform(1.0, 2.0, 4).astype("float32"), np.array(False))
    stats = debugging.disable_operator_stats_collection()
    assert stats.calls("log", "FP32") == 1 and stats.calls("exp") == 0
    assert "log" in capsys.readouterr().out
    exe(rng.uniform(1.0, 2.0, 4).astype("float32"), np.array(False))
    assert stats.calls("log") == 1


def test_bad_input_is_a_type_error():
    with pytest.raises(TypeError, match="expected an Executable, a Converted result"):
        debugging.collect_operator_stats("model.onnx")
