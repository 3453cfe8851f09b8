"""The model suite: ResNet-18, MobileNetV2, a TransformerEncoder and an ONNX CNN, seeded weights.

torch and onnx are imported only when a suite model is built (``pip install 'tvmamp[torch,onnx]'``).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from tvmamp.frontends.common import require


@dataclasses.dataclass(frozen=True)
class SuiteModel:
    """One suite entry: how it is built and what its input looks like."""

    name: str
    framework: str  # "torch" or "onnx"
    kind: str  # "image" (N, 3, H, W) or "sequence" (N, L, d_model)
    num_classes: int


SUITE = {
    m.name: m
    for m in (
        SuiteModel("resnet18", "torch", "image", 1000),
        SuiteModel("mobilenet_v2", "torch", "image", 1000),
        SuiteModel("transformer_encoder", "torch", "sequence", 10),
        SuiteModel("onnx_cnn", "onnx", "image", 10),
    )
}
D_MODEL = 128


def _entry(name: str) -> SuiteModel:
    if name not in SUITE:
        raise ValueError(f"tvmamp.suite: unknown model {name!r}; choose from {', '.join(SUITE)}")
    return SUITE[name]


def create(name: str, image_size: int = 224, seed: int = 0):
    """The model with seeded random weights: a torch.nn.Module in eval mode, or an ONNX model."""
    entry = _entry(name)
    if entry.framework == "onnx":
        require("onnx", "onnx", "tvmamp.suite")
        from .onnx_models import small_cnn

        return small_cnn(num_classes=entry.num_classes, image_size=image_size, seed=seed)
    torch = require("torch", "torch", "tvmamp.suite")
    from . import torch_models as tm

    builders = {
        "resnet18": tm.ResNet18,
        "mobilenet_v2": tm.MobileNetV2,
        "transformer_encoder": lambda num_classes: tm.TransformerClassifier(
            d_model=D_MODEL, num_classes=num_classes
        ),
    }
    generator = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = builders[name](num_classes=entry.num_classes)
    calibration = example_inputs(name, batch=8, image_size=image_size, seed=seed + 12345)[0]
    return tm.randomize_norms(model, generator, torch.from_numpy(calibration))


def input_shape(name: str, batch: int = 1, image_size: int = 224, seq_len: int = 16) -> tuple:
    """The input shape of a suite model: (N, 3, H, W) images or (N, L, 128) sequences."""
    if _entry(name).kind == "image":
        return (batch, 3, image_size, image_size)
    return (batch, seq_len, D_MODEL)


def _check_shape(name: str, shape) -> tuple:
    shape = tuple(int(d) for d in shape)
    image = _entry(name).kind == "image"
    want = (None, 3, None, None) if image else (None, None, D_MODEL)
    if len(shape) != len(want) or any(w not in (None, d) for w, d in zip(want, shape)):
        takes = "(N, 3, H, W)" if image else f"(N, L, {D_MODEL})"
        raise ValueError(
            f"tvmamp.suite: input shape {shape} does not fit {name}, which takes {takes}"
        )
    return shape


def example_inputs(
    name: str, batch: int = 1, image_size: int = 224, seq_len: int = 16, seed: int = 1, shape=None
) -> list[np.ndarray]:
    """Random float32 inputs with a per-sample, per-channel offset, so the predicted class varies.

    ``shape`` (checked against the model) overrides ``batch``, ``image_size`` and ``seq_len``.
    """
    shape = (
        _check_shape(name, shape)
        if shape is not None
        else input_shape(name, batch, image_size, seq_len)
    )
    rng = np.random.default_rng(seed)
    if _entry(name).kind == "image":
        offset = rng.standard_normal((shape[0], shape[1], 1, 1))
    else:
        offset = rng.standard_normal((shape[0], 1, shape[2]))
    return [(rng.standard_normal(shape) + offset).astype("float32")]


def load(
    name: str, batch: int = 1, image_size: int = 224, seq_len: int = 16, seed: int = 0, shape=None
):
    """Import a suite model for tvmamp: returns ``(mod, params)`` for ``tvmamp.build``.

    ``shape`` (checked against the model) overrides ``batch``, ``image_size`` and ``seq_len``.
    """
    from tvmamp.frontends import from_onnx, from_torch

    inputs = example_inputs(name, batch, image_size, seq_len, shape=shape)
    shape = inputs[0].shape
    model = create(name, image_size=shape[-1] if _entry(name).kind == "image" else 0, seed=seed)
    if _entry(name).framework == "onnx":
        return from_onnx(model, shape_dict={"image": shape})
    return from_torch(model, inputs)


def reference(model, inputs) -> np.ndarray:
    """The fp32 output of the original framework (torch eager, or ONNX's reference evaluator)."""
    if hasattr(model, "graph"):
        from .onnx_models import run_reference

        return run_reference(model, inputs)
    torch = require("torch", "torch", "tvmamp.suite")
    with torch.no_grad():
        return model(*[torch.from_numpy(np.asarray(x)) for x in inputs]).numpy()


__all__ = [
    "SUITE",
    "SuiteModel",
    "create",
    "example_inputs",
    "input_shape",
    "load",
    "reference",
]
