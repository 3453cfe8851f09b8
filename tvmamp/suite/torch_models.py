"""ResNet-18, MobileNetV2 and a 2-layer TransformerEncoder classifier in plain PyTorch.

torchvision's wheel does not import beside the CPU torch build, so the two CNNs are written out
here, following the torchvision architectures (same layers, strides and channel counts).
"""

from __future__ import annotations

import torch
from torch import nn


def _conv_bn(c_in, c_out, kernel, stride=1, groups=1, act=None):
    layers = [
        nn.Conv2d(c_in, c_out, kernel, stride, kernel // 2, groups=groups, bias=False),
        nn.BatchNorm2d(c_out),
    ]
    return nn.Sequential(*layers, *([act] if act is not None else []))


class BasicBlock(nn.Module):
    """ResNet basic block: two 3x3 convs with a shortcut (1x1 conv when the shape changes)."""

    def __init__(self, c_in: int, c_out: int, stride: int):
        super().__init__()
        self.conv1 = _conv_bn(c_in, c_out, 3, stride, act=nn.ReLU())
        self.conv2 = _conv_bn(c_out, c_out, 3)
        change = stride != 1 or c_in != c_out
        self.shortcut = _conv_bn(c_in, c_out, 1, stride) if change else nn.Identity()

    def forward(self, x):
        return torch.relu(self.conv2(self.conv1(x)) + self.shortcut(x))


class ResNet18(nn.Module):
    """ResNet-18: 7x7 stem, max pool, 4 stages of 2 basic blocks, average pool, linear head."""

    def __init__(self, num_classes: int = 1000):
        super().__init__()
        self.stem = nn.Sequential(_conv_bn(3, 64, 7, 2, act=nn.ReLU()), nn.MaxPool2d(3, 2, 1))
        blocks, c_in = [], 64
        for c_out, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            blocks += [BasicBlock(c_in, c_out, stride), BasicBlock(c_out, c_out, 1)]
            c_in = c_out
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(512, num_classes)

    def forward(self, x):
        return self.fc(
            torch.flatten(nn.functional.adaptive_avg_pool2d(self.blocks(self.stem(x)), 1), 1)
        )


class InvertedResidual(nn.Module):
    """MobileNetV2 block: 1x1 expand, 3x3 depthwise, 1x1 linear projection (+ residual)."""

    def __init__(self, c_in: int, c_out: int, stride: int, expand: int):
        super().__init__()
        hidden = c_in * expand
        layers = [_conv_bn(c_in, hidden, 1, act=nn.ReLU6())] if expand != 1 else []
        layers += [
            _conv_bn(hidden, hidden, 3, stride, groups=hidden, act=nn.ReLU6()),
            _conv_bn(hidden, c_out, 1),
        ]
        self.body = nn.Sequential(*layers)
        self.residual = stride == 1 and c_in == c_out

    def forward(self, x):
        return x + self.body(x) if self.residual else self.body(x)


# (expansion, output channels, repeats, first stride), as in the MobileNetV2 paper.
_MOBILENET_V2_STAGES = (
    (1, 16, 1, 1),
    (6, 24, 2, 2),
    (6, 32, 3, 2),
    (6, 64, 4, 2),
    (6, 96, 3, 1),
    (6, 160, 3, 2),
    (6, 320, 1, 1),
)


class MobileNetV2(nn.Module):
    """MobileNetV2 (width 1.0): 17 inverted residual blocks, 1x1 conv to 1280, linear head."""

    def __init__(self, num_classes: int = 1000):
        super().__init__()
        layers, c_in = [_conv_bn(3, 32, 3, 2, act=nn.ReLU6())], 32
        for expand, c_out, repeats, stride in _MOBILENET_V2_STAGES:
            for i in range(repeats):
                layers.append(InvertedResidual(c_in, c_out, stride if i == 0 else 1, expand))
                c_in = c_out
        layers.append(_conv_bn(c_in, 1280, 1, act=nn.ReLU6()))
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(nn.Dropout(0.2), nn.Linear(1280, num_classes))

    def forward(self, x):
        x = nn.functional.adaptive_avg_pool2d(self.features(x), 1)
        return self.classifier(torch.flatten(x, 1))


class TransformerClassifier(nn.Module):
    """``nn.TransformerEncoder`` (post-norm, GELU) over a sequence, mean pool, linear head."""

    def __init__(self, d_model=128, nhead=4, layers=2, dim_ff=512, num_classes=10):
        super().__init__()
        layer = nn.TransformerEncoderLayer(
            d_model, nhead, dim_ff, dropout=0.1, activation="gelu", batch_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, num_classes)

    def forward(self, x):
        return self.head(self.encoder(x).mean(dim=1))


def randomize_norms(model: nn.Module, generator: torch.Generator, calibration) -> nn.Module:
    """Seeded random BatchNorm affine parameters; running statistics measured on ``calibration``.

    Random weights alone make deep CNNs collapse: activations shrink layer by layer until every
    input gets the same logits. Running statistics measured on random inputs (as a data-dependent
    initialisation) keep each layer normalised, so the prediction depends on the input.
    """
    norms = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    with torch.no_grad():
        for m in norms:
            m.weight.copy_(1.0 + 0.1 * torch.randn(m.num_features, generator=generator))
            m.bias.copy_(0.1 * torch.randn(m.num_features, generator=generator))
            m.reset_running_stats()
            m.momentum = None  # cumulative average over the calibration batch
        if norms:
            model.train()
            model(calibration)
        for m in norms:
            m.momentum = 0.1
    return model.eval()
