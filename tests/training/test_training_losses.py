"""cross_entropy targets: -100 is ignored as in torch, other labels out of range are refused."""

import numpy as np
import pytest
import torch
from tvm.relax.frontend import nn

from tvmamp.training import SGD, Trainer

B, F, C = 4, 5, 3


class _Linear(nn.Module):
    def __init__(self):
        self.fc = nn.Linear(F, C)

    def forward(self, x):
        return self.fc(x)


@pytest.fixture(scope="module")
def trainer():
    spec = {"x": nn.spec.Tensor((B, F), "float32")}
    return Trainer(_Linear(), "cross_entropy", SGD(0.1), level="O0", input_spec=spec)


def _torch_loss_and_grads(params, x, labels):
    w = torch.tensor(params["fc.weight"], requires_grad=True)
    b = torch.tensor(params["fc.bias"], requires_grad=True)
    logits = torch.from_numpy(x) @ w.T + b
    loss = torch.nn.functional.cross_entropy(logits, torch.from_numpy(labels))
    loss.backward()
    return loss.item(), {"fc.weight": w.grad.numpy(), "fc.bias": b.grad.numpy()}


@pytest.mark.parametrize("labels", [[0, 2, 1, 1], [0, 2, 1, -100], [-100, 2, -100, 0]])
def test_ignored_targets_are_left_out_of_the_mean(trainer, labels):
    x = np.random.default_rng(0).standard_normal((B, F)).astype("float32")
    labels = np.array(labels, "int64")
    want_loss, want_grads = _torch_loss_and_grads(trainer.params, x, labels)
    grads = trainer.gradients(x, labels)
    loss = trainer.step(x, labels)  # the loss of the params before this step
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5, atol=1e-6)
    for name, want in want_grads.items():
        np.testing.assert_allclose(grads[name], want, rtol=1e-5, atol=1e-6)


def test_all_targets_ignored_is_a_zero_loss_and_no_change():
    spec = {"x": nn.spec.Tensor((B, F), "float32")}
    trainer = Trainer(_Linear(), "cross_entropy", SGD(0.1), level="O0", input_spec=spec)
    x = np.random.default_rng(1).standard_normal((B, F)).astype("float32")
    before = trainer.params
    assert trainer.step(x, np.full(B, -100, "int64")) == 0.0
    assert not trainer.found_inf
    for name, value in trainer.params.items():
        np.testing.assert_array_equal(value, before[name])


@pytest.mark.parametrize("bad, shown", [(7, "got 7"), (-1, "got -1"), (3, "got 3")])
def test_targets_outside_the_classes_are_refused(trainer, bad, shown):
    x = np.random.default_rng(2).standard_normal((B, F)).astype("float32")
    labels = np.array([0, 1, 2, bad], "int64")
    before = trainer.params
    match = r"targets must be class indices in \[0, 3\) or -100 \(ignored\), " + shown
    with pytest.raises(ValueError, match=match):
        trainer.step(x, labels)
    with pytest.raises(ValueError, match=match):
        trainer.gradients(x, labels)
    for name, value in trainer.params.items():
        np.testing.assert_array_equal(value, before[name])


class _MLP(nn.Module):
    def __init__(self):
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 16)

    def forward(self, x):
        return self.fc2(nn.relu(self.fc1(x)))


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_mse_squares_in_fp32_at_every_level(level):
    """Targets ~100 away: fp16 squares overflowed and every reported loss was inf (torch's
    autocast computes mse_loss in fp32), while most steps applied their updates. At O3, which
    runs every op low, the loss was inf until the loss itself was kept fp32 at every level (as
    MindSpore casts the network's output to fp32 for the loss)."""
    rng = np.random.default_rng(0)
    spec = {"x": nn.spec.Tensor((8, 16), "float32")}
    trainer = Trainer(_MLP(), "mse", SGD(1e-3), level=level, dtype="float16", input_spec=spec)
    for _ in range(3):
        x = rng.standard_normal((8, 16)).astype("float32")
        targets = (100 * rng.standard_normal((8, 16))).astype("float32")
        params = trainer.params
        hidden = np.maximum(x @ params["fc1.weight"].T + params["fc1.bias"], 0)
        want = np.mean((hidden @ params["fc2.weight"].T + params["fc2.bias"] - targets) ** 2)
        loss = trainer.step(x, targets)  # overflowing scaled gradients skip a step: fine
        np.testing.assert_allclose(loss, want, rtol=1e-2)


def test_cross_entropy_over_a_symbolic_batch():
    """The ignore-index mean divided by the batch size as a Python int, which a symbolic
    batch is not."""
    import tvm
    from tvm import relax

    from tvmamp.training.losses import loss_function

    batch = tvm.tirx.Var("n", "int64")
    loss = loss_function("cross_entropy", relax.TensorType((batch, 3), "float32"))
    assert "mean" not in loss.script()
