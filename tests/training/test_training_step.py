"""The compiled train step: forced overflows, skipped updates and the loss-scale trajectory."""

import re

import numpy as np
import pytest
from loss_scale_reference import reference_update
from tolerances import assert_close, tolerance

from tvmamp import models
from tvmamp.loss_scale import DynamicLossScale, StaticLossScale
from tvmamp.training import SGD, Adam, Trainer

BATCH, HIDDEN = 4, 8
OVERFLOWS = [0, 0, 1, 0, 0, 0, 1, 1, 0, 0, 1, 1, 1, 0]


def _data(rng, n=1):
    x = rng.standard_normal((n, BATCH, HIDDEN)).astype("float32")
    y = rng.standard_normal((n, BATCH, HIDDEN)).astype("float32")
    return x, y


@pytest.fixture(scope="module")
def fp16_trainer():
    mod, params = models.simple_net(batch=BATCH, hidden=HIDDEN, layers=2)
    scaler = DynamicLossScale(preset="paddle_legacy", incr_every_n_steps=2)
    return Trainer(
        mod, "mse", Adam(lr=1e-2), level="O1", dtype="float16", scaler=scaler, params=params
    )


def test_trajectory_and_skips_follow_the_reference(fp16_trainer):
    trainer, rng = fp16_trainer, np.random.default_rng(3)
    xs, ys = _data(rng, len(OVERFLOWS))
    state = trainer.scaler.state
    for i, overflow in enumerate(OVERFLOWS):
        x = xs[i].copy()
        if overflow:
            x[1, 2] = np.inf if i % 2 else np.nan  # the gradients become inf/nan
        before, optim_before = trainer.params, [s.numpy() for s in trainer._optim]
        scale_used = trainer.loss_scale
        trainer.step(x, ys[i])
        state = reference_update(trainer.scaler, state, bool(overflow))
        assert tuple(float(v) for v in trainer.scale_state) == tuple(float(v) for v in state)
        entry = trainer.history[-1]
        assert entry == {
            "step": i + 1,
            "loss": entry["loss"],
            "loss_scale": scale_used,
            "found_inf": bool(overflow),
            "skipped": bool(overflow),
        }
        after = trainer.params
        for name in before:
            changed = not np.array_equal(before[name], after[name])
            assert changed != bool(overflow), (i, name)
        if overflow:  # bitwise: the optimizer state (Adam m, v, step count) did not move
            for old, new in zip(optim_before, trainer._optim):
                assert old.tobytes() == new.numpy().tobytes()
            for name in before:
                assert before[name].tobytes() == after[name].tobytes()
    assert trainer.skipped_steps == sum(OVERFLOWS)


def test_nan_loss_never_corrupts_params(fp16_trainer):
    trainer, rng = fp16_trainer, np.random.default_rng(4)
    x, y = _data(rng)
    y = y[0].copy()
    y[0, 0] = np.nan
    before = trainer.params
    loss = trainer.step(x[0], y)
    assert np.isnan(loss) and trainer.found_inf and trainer.history[-1]["skipped"]
    for name, value in trainer.params.items():
        assert value.tobytes() == before[name].tobytes()


def test_data_must_match_the_model(fp16_trainer):
    x, y = _data(np.random.default_rng(5))
    with pytest.raises(TypeError, match="'x' has dtype float64, but the model expects float32"):
        fp16_trainer.step(x[0].astype("float64"), y[0])
    with pytest.raises(TypeError, match="'targets' has dtype int64, but the model expects float32"):
        fp16_trainer.step(x[0], y[0].astype("int64"))
    with pytest.raises(ValueError, match=r"'x' has shape \(2, 8\), but the model expects \(4, 8\)"):
        fp16_trainer.step(x[0][:2], y[0])
    with pytest.raises(TypeError, match=r"step takes 2 arrays \(x, targets\), got 1"):
        fp16_trainer.step(x[0])


def test_show_prints_the_loss_scale_ops(fp16_trainer, capsys):
    fp16_trainer.show()
    text = capsys.readouterr().out
    for needle in (
        "def train_step",
        'amp_scaled_loss: R.Tensor((), dtype="float32") = R.multiply(',  # loss x scale
        "amp_inv_scale",  # 1 / scale
        "R.isfinite(",
        "amp_all_finite",
        "if amp_apply:",  # the step is kept only when every value is finite
        "amp_loss_scale_new",  # the loss-scale state update
        'dtype="float16"',  # the AMP pass ran on the backward graph
    ):
        assert needle in text, needle


def test_gradient_accumulation_sums_k_steps():
    mod, params = models.simple_net(batch=BATCH, hidden=HIDDEN, layers=2, seed=5)
    lr, rng = 0.1, np.random.default_rng(6)
    xs, ys = _data(rng, 2)
    trainer = Trainer(mod, "mse", SGD(lr), level="O0", params=params, accumulate_steps=2)
    g1, g2 = trainer.gradients(xs[0], ys[0]), trainer.gradients(xs[1], ys[1])
    trainer.step(xs[0], ys[0])
    for name, value in trainer.params.items():  # no update after the first micro-step
        assert value.tobytes() == params[name].tobytes()
    trainer.step(xs[1], ys[1])
    for name, value in trainer.params.items():
        expected = params[name].astype(np.float64) - lr * (g1[name] + g2[name])
        np.testing.assert_allclose(value, expected, rtol=1e-5, atol=1e-6)
    assert [h["skipped"] for h in trainer.history] == [False, False]


def _snapshot(trainer):
    return trainer.params, [s.numpy() for s in trainer._optim]


def _assert_bitwise_equal(params, optim, trainer):
    for name, value in trainer.params.items():
        assert value.tobytes() == params[name].tobytes(), name
    for old, new in zip(optim, trainer._optim):
        assert old.tobytes() == new.numpy().tobytes()


@pytest.mark.parametrize("bad", [0, 1])
def test_accumulation_skips_the_whole_step_when_a_micro_step_overflows(bad):
    """O1 fp16, k=2, a real fp16 overflow in micro-step ``bad`` (inputs x1000: the scaled
    backward exceeds 65504; fp32 would not overflow). The accumulated update is skipped, the
    scale halves on the update step only, and the next accumulation starts from zero."""
    mod, params = models.simple_net(batch=BATCH, hidden=HIDDEN, layers=2, seed=5)
    lr, init = 0.1, 2.0**12
    scaler = DynamicLossScale(init=init, incr_every_n_steps=1)  # Paddle: x0.5 on 1 bad step
    trainer = Trainer(
        mod, "mse", SGD(lr), "O1", "float16", scaler=scaler, params=params, accumulate_steps=2
    )
    xs, ys = _data(np.random.default_rng(6), 4)
    xs[bad] *= 1000.0
    p0, optim0 = _snapshot(trainer)
    trainer.step(xs[0], ys[0])
    assert trainer.found_inf == (bad == 0) and trainer.loss_scale == init  # no update yet
    trainer.step(xs[1], ys[1])
    assert trainer.found_inf and trainer.history[-1]["skipped"]
    _assert_bitwise_equal(p0, optim0, trainer)  # the good micro-step's grads were dropped too
    assert trainer.loss_scale == init / 2 and trainer.skipped_steps == 1
    g2, g3 = trainer.gradients(xs[2], ys[2]), trainer.gradients(xs[3], ys[3])
    trainer.step(xs[2], ys[2])
    assert not trainer.found_inf and trainer.loss_scale == init / 2  # still accumulating
    trainer.step(xs[3], ys[3])
    assert not trainer.found_inf and trainer.loss_scale == init  # grows on the update step
    for name, value in trainer.params.items():  # the accumulator was reset after the skip
        expected = params[name].astype(np.float64) - lr * (g2[name] + g3[name])
        np.testing.assert_allclose(value, expected, rtol=1e-5, atol=1e-6, err_msg=name)
    assert [h["skipped"] for h in trainer.history] == [False, True, False, False]
    assert [h["loss_scale"] for h in trainer.history] == [init, init, init / 2, init / 2]
    fp32 = Trainer(mod, "mse", SGD(lr), "O0", scaler=DynamicLossScale(init=init), params=params)
    fp32.step(xs[bad], ys[bad])
    assert not fp32.found_inf  # the overflow is fp16's, not the model's


def test_too_large_a_scale_overflows_the_fp16_backward_until_the_scaler_backs_off():
    """MindSpore's initial scale 2^24 makes the scaled fp16 gradients of this model overflow
    (no injected inf): each step is skipped and halves the scale until the gradients fit; then
    every step updates, with fp16 gradients that match fp32's."""
    mod, params = models.simple_net(batch=BATCH, hidden=HIDDEN, layers=2, seed=5)
    rng = np.random.default_rng(0)
    x, y = (rng.standard_normal((BATCH, HIDDEN)).astype("float32") for _ in range(2))
    scaler = DynamicLossScale(preset="mindspore")
    trainer = Trainer(mod, "mse", SGD(0.01), "O1", "float16", scaler=scaler, params=params)
    fp32 = Trainer(mod, "mse", SGD(0.01), "O0", scaler=scaler, params=params)
    want = fp32.gradients(x, y)
    fp32.step(x, y)
    assert not fp32.found_inf  # in fp32 the same scale is harmless
    state, losses = trainer.scaler.state, []
    for _ in range(12):
        before = _snapshot(trainer)
        losses.append(trainer.step(x, y))
        state = reference_update(trainer.scaler, state, trainer.found_inf)
        assert tuple(float(v) for v in trainer.scale_state) == tuple(float(v) for v in state)
        if trainer.found_inf:
            _assert_bitwise_equal(*before, trainer)
    skipped = [h["skipped"] for h in trainer.history]
    backoffs = skipped.index(False)
    assert backoffs >= 2 and not any(skipped[backoffs:]), skipped  # measured: 6 backoffs
    assert trainer.loss_scale == 2.0**24 / 2**backoffs
    assert np.all(np.diff(losses[backoffs:]) < 0), losses  # the updates train the model
    backed_off = StaticLossScale(trainer.loss_scale)  # on the initial params
    fresh = Trainer(mod, "mse", SGD(0.01), "O1", "float16", scaler=backed_off, params=params)
    for name, grad in fresh.gradients(x, y).items():
        assert_close(grad, want[name], **tolerance("float16", np.abs(want[name]).max()), what=name)


def test_step_kernels_fuse_across_the_adjoint_and_the_optimizer():
    """The private adjoint and optimizer are inlined into train_step before compiling.

    With plain SGD the all-finite check reads the updated params, so each weight gradient has
    one consumer: its matmul, the 1/scale unscale and the update are one kernel, and no
    where(all finite, new, old) selection is left (a Relax If picks the tuples).
    """
    mod, params = models.simple_net(batch=BATCH, hidden=HIDDEN, layers=2)
    trainer = Trainer(mod, "mse", SGD(1e-3), level="O2", dtype="bfloat16", params=params)
    names = set(re.findall(r"@(\w+)", trainer.executable.vm_exec.as_text()))
    assert not {"loss_adjoint", "optimizer"} & names
    pattern = r"fused_matmul\d*_multiply\d*_multiply\d*_subtract\d*_prepacked"
    assert any(re.fullmatch(pattern, n) for n in names), names
    assert not [n for n in names if re.fullmatch(r"fused_multiply\d*_subtract\d*_where\d*", n)]
    assert "def loss_adjoint" in trainer.script()  # the module users read is unchanged


@pytest.mark.parametrize("optimizer", [SGD(1e-2), SGD(1e-2, momentum=0.9), Adam(1e-2)], ids=str)
def test_each_optimizer_skips_a_non_finite_step_and_takes_a_finite_one(optimizer):
    """Plain SGD and Adam check the updated params, momentum SGD the grads: all skip alike."""
    mod, params = models.simple_net(batch=BATCH, hidden=HIDDEN, layers=2, seed=2)
    trainer = Trainer(mod, "mse", optimizer, "O2", "bfloat16", params=params)
    (x,), (y,) = _data(np.random.default_rng(7))
    for poison in (np.inf, np.nan):
        bad = x.copy()
        bad[1, 3] = poison
        before = _snapshot(trainer)
        trainer.step(bad, y)
        assert trainer.found_inf and trainer.history[-1]["skipped"]
        _assert_bitwise_equal(*before, trainer)
    before = trainer.params
    trainer.step(x, y)
    assert not trainer.found_inf
    assert all(not np.array_equal(before[n], v) for n, v in trainer.params.items())


def test_sgd_skips_an_update_that_overflows_with_finite_grads():
    """The check reads SGD's updated params: p - lr * g past FLT_MAX is a skipped step."""
    mod, params = models.simple_net(batch=BATCH, hidden=HIDDEN, layers=2, seed=2)
    trainer = Trainer(mod, "mse", SGD(1e38), "O0", params=params)
    (x,), (y,) = _data(np.random.default_rng(8))
    y = y * 100.0  # gradients of a few tens
    grads = trainer.gradients(x, y)
    assert all(np.isfinite(g).all() for g in grads.values())
    assert max(np.abs(g).max() for g in grads.values()) > 4.0  # 1e38 * 4 > FLT_MAX
    before = _snapshot(trainer)
    trainer.step(x, y)
    assert trainer.found_inf
    _assert_bitwise_equal(*before, trainer)
