"""Op-family models for bench/bench_zoo.py: small architectures outside the main zoo's CNNs and
transformers, each built around a family a user's model may bring (plain torch, seeded, no
downloads).

``python bench/bench_zoo.py --models families`` runs them all. Outputs are not class scores,
so they are compared as "encoder" outputs (no top-1). Sizes are small (0.1-10 ms a call), so
fixed per-call costs show.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F
from zoo_models import ZooModel


class SqueezeExcite(nn.Module):
    def __init__(self, channels: int, gate=torch.sigmoid, act=F.silu, reduce: int = 4):
        super().__init__()
        self.fc1 = nn.Conv2d(channels, channels // reduce, 1)
        self.fc2 = nn.Conv2d(channels // reduce, channels, 1)
        self.gate, self.act = gate, act

    def forward(self, x):
        w = F.adaptive_avg_pool2d(x, 1)
        return x * self.gate(self.fc2(self.act(self.fc1(w))))


class MBConv(nn.Module):
    """Expand 1x1, depthwise k x k, squeeze-excitation, project 1x1 (EfficientNet/MobileNetV3)."""

    def __init__(self, cin, cout, k, stride, act=nn.SiLU, gate=torch.sigmoid, se_act=F.silu):
        super().__init__()
        mid = cin * 4
        self.expand = nn.Sequential(nn.Conv2d(cin, mid, 1, bias=False), nn.BatchNorm2d(mid), act())
        self.dw = nn.Sequential(
            nn.Conv2d(mid, mid, k, stride, k // 2, groups=mid, bias=False),
            nn.BatchNorm2d(mid),
            act(),
        )
        self.se = SqueezeExcite(mid, gate, se_act)
        self.project = nn.Sequential(nn.Conv2d(mid, cout, 1, bias=False), nn.BatchNorm2d(cout))
        self.residual = stride == 1 and cin == cout

    def forward(self, x):
        y = self.project(self.se(self.dw(self.expand(x))))
        return x + y if self.residual else y


class EfficientNetLike(nn.Module):
    """SiLU, depthwise 3x3/5x5 (stride 2 too), squeeze-excitation."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, 24, 3, 2, 1, bias=False), nn.BatchNorm2d(24), nn.SiLU()
        )
        specs = [(24, 24, 3, 1), (24, 40, 5, 2), (40, 40, 5, 1), (40, 80, 3, 2), (80, 112, 5, 1)]
        self.blocks = nn.Sequential(*(MBConv(*s) for s in specs), MBConv(112, 192, 5, 2))
        self.head = nn.Linear(192, 100)

    def forward(self, x):
        return self.head(F.adaptive_avg_pool2d(self.blocks(self.stem(x)), 1).flatten(1))


class MobileNetV3Like(nn.Module):
    """Hardswish, hardsigmoid squeeze-excitation with ReLU inside."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 2, 1), nn.Hardswish())
        specs = [(16, 24, 3, 2), (24, 40, 5, 2), (40, 80, 3, 2), (80, 112, 5, 1)]
        self.blocks = nn.Sequential(
            *(MBConv(*s, act=nn.Hardswish, gate=F.hardsigmoid, se_act=F.relu) for s in specs)
        )
        self.head = nn.Linear(112, 10)

    def forward(self, x):
        return self.head(F.adaptive_avg_pool2d(self.blocks(self.stem(x)), 1).flatten(1))


def _unet_block(cin: int, cout: int) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, padding=1),
        nn.GroupNorm(8, cout),
        nn.ReLU(),
        nn.Conv2d(cout, cout, 3, padding=1),
        nn.ReLU(),
    )


class UNetLike(nn.Module):
    """GroupNorm, max pools, 2x2 transposed convs, skip concats, bilinear upsampling."""

    def __init__(self):
        super().__init__()
        self.down1, self.down2, self.down3 = (
            _unet_block(3, 32),
            _unet_block(32, 64),
            _unet_block(64, 128),
        )
        self.up2, self.fuse2 = nn.ConvTranspose2d(128, 64, 2, 2), _unet_block(128, 64)
        self.up1, self.fuse1 = nn.ConvTranspose2d(64, 32, 2, 2), _unet_block(64, 32)
        self.out = nn.Conv2d(32, 2, 1)

    def forward(self, x):
        a = self.down1(x)
        b = self.down2(F.max_pool2d(a, 2))
        c = self.down3(F.max_pool2d(b, 2))
        y = self.fuse2(torch.cat([self.up2(c), b], 1))
        y = self.fuse1(torch.cat([self.up1(y), a], 1))
        return F.interpolate(self.out(y), scale_factor=2, mode="bilinear", align_corners=False)


class YoloLike(nn.Module):
    """Strided 3x3 convs with BN + SiLU, nearest upsampling and a channel concat."""

    def __init__(self):
        super().__init__()

        def conv(cin, cout, stride=1):
            return nn.Sequential(
                nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.SiLU()
            )

        self.c1, self.c2, self.c3, self.c4 = (
            conv(3, 32, 2),
            conv(32, 64, 2),
            conv(64, 128, 2),
            conv(128, 256, 2),
        )
        self.merge, self.out = conv(256 + 128, 128), nn.Conv2d(128, 85, 1)

    def forward(self, x):
        a = self.c3(self.c2(self.c1(x)))
        up = F.interpolate(self.c4(a), scale_factor=2, mode="nearest")
        return self.out(self.merge(torch.cat([up, a], 1)))


class ConvNeXtBlock(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.dw = nn.Conv2d(channels, channels, 7, padding=3, groups=channels)
        self.norm = nn.LayerNorm(channels)
        self.fc1, self.fc2 = nn.Linear(channels, 4 * channels), nn.Linear(4 * channels, channels)
        self.gamma = nn.Parameter(torch.full((channels,), 0.1))

    def forward(self, x):
        y = self.norm(self.dw(x).permute(0, 2, 3, 1))
        y = self.fc2(F.gelu(self.fc1(y))) * self.gamma
        return x + y.permute(0, 3, 1, 2)


class ConvNeXtLike(nn.Module):
    """Patchify stem, depthwise 7x7, channels-last LayerNorm and MLP, layer scale."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 64, 4, 4)
        self.stage1 = nn.Sequential(ConvNeXtBlock(64), ConvNeXtBlock(64))
        self.down = nn.Conv2d(64, 128, 2, 2)
        self.stage2 = nn.Sequential(ConvNeXtBlock(128), ConvNeXtBlock(128))
        self.head = nn.Linear(128, 10)

    def forward(self, x):
        return self.head(self.stage2(self.down(self.stage1(self.stem(x)))).mean((2, 3)))


class SuperResolution(nn.Module):
    """ESPCN: 5x5 and 3x3 convs with tanh on one channel, then a 3x pixel shuffle."""

    def __init__(self):
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(1, 64, 5, padding=2), nn.Conv2d(64, 32, 3, padding=1)
        self.c3, self.shuffle = nn.Conv2d(32, 9, 3, padding=1), nn.PixelShuffle(3)

    def forward(self, x):
        y = torch.tanh(self.c2(torch.tanh(self.c1(x))))
        return torch.sigmoid(self.shuffle(self.c3(y)))


class Norms(nn.Module):
    """InstanceNorm + LeakyReLU, GroupNorm + ELU, average pool."""

    def __init__(self):
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(3, 32, 3, padding=1), nn.Conv2d(32, 32, 3, padding=1)
        self.inorm, self.gnorm = nn.InstanceNorm2d(32, affine=True), nn.GroupNorm(4, 32)

    def forward(self, x):
        y = F.leaky_relu(self.inorm(self.c1(x)), 0.2)
        return F.avg_pool2d(F.elu(self.gnorm(self.c2(y))), 2)


class AudioFrontEnd(nn.Module):
    """wav2vec-style conv1d stack (stride 5, 2, grouped) with GELU, LayerNorm, Linear."""

    def __init__(self):
        super().__init__()
        self.c1, self.c2 = nn.Conv1d(1, 64, 10, 5), nn.Conv1d(64, 128, 3, 2)
        self.c3 = nn.Conv1d(128, 128, 3, 2, groups=4)
        self.norm, self.fc = nn.LayerNorm(128), nn.Linear(128, 32)

    def forward(self, x):
        y = F.gelu(self.c3(F.gelu(self.c2(F.gelu(self.c1(x))))))
        return self.fc(self.norm(y.transpose(1, 2))).mean(1)


class Video3d(nn.Module):
    """Conv3d + BatchNorm3d, a strided conv3d, global pooling."""

    def __init__(self):
        super().__init__()
        self.c1, self.bn = nn.Conv3d(3, 32, 3, padding=1), nn.BatchNorm3d(32)
        self.c2, self.fc = nn.Conv3d(32, 64, 3, stride=2, padding=1), nn.Linear(64, 10)

    def forward(self, x):
        y = F.relu(self.c2(F.relu(self.bn(self.c1(x)))))
        return self.fc(y.mean((2, 3, 4)))


class GRUClassifier(nn.Module):
    """A GRU over 50 steps, classified from the last step (``y[:, -1]``)."""

    def __init__(self):
        super().__init__()
        self.embed, self.gru, self.fc = (
            nn.Linear(40, 128),
            nn.GRU(128, 128, batch_first=True),
            nn.Linear(128, 10),
        )

    def forward(self, x):
        y, _ = self.gru(torch.tanh(self.embed(x)))
        return self.fc(y[:, -1])


class LSTMClassifier(nn.Module):
    """An LSTM over 30 steps; the last step and the final hidden state."""

    def __init__(self):
        super().__init__()
        self.lstm, self.fc = nn.LSTM(32, 64, batch_first=True), nn.Linear(64, 5)

    def forward(self, x):
        y, (h, _) = self.lstm(x)
        return self.fc(y[:, -1]) + h[-1].sum()


class Mixer(nn.Module):
    """MLP-Mixer: token-mixing MLPs on transposed patches, channel-mixing MLPs, LayerNorm."""

    def __init__(self, patches: int = 64, channels: int = 256, layers: int = 4):
        super().__init__()
        self.patch = nn.Conv2d(3, channels, 16, 16)

        def mlp(width, hidden):
            return nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width))

        self.tokens = nn.ModuleList(mlp(patches, 128) for _ in range(layers))
        self.channels = nn.ModuleList(mlp(channels, 512) for _ in range(layers))
        self.norm1 = nn.ModuleList(nn.LayerNorm(channels) for _ in range(layers))
        self.norm2 = nn.ModuleList(nn.LayerNorm(channels) for _ in range(layers))
        self.head = nn.Linear(channels, 10)

    def forward(self, x):
        x = self.patch(x).flatten(2).transpose(1, 2)
        for tokens, channels, n1, n2 in zip(self.tokens, self.channels, self.norm1, self.norm2):
            x = x + tokens(n1(x).transpose(1, 2)).transpose(1, 2)
            x = x + channels(n2(x))
        return self.head(x.mean(1))


class CausalAttention(nn.Module):
    """Pre-norm block with ``scaled_dot_product_attention(is_causal=True)``."""

    def __init__(self, width: int = 128, heads: int = 4):
        super().__init__()
        self.heads, self.norm = heads, nn.LayerNorm(width)
        self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)

    def forward(self, x):
        b, t, d = x.shape
        qkv = self.qkv(self.norm(x)).view(b, t, 3, self.heads, d // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.out(y.transpose(1, 2).reshape(b, t, d))


def _seeded(cls, seed: int):
    def build() -> nn.Module:
        torch.manual_seed(seed)
        return cls().eval()

    return build


def _normal(*shape):
    def make(seed: int) -> tuple:
        return (torch.randn(shape, generator=torch.Generator().manual_seed(seed)),)

    return make


# name: (model class, seed, input shape); batch is the input's first dimension
_SPECS = {
    "efficientnet_like": (EfficientNetLike, 20, (1, 3, 160, 160)),
    "mobilenet_v3_like": (MobileNetV3Like, 21, (1, 3, 192, 192)),
    "unet_like": (UNetLike, 22, (1, 3, 128, 128)),
    "yolo_like": (YoloLike, 23, (1, 3, 256, 256)),
    "convnext_like": (ConvNeXtLike, 24, (1, 3, 128, 128)),
    "espcn": (SuperResolution, 25, (1, 1, 96, 96)),
    "norms": (Norms, 26, (1, 3, 64, 64)),
    "audio_conv1d": (AudioFrontEnd, 27, (1, 1, 16000)),
    "video_conv3d": (Video3d, 28, (1, 3, 8, 32, 32)),
    "gru": (GRUClassifier, 29, (2, 50, 40)),
    "lstm": (LSTMClassifier, 30, (4, 30, 32)),
    "mlp_mixer": (Mixer, 31, (1, 3, 128, 128)),
    "causal_sdpa": (CausalAttention, 32, (2, 64, 128)),
}
FAMILIES = {
    name: ZooModel(name, _seeded(cls, seed), _normal(*shape), shape[0], "encoder")
    for name, (cls, seed, shape) in _SPECS.items()
}
