"""Training numerics: fp16 gradient underflow with and without loss scaling; loss goes down."""

import numpy as np
import pytest
from tolerances import assert_close, tolerance
from tvm import relax

from tvmamp import models
from tvmamp.loss_scale import NoOpLossScale, StaticLossScale
from tvmamp.training import SGD, Trainer

BATCH, HIDDEN, TINY = 8, 16, 1e-6


def tiny_mse(pred_ty):
    """A user loss whose gradients are ~1e-8: ``1e-6 * mean((p - t) ** 2)``."""
    bb = relax.BlockBuilder()
    pred, targets = relax.Var("predictions", pred_ty), relax.Var("targets", pred_ty)
    with bb.function("tiny_mse", [pred, targets]):
        with bb.dataflow():
            diff = bb.emit(relax.op.subtract(pred, targets))
            mean = bb.emit(relax.op.mean(relax.op.multiply(diff, diff)))
            out = bb.emit_output(relax.op.multiply(mean, relax.const(TINY, "float32")))
        bb.emit_func_output(out)
    return bb.get()["tiny_mse"]


def reference_grads(params, x, y):
    """float64 numpy backward of 2 x Linear with ReLU between and the tiny loss."""
    p = {k: v.astype(np.float64) for k, v in params.items()}
    h0 = x @ p["linear0.weight"].T + p["linear0.bias"]
    a0 = np.maximum(h0, 0)
    out = a0 @ p["linear1.weight"].T + p["linear1.bias"]
    dout = TINY * 2 * (out - y) / out.size
    dh0 = (dout @ p["linear1.weight"]) * (h0 > 0)
    return {
        "linear0.weight": dh0.T @ x,
        "linear0.bias": dh0.sum(0),
        "linear1.weight": dout.T @ a0,
        "linear1.bias": dout.sum(0),
    }


@pytest.fixture(scope="module")
def model():
    return models.simple_net(batch=BATCH, hidden=HIDDEN, layers=2, seed=1)


def _fp16_trainer(model, scaler):
    mod, params = model
    loss = tiny_mse(mod["main"].ret_ty)
    return Trainer(mod, loss, SGD(0.1), level="O1", dtype="float16", scaler=scaler, params=params)


def test_fp16_gradient_underflow_is_real_and_loss_scaling_fixes_it(model, rng):
    _, params = model
    x = rng.standard_normal((BATCH, HIDDEN)).astype("float32")
    y = rng.standard_normal((BATCH, HIDDEN)).astype("float32")
    ref = reference_grads(params, x.astype(np.float64), y.astype(np.float64))
    plain = _fp16_trainer(model, NoOpLossScale()).gradients(x, y)
    scaled = _fp16_trainer(model, StaticLossScale(2.0**16)).gradients(x, y)
    for name in ("linear0.weight", "linear0.bias", "linear1.weight"):  # behind fp16 matmuls
        want = ref[name]
        assert np.abs(want).min() > 0
        zeros = np.mean(plain[name] == 0)
        assert zeros > 0.25, f"{name}: only {zeros:.0%} of the unscaled grads flushed to zero"
        assert _rel_err(plain[name], want) > 0.2
        # every element, the small ones included (grads here are ~1e-7: atol scales with them)
        assert_close(scaled[name], want, **tolerance("float16", np.abs(want).max()), what=name)
        assert np.mean(scaled[name] == 0) == 0, name


def _rel_err(got, want):
    """Normwise error: used only to show that a result is far off (> 0.2 of the largest)."""
    return np.abs(got - want).max() / np.abs(want).max()


def _regression(rng, n_batches=4):
    teacher = rng.standard_normal((HIDDEN, HIDDEN)) / np.sqrt(HIDDEN)
    xs = rng.standard_normal((n_batches, BATCH, HIDDEN))
    return xs.astype("float32"), np.tanh(xs @ teacher).astype("float32")


@pytest.mark.parametrize(
    "level, dtype",
    [("O0", None), ("O1", "float16"), ("O2", "bfloat16")],
)
def test_loss_goes_down(model, level, dtype, rng):
    mod, _ = model
    trainer = Trainer(mod, "mse", SGD(0.05, momentum=0.9), level=level, dtype=dtype, seed=7)
    xs, ys = _regression(rng)
    losses = [trainer.step(xs[i % 4], ys[i % 4]) for i in range(40)]
    first, last = np.mean(losses[:4]), np.mean(losses[-4:])
    assert last < 0.5 * first, (level, losses)
    assert trainer.skipped_steps == 0
    for name, value in trainer.params.items():
        assert value.dtype == np.float32, name  # fp32 master weights at every level
