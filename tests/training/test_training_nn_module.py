"""Training a relax.frontend.nn module with cross-entropy, Adam and bf16 O1."""

import numpy as np
from tvm.relax.frontend import nn

from tvmamp.training import Adam, Trainer

BATCH, FEATURES, CLASSES = 16, 8, 4


class MLP(nn.Module):
    def __init__(self):
        self.fc1 = nn.Linear(FEATURES, 16)
        self.fc2 = nn.Linear(16, CLASSES)

    def forward(self, x):
        return self.fc2(nn.relu(self.fc1(x)))


def test_nn_module_learns_a_classification_task(rng):
    spec = {"x": nn.spec.Tensor((BATCH, FEATURES), "float32")}
    trainer = Trainer(
        MLP(), "cross_entropy", Adam(lr=0.02), level="O1", dtype="bfloat16", input_spec=spec
    )
    assert set(trainer.params) == {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}
    centers = 2.0 * rng.standard_normal((CLASSES, FEATURES))
    labels = rng.integers(0, CLASSES, (5, BATCH))
    xs = (centers[labels] + 0.5 * rng.standard_normal((5, BATCH, FEATURES))).astype("float32")
    expected = _numpy_cross_entropy(trainer.params, xs[0], labels[0])
    losses = [trainer.step(xs[i % 5], labels[i % 5].astype("int64")) for i in range(30)]
    np.testing.assert_allclose(losses[0], expected, rtol=2e-2)
    assert np.mean(losses[-5:]) < 0.3 * np.mean(losses[:5]), losses
    assert trainer.loss_scale == 1.0  # bf16 needs no loss scaling by default


def _numpy_cross_entropy(p, x, labels):
    h = np.maximum(x @ p["fc1.weight"].T.astype(np.float64) + p["fc1.bias"], 0)
    logits = h @ p["fc2.weight"].T.astype(np.float64) + p["fc2.bias"]
    logits -= logits.max(axis=1, keepdims=True)
    log_p = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    return -log_p[np.arange(len(labels)), labels].mean()
