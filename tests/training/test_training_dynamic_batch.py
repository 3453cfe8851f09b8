"""A symbolic batch: one compiled train step runs at several batch sizes, matching torch."""

import numpy as np
import pytest
import torch
from tvm.relax.frontend import nn
from tvm.script import relax as R

from tvmamp.training import SGD, Trainer

FEATURES, CLASSES, LR = 8, 4, 0.1
SPEC = {"x": nn.spec.Tensor(("n", FEATURES), "float32")}
TORCH_LOSSES = {
    "mse": torch.nn.functional.mse_loss,
    "cross_entropy": torch.nn.functional.cross_entropy,
}


class _MLP(nn.Module):
    def __init__(self):
        self.fc1 = nn.Linear(FEATURES, 16)
        self.fc2 = nn.Linear(16, CLASSES)

    def forward(self, x):
        return self.fc2(nn.relu(self.fc1(x)))


def _torch_step(params, x, y, loss_fn):
    """The loss and the params after one SGD step of the same MLP in torch (float64)."""
    w = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in params.items()}
    hidden = torch.relu(torch.from_numpy(x).double() @ w["fc1.weight"].T + w["fc1.bias"])
    out = hidden @ w["fc2.weight"].T + w["fc2.bias"]
    target = torch.from_numpy(y).double() if y.dtype == np.float32 else torch.from_numpy(y)
    loss = loss_fn(out, target)
    loss.backward()
    return loss.item(), {k: (v - LR * v.grad).detach().numpy() for k, v in w.items()}


def _batch(rng, size, loss):
    x = rng.standard_normal((size, FEATURES)).astype("float32")
    if loss == "mse":
        return x, rng.standard_normal((size, CLASSES)).astype("float32")
    return x, rng.integers(0, CLASSES, size).astype("int64")


@pytest.mark.parametrize(
    "loss, level, dtype, rtol",
    [
        ("mse", "O0", None, 1e-5),
        ("cross_entropy", "O0", None, 1e-5),
        ("mse", "O2", "float16", 2e-2),
        ("cross_entropy", "O1", "bfloat16", 2e-2),
    ],
)
def test_one_step_runs_at_several_batch_sizes(rng, loss, level, dtype, rtol):
    """Was "cannot append the loss to the model: ... R.Tensor((n, 4)) ... while ...
    R.Tensor((n, 4)) ..., which is different" (AppendLoss's copies have an ``n`` each)."""
    trainer = Trainer(_MLP(), loss, SGD(LR), level=level, dtype=dtype, input_spec=SPEC)
    for size in (4, 7, 4):
        x, y = _batch(rng, size, loss)
        want_loss, want_params = _torch_step(trainer.params, x, y, TORCH_LOSSES[loss])
        np.testing.assert_allclose(trainer.step(x, y), want_loss, rtol=rtol)
        for name, value in trainer.params.items():
            scale = np.abs(want_params[name]).max()
            np.testing.assert_allclose(value, want_params[name], rtol=0, atol=rtol * scale)


@R.function
def _l1_loss(p: R.Tensor(("m", CLASSES), "float32"), t: R.Tensor(("m", CLASSES), "float32")):
    with R.dataflow():
        loss = R.sum(R.abs(R.subtract(p, t)))
        R.output(loss)
    return loss


def test_a_user_loss_with_its_own_symbolic_batch(rng):
    """The loss's ``m`` is bound to the model's ``n``."""
    trainer = Trainer(_MLP(), _l1_loss, SGD(LR), level="O0", input_spec=SPEC)
    l1 = lambda out, y: (out - y).abs().sum()  # noqa: E731
    for size in (3, 5):
        x, y = _batch(rng, size, "mse")
        want_loss, want_params = _torch_step(trainer.params, x, y, l1)
        np.testing.assert_allclose(trainer.step(x, y), want_loss, rtol=1e-5)
        np.testing.assert_allclose(trainer.params["fc1.weight"], want_params["fc1.weight"], 1e-5)


def test_inputs_and_targets_must_agree_on_the_batch(rng):
    trainer = Trainer(_MLP(), "mse", SGD(LR), level="O0", input_spec=SPEC)
    x, _ = _batch(rng, 3, "mse")
    _, y = _batch(rng, 4, "mse")
    with pytest.raises(ValueError, match=r"'targets' has shape \(4, 4\), so n=4, but 'x' gave n=3"):
        trainer.step(x, y)
    with pytest.raises(ValueError, match=r"'x' has shape \(3, 8, 1\), but the model expects"):
        trainer.step(x[..., None], y[:3])
    with pytest.raises(ValueError, match=r"'targets' has shape \(3, 5\), but .* expects \(n, 4\)"):
        trainer.step(x, np.ones((3, 5), "float32"))
