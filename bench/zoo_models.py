"""The model zoo of bench/bench_zoo.py: eleven architectures in plain torch, seeded, no downloads.

Each entry builds its network with seeded random weights at a small-but-real size (images of
112 to 227 pixels, batch 1; sequences of 128 tokens) so that one build and run of a model takes
well under a minute on a 2-vCPU machine. The CNNs are written here in ``torch.nn`` with the
structure of the torchvision models (torchvision is not a dependency); the three transformers
come from ``transformers`` configs with random weights, eager attention and no KV cache.

Random weights alone make poor test models: every input gets nearly the same logits, and bf16
rounding then flips the argmax at random. So the CNNs are initialised from data, on random
image-like inputs (:func:`_image`): BatchNorm statistics are measured, then perturbed, with
random affine weights (no BatchNorm is an identity); residual branches end in small gammas, as
in trained networks; the classifier layers are standardised (:func:`_calibrate_head`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn


@dataclasses.dataclass(frozen=True)
class ZooModel:
    """One zoo entry.

    Attributes
    ----------
    name : str
    build : callable
        ``build()`` returns the seeded model in eval mode.
    inputs : callable
        ``inputs(seed)`` returns the tuple of example input tensors (batch ``batch``).
    batch : int
    kind : str
        "classifier" (top-1 over the last axis of a (batch, classes) output), "lm" (top-1 per
        position over the vocabulary) or "encoder" (hidden states, no top-1).
    """

    name: str
    build: Callable[[], nn.Module]
    inputs: Callable[[int], tuple]
    batch: int
    kind: str


def _image(size: int, batch: int = 1) -> Callable[[int], tuple]:
    """Random images with image-like statistics: not i.i.d. pixels.

    Each image is a smooth random field (7x7 noise, upsampled bilinearly) with a random gain
    and offset per channel, plus pixel noise. With i.i.d. pixels every input's globally pooled
    features would be nearly the same (an average over many positions), and the logits would
    differ between inputs by less than bf16's rounding of their common part.
    """

    def make(seed: int) -> tuple:
        gen = torch.Generator().manual_seed(seed)
        low = torch.randn(batch, 3, 7, 7, generator=gen)
        x = nn.functional.interpolate(low, size=(size, size), mode="bilinear")
        gain = 0.5 + 1.5 * torch.rand(batch, 3, 1, 1, generator=gen)
        x = x * gain + 0.5 * torch.randn(batch, 3, 1, 1, generator=gen)
        return (x + 0.5 * torch.randn(batch, 3, size, size, generator=gen),)

    return make


def _tokens(seq: int, vocab: int, batch: int = 1, pad: int | None = None) -> Callable:
    """Random token ids; with ``pad``, also an attention mask whose last ``pad`` tokens are 0."""

    def make(seed: int) -> tuple:
        gen = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, vocab, (batch, seq), generator=gen)
        if pad is None:
            return (ids,)
        mask = torch.ones(batch, seq, dtype=torch.int64)
        mask[:, seq - pad :] = 0
        return ids, mask

    return make


def _init_convnet(model: nn.Module) -> None:
    """torchvision's initialisation: He-normal convs, small-normal linears."""
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            if m.bias is not None:
                nn.init.normal_(m.bias, 0.0, 0.05)
        elif isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, 0.0, (1.0 / m.in_features) ** 0.5)
            nn.init.normal_(m.bias, 0.0, 0.05)


def _calibration_batch(inputs: Callable[[int], tuple], seed: int) -> torch.Tensor:
    """16 inputs (seeds apart from the ones bench_zoo checks with) as one batch."""
    return torch.cat([inputs(10_000 + 100 * seed + i)[0] for i in range(16)])


RESIDUAL_GAMMA = 0.15
"""Scale of the last BatchNorm's affine weights in each residual branch.

Trained residual networks have small last-BN gammas; with gammas near 1 a random ResNet-50 is
so sensitive that torch's own bf16 autocast changes its logits by 50 % and top-1 means nothing.
"""


def _calibrate_bn(model: nn.Module, batch: torch.Tensor, seed: int) -> None:
    """Measure BN statistics on ``batch``, then perturb them; random affine weights.

    The running mean is shifted by 0.2 standard deviations and the variance scaled by 0.7-1.4
    at random, gammas are uniform in [0.5, 1.5] (times ``RESIDUAL_GAMMA`` for the last BN of a
    residual branch, which a block names with ``residual_norm()``), betas normal(0, 0.1).
    """
    bns = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    if not bns:
        return
    gen = torch.Generator().manual_seed(seed + 1)
    for bn in bns:
        bn.reset_running_stats()
        bn.momentum = None  # cumulative average over the calibration batch
        nn.init.uniform_(bn.weight, 0.5, 1.5, generator=gen)
        nn.init.normal_(bn.bias, 0.0, 0.1, generator=gen)
    with torch.no_grad():
        for block in model.modules():
            last = getattr(block, "residual_norm", lambda: None)()
            if last is not None:
                last.weight *= RESIDUAL_GAMMA
                last.bias *= RESIDUAL_GAMMA
    model.train()
    with torch.no_grad():
        model(batch)
    model.eval()
    with torch.no_grad():
        for bn in bns:
            std = bn.running_var.sqrt()
            bn.running_mean += 0.2 * std * torch.randn(bn.num_features, generator=gen)
            bn.running_var *= torch.empty(bn.num_features).uniform_(0.7, 1.4, generator=gen)
            bn.momentum = 0.1


def _calibrate_head(model: nn.Module, batch: torch.Tensor) -> None:
    """Standardise each classifier layer's outputs over random inputs (data-dependent init).

    With random weights the post-ReLU features share a large input-independent mean, and the
    logits of every input then pick the same class, so top-1 agreement would prove nothing.
    Each ``nn.Linear`` (and a 1x1 conv classifier, ``model.head_conv``), in order, gets weights
    and bias rescaled so its outputs have mean 0 and std 1 over a batch of random inputs.
    """
    layers = [m for m in model.modules() if isinstance(m, nn.Linear)]
    layers += [model.head_conv] if hasattr(model, "head_conv") else []
    model.eval()
    for layer in layers:
        seen: list[torch.Tensor] = []
        hook = layer.register_forward_hook(
            lambda mod, args, out, seen=seen: seen.append(out.clone())
        )
        with torch.no_grad():
            model(batch)
        hook.remove()
        dims = [d for d in range(seen[0].dim()) if d != 1]
        mean, std = seen[0].mean(dims), seen[0].std(dims).clamp_min(1e-6)
        shape = (-1,) + (1,) * (layer.weight.dim() - 1)
        with torch.no_grad():
            layer.weight /= std.reshape(shape)
            layer.bias.copy_((layer.bias - mean) / std)


def _seeded_cnn(cls, size: int, seed: int, **kwargs) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        torch.manual_seed(seed)
        model = cls(**kwargs)
        _init_convnet(model)
        batch = _calibration_batch(_image(size), seed)
        _calibrate_bn(model, batch, seed)
        _calibrate_head(model, batch)
        return model.eval()

    return build


def conv_bn(cin, cout, k, stride=1, groups=1, relu=True, act=nn.ReLU):
    """Conv (no bias) + BatchNorm (+ activation)."""
    layers = [
        nn.Conv2d(cin, cout, k, stride, k // 2, groups=groups, bias=False),
        nn.BatchNorm2d(cout),
    ]
    return nn.Sequential(*layers, act(inplace=True)) if relu else nn.Sequential(*layers)


# ---------------------------------------------------------------- ResNet-50 / ResNeXt


class Bottleneck(nn.Module):
    """torchvision's ResNet v1.5 bottleneck (stride on the 3x3), optionally grouped."""

    def __init__(self, cin, planes, stride, groups=1, base_width=64):
        super().__init__()
        width = int(planes * base_width / 64) * groups
        self.body = nn.Sequential(
            conv_bn(cin, width, 1),
            conv_bn(width, width, 3, stride, groups),
            conv_bn(width, planes * 4, 1, relu=False),
        )
        self.down = None
        if stride != 1 or cin != planes * 4:
            self.down = conv_bn(cin, planes * 4, 1, stride, relu=False)

    def residual_norm(self):
        return self.body[2][1]

    def forward(self, x):
        idt = x if self.down is None else self.down(x)
        return torch.relu(self.body(x) + idt)


class ResNet(nn.Module):
    """ResNet-50-shaped network: 7x7 stem, four bottleneck stages, global pool, FC."""

    def __init__(self, layers=(3, 4, 6, 3), groups=1, base_width=64, classes=1000):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, 64, 7, 2, 3, bias=False),
            nn.BatchNorm2d(64),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(3, 2, 1),
        )
        blocks, cin = [], 64
        for i, n in enumerate(layers):
            planes = 64 * 2**i
            for j in range(n):
                stride = 2 if (j == 0 and i > 0) else 1
                blocks.append(Bottleneck(cin, planes, stride, groups, base_width))
                cin = planes * 4
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x):
        x = self.blocks(self.stem(x))
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


# ---------------------------------------------------------------- ShuffleNet v1 (g=3)


def channel_shuffle(x, groups):
    """ShuffleNet's channel shuffle: reshape, transpose, flatten."""
    n, c, h, w = x.shape
    x = x.view(n, groups, c // groups, h, w).transpose(1, 2).contiguous()
    return x.view(n, c, h, w)


class ShuffleUnit(nn.Module):
    """ShuffleNet v1 unit: grouped 1x1, shuffle, depthwise 3x3, grouped 1x1; add or concat."""

    def __init__(self, cin, cout, stride, groups, first_groups):
        super().__init__()
        self.stride, self.groups = stride, groups
        branch = cout - cin if stride == 2 else cout
        mid = cout // 4
        self.reduce = conv_bn(cin, mid, 1, groups=first_groups)
        self.dw = conv_bn(mid, mid, 3, stride, groups=mid, relu=False)
        self.expand = conv_bn(mid, branch, 1, groups=groups, relu=False)

    def residual_norm(self):
        return self.expand[1] if self.stride == 1 else None

    def forward(self, x):
        y = channel_shuffle(self.reduce(x), self.groups)
        y = self.expand(self.dw(y))
        if self.stride == 2:
            return torch.relu(torch.cat([nn.functional.avg_pool2d(x, 3, 2, 1), y], 1))
        return torch.relu(x + y)


class ShuffleNet(nn.Module):
    """ShuffleNet v1 1.0x, groups=3 (stage channels 240/480/960, repeats 4/8/4)."""

    def __init__(self, groups=3, classes=1000):
        super().__init__()
        self.stem = nn.Sequential(conv_bn(3, 24, 3, 2), nn.MaxPool2d(3, 2, 1))
        units, cin = [], 24
        for cout, reps in zip((240, 480, 960), (4, 8, 4)):
            for j in range(reps):
                first_groups = 1 if cin == 24 else groups
                units.append(ShuffleUnit(cin, cout, 2 if j == 0 else 1, groups, first_groups))
                cin = cout
        self.units = nn.Sequential(*units)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x):
        x = self.units(self.stem(x))
        return self.fc(x.mean((2, 3)))


# ---------------------------------------------------------------- MobileNetV2


class InvertedResidual(nn.Module):
    """MobileNetV2 block: 1x1 expand, depthwise 3x3, 1x1 project (linear), residual if same."""

    def __init__(self, cin, cout, stride, expand):
        super().__init__()
        hidden = cin * expand
        layers = [conv_bn(cin, hidden, 1, act=nn.ReLU6)] if expand != 1 else []
        layers += [
            conv_bn(hidden, hidden, 3, stride, groups=hidden, act=nn.ReLU6),
            conv_bn(hidden, cout, 1, relu=False),
        ]
        self.body = nn.Sequential(*layers)
        self.residual = stride == 1 and cin == cout

    def residual_norm(self):
        return self.body[-1][1] if self.residual else None

    def forward(self, x):
        return x + self.body(x) if self.residual else self.body(x)


class MobileNetV2(nn.Module):
    """torchvision's MobileNetV2 1.0x."""

    SETTINGS = ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1))
    SETTINGS += ((6, 160, 3, 2), (6, 320, 1, 1))

    def __init__(self, classes=1000):
        super().__init__()
        layers, cin = [conv_bn(3, 32, 3, 2, act=nn.ReLU6)], 32
        for t, c, n, s in self.SETTINGS:
            for i in range(n):
                layers.append(InvertedResidual(cin, c, s if i == 0 else 1, t))
                cin = c
        layers.append(conv_bn(cin, 1280, 1, act=nn.ReLU6))
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(nn.Dropout(0.2), nn.Linear(1280, classes))

    def forward(self, x):
        x = nn.functional.adaptive_avg_pool2d(self.features(x), 1)
        return self.classifier(torch.flatten(x, 1))


# ---------------------------------------------------------------- AlexNet (grouped), VGG-16


class AlexNet(nn.Module):
    """The original two-tower AlexNet on 227x227: groups=2 convs, LRN, 9216x4096 FC."""

    def __init__(self, classes=1000):
        super().__init__()
        lrn = dict(size=5, alpha=1e-4, beta=0.75, k=2.0)
        self.features = nn.Sequential(
            nn.Conv2d(3, 96, 11, 4),
            nn.ReLU(inplace=True),
            nn.LocalResponseNorm(**lrn),
            nn.MaxPool2d(3, 2),
            nn.Conv2d(96, 256, 5, padding=2, groups=2),
            nn.ReLU(inplace=True),
            nn.LocalResponseNorm(**lrn),
            nn.MaxPool2d(3, 2),
            nn.Conv2d(256, 384, 3, padding=1),
            nn.ReLU(inplace=True),
            nn.Conv2d(384, 384, 3, padding=1, groups=2),
            nn.ReLU(inplace=True),
            nn.Conv2d(384, 256, 3, padding=1, groups=2),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(3, 2),
        )
        self.classifier = _vgg_head(256 * 6 * 6, classes)

    def forward(self, x):
        return self.classifier(torch.flatten(self.features(x), 1))


def _vgg_head(cin, classes):
    return nn.Sequential(
        nn.Dropout(),
        nn.Linear(cin, 4096),
        nn.ReLU(inplace=True),
        nn.Dropout(),
        nn.Linear(4096, 4096),
        nn.ReLU(inplace=True),
        nn.Linear(4096, classes),
    )


class VGG(nn.Module):
    """VGG-16 (configuration D, no BN) on 112x112: 13 convs, then 4608x4096, 4096x4096 FCs."""

    CFG = (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M")
    CFG += (512, 512, 512, "M")

    def __init__(self, size=112, classes=1000):
        super().__init__()
        layers, cin = [], 3
        for v in self.CFG:
            if v == "M":
                layers.append(nn.MaxPool2d(2, 2))
            else:
                layers += [nn.Conv2d(cin, v, 3, padding=1), nn.ReLU(inplace=True)]
                cin = v
        self.features = nn.Sequential(*layers)
        self.classifier = _vgg_head(512 * (size // 32) ** 2, classes)

    def forward(self, x):
        return self.classifier(torch.flatten(self.features(x), 1))


# ---------------------------------------------------------------- SqueezeNet 1.1, DenseNet-121


class Fire(nn.Module):
    """SqueezeNet fire module: 1x1 squeeze, then 1x1 and 3x3 expands concatenated."""

    def __init__(self, cin, squeeze, e1, e3):
        super().__init__()
        self.squeeze = nn.Conv2d(cin, squeeze, 1)
        self.e1 = nn.Conv2d(squeeze, e1, 1)
        self.e3 = nn.Conv2d(squeeze, e3, 3, padding=1)

    def forward(self, x):
        x = torch.relu(self.squeeze(x))
        return torch.cat([torch.relu(self.e1(x)), torch.relu(self.e3(x))], 1)


class SqueezeNet(nn.Module):
    """torchvision's SqueezeNet 1.1 (ceil-mode max pools, conv classifier)."""

    def __init__(self, classes=1000):
        super().__init__()
        pool = dict(kernel_size=3, stride=2, ceil_mode=True)
        self.features = nn.Sequential(
            nn.Conv2d(3, 64, 3, 2),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(**pool),
            Fire(64, 16, 64, 64),
            Fire(128, 16, 64, 64),
            nn.MaxPool2d(**pool),
            Fire(128, 32, 128, 128),
            Fire(256, 32, 128, 128),
            nn.MaxPool2d(**pool),
            Fire(256, 48, 192, 192),
            Fire(384, 48, 192, 192),
            Fire(384, 64, 256, 256),
            Fire(512, 64, 256, 256),
        )
        self.head_conv = nn.Conv2d(512, classes, 1)
        self.classifier = nn.Sequential(nn.Dropout(0.5), self.head_conv, nn.ReLU(inplace=True))

    def forward(self, x):
        x = self.classifier(self.features(x))
        return torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1)


class DenseLayer(nn.Module):
    """DenseNet layer: BN-ReLU-1x1 (4k) - BN-ReLU-3x3 (k) on the concat of all earlier maps."""

    def __init__(self, cin, growth, bn_size=4):
        super().__init__()
        self.body = nn.Sequential(
            nn.BatchNorm2d(cin),
            nn.ReLU(inplace=True),
            nn.Conv2d(cin, bn_size * growth, 1, bias=False),
            nn.BatchNorm2d(bn_size * growth),
            nn.ReLU(inplace=True),
            nn.Conv2d(bn_size * growth, growth, 3, padding=1, bias=False),
        )

    def forward(self, features):
        return self.body(torch.cat(features, 1))


class DenseBlock(nn.Module):
    """A dense block: every layer sees the concat of the block input and all earlier outputs."""

    def __init__(self, n, cin, growth):
        super().__init__()
        self.layers = nn.ModuleList(DenseLayer(cin + i * growth, growth) for i in range(n))

    def forward(self, x):
        features = [x]
        for layer in self.layers:
            features.append(layer(features))
        return torch.cat(features, 1)


class DenseNet(nn.Module):
    """torchvision's DenseNet-121 (growth 32, blocks 6/12/24/16)."""

    def __init__(self, blocks=(6, 12, 24, 16), growth=32, classes=1000):
        super().__init__()
        layers = [
            nn.Conv2d(3, 64, 7, 2, 3, bias=False),
            nn.BatchNorm2d(64),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(3, 2, 1),
        ]
        c = 64
        for i, n in enumerate(blocks):
            layers.append(DenseBlock(n, c, growth))
            c += n * growth
            if i != len(blocks) - 1:
                layers += [
                    nn.BatchNorm2d(c),
                    nn.ReLU(inplace=True),
                    nn.Conv2d(c, c // 2, 1, bias=False),
                    nn.AvgPool2d(2, 2),
                ]
                c //= 2
        layers += [nn.BatchNorm2d(c), nn.ReLU(inplace=True)]
        self.features = nn.Sequential(*layers)
        self.fc = nn.Linear(c, classes)

    def forward(self, x):
        x = nn.functional.adaptive_avg_pool2d(self.features(x), 1)
        return self.fc(torch.flatten(x, 1))


# ---------------------------------------------------------------- transformers (HF configs)


class OutputOf(nn.Module):
    """Wrap a Hugging Face model: positional inputs by ``names``, one output tensor ``field``."""

    def __init__(self, model: nn.Module, field: str, names: tuple[str, ...]):
        super().__init__()
        self.model, self.field, self.names = model, field, names

    def forward(self, *inputs):
        return getattr(self.model(**dict(zip(self.names, inputs))), self.field)


def _hf(config_cls, model_cls, field, seed, names=("input_ids",), **config) -> Callable:
    def build() -> nn.Module:
        import transformers

        torch.manual_seed(seed)
        cfg = getattr(transformers, config_cls)(**config)
        cfg._attn_implementation = "eager"
        cfg.use_cache = False
        model = getattr(transformers, model_cls)(cfg)
        return OutputOf(model.eval(), field, names).eval()

    return build


MASKED = ("input_ids", "attention_mask")


BERT = dict(
    vocab_size=30522, hidden_size=384, num_hidden_layers=4, num_attention_heads=6,
    intermediate_size=1536, max_position_embeddings=512,
)  # fmt: skip
GPT2 = dict(vocab_size=50257, n_embd=384, n_layer=4, n_head=6, n_positions=1024)
VIT = dict(
    hidden_size=384, num_hidden_layers=6, num_attention_heads=6, intermediate_size=1536,
    image_size=224, patch_size=16, num_labels=1000,
)  # fmt: skip

ZOO = {
    m.name: m
    for m in (
        ZooModel("resnet50", _seeded_cnn(ResNet, 112, 0), _image(112), 1, "classifier"),
        ZooModel(
            "resnext50_32x4d",
            _seeded_cnn(ResNet, 112, 1, groups=32, base_width=4),
            _image(112),
            1,
            "classifier",
        ),
        ZooModel("shufflenet_g3", _seeded_cnn(ShuffleNet, 224, 2), _image(224), 1, "classifier"),
        ZooModel("mobilenet_v2", _seeded_cnn(MobileNetV2, 224, 3), _image(224), 1, "classifier"),
        ZooModel("alexnet", _seeded_cnn(AlexNet, 227, 4), _image(227), 1, "classifier"),
        ZooModel("vgg16", _seeded_cnn(VGG, 112, 5), _image(112), 1, "classifier"),
        ZooModel("squeezenet1_1", _seeded_cnn(SqueezeNet, 224, 6), _image(224), 1, "classifier"),
        ZooModel("densenet121", _seeded_cnn(DenseNet, 112, 7), _image(112), 1, "classifier"),
        ZooModel(
            "bert",
            _hf("BertConfig", "BertModel", "last_hidden_state", 8, MASKED, **BERT),
            _tokens(128, BERT["vocab_size"], pad=16),
            1,
            "encoder",
        ),
        ZooModel(
            "gpt2",
            _hf("GPT2Config", "GPT2LMHeadModel", "logits", 9, **GPT2),
            _tokens(128, GPT2["vocab_size"]),
            1,
            "lm",
        ),
        ZooModel(
            "gpt2_mask",
            _hf("GPT2Config", "GPT2LMHeadModel", "logits", 9, MASKED, **GPT2),
            _tokens(128, GPT2["vocab_size"], pad=0),
            1,
            "lm",
        ),
        ZooModel(
            "vit_s16",
            _hf("ViTConfig", "ViTForImageClassification", "logits", 10, ("pixel_values",), **VIT),
            _image(224),
            1,
            "classifier",
        ),
    )
}
"""All zoo entries by name, in benchmark order.

``gpt2`` is called with token ids only, as ``model(input_ids)``; ``gpt2_mask`` is the same model
with an all-ones attention mask, which skips transformers' packed-sequence check (``diff`` and
``cumsum`` on the position ids) that the TorchScript ONNX exporter cannot export.
"""
