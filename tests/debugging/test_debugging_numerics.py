"""check_numerics, tensor statistics and Paddle's report line (tvmamp.debugging.numerics)."""

import ml_dtypes
import numpy as np
import pytest

from tvmamp.debugging import DebugMode, check_layer_numerics, check_numerics, tensor_stats


def test_check_numerics_on_paddles_pow_example():
    x = np.array([1, 0, 3], dtype="float32")
    y = np.array([0.2, 0, 0.5], dtype="float32")
    stats, values = check_numerics(np.power(x, y), "pow", "res")
    assert stats.dtype == np.int64 and values.dtype == np.float32
    np.testing.assert_array_equal(stats, [0, 0, 0])
    expected = [np.sqrt(3.0), 1.0, (1.0 + 1.0 + np.sqrt(3.0)) / 3]
    np.testing.assert_allclose(values, expected, rtol=1e-6)


def test_stats_of_paddles_pow_gradient_match_paddles_line():
    # d/dx x**y = y * x**(y-1) on Paddle's example: [0.2, 0 * inf = nan, 0.5 / sqrt(3)]
    x = np.array([1, 0, 3], dtype="float32")
    y = np.array([0.2, 0, 0.5], dtype="float32")
    with np.errstate(divide="ignore", invalid="ignore"):
        grad = y * np.power(x, y - 1)
    finding = tensor_stats(grad, "elementwise_pow_grad", "")
    line = finding.line()
    assert "op=elementwise_pow_grad" in line and "dtype=fp32" in line
    assert "numel=3, num_nan=1, num_inf=0, num_zero=0" in line
    assert "max=2.886751e-01, min=2.000000e-01, mean=nan" in line


def test_abort_mode_raises_on_nan_and_other_modes_return(capsys):
    data = np.array([1.0, np.inf, 0.0], dtype="float16")
    with pytest.raises(RuntimeError, match="op my_op .*tensor v"):
        check_numerics(data, "my_op", "v")
    stats, values = check_numerics(data, "my_op", "v", DebugMode.CHECK_NAN_INF)
    np.testing.assert_array_equal(stats, [0, 1, 1])
    assert values[0] == np.inf and values[1] == 0.0
    assert "[PRECISION] [ERROR] in [device=cpu, op=my_op, tensor=v, dtype=fp16]" in (
        capsys.readouterr().err
    )


def test_bfloat16_and_overflow_counts():
    data = np.array([70000.0, -1.0, 2.0, 0.0], dtype=ml_dtypes.bfloat16)
    finding = tensor_stats(data, "mul", "t")
    assert finding.dtype == "bfloat16" and finding.num_overflow == 1
    assert finding.num_zero == 1 and finding.level() == "WARNING"
    assert finding.min == -1.0 and abs(finding.max - 70000.0) / 70000.0 < 1e-2


def test_bad_debug_mode_is_a_value_error():
    with pytest.raises(ValueError, match="debug_mode 'loud' is not one of CHECK_NAN_INF_AND_ABORT"):
        check_numerics([1.0], "op", "v", "loud")


def test_check_layer_numerics_checks_inputs_and_outputs(capsys, rng):
    def layer(a, b):
        with np.errstate(divide="ignore"):
            return a * b, a / b

    x = rng.standard_normal(8).astype("float32") + 3.0
    out = check_layer_numerics(layer)(x, x)
    np.testing.assert_allclose(out[0], x * x, rtol=1e-6)
    with pytest.raises(RuntimeError, match="op layer .*tensor output1"):
        check_layer_numerics(layer)(x, np.zeros_like(x))
    reporting = check_layer_numerics(name="blk", debug_mode=DebugMode.CHECK_NAN_INF)(layer)
    reporting(x, np.zeros_like(x))
    assert "op=blk, tensor=output1" in capsys.readouterr().err
    with pytest.raises(TypeError, match="expected a callable"):
        check_layer_numerics(42)
