"""Conv2dToGemm over a symbolic batch and image size: a CNN exported with a dynamic batch
axis (or a dynamic height and width too) on rows.

Before, such convs went to the direct conv (fp32 FMAs), and the max pools, depthwise convs and
squeeze-and-excitation blocks around them ran as NCHW loops: torchvision's ResNet-18 and
EfficientNet-B0 exported with a dynamic batch ran 2x slower than their static builds and
slower than onnxruntime (one thread, Zen5). Here their rows are padded to whole GEMM row
tiles, and every op of the rows rewrite takes them.
"""

from __future__ import annotations

import io
import re

import numpy as np
import pytest
import torch
import tvm
from relax_modules import scheduled_kernels
from torch import nn
from tvm import relax

import tvmamp
from tvmamp.pipeline import run_front_phases
from tvmamp.relay_passes.conv2d_to_gemm import Conv2dToGemm

onnx = pytest.importorskip("onnx")

TARGET = tvm.target.Target({"kind": "llvm", "mcpu": "znver4", "mattr": ["-sse4a"], "num-cores": 2})


class _Net(nn.Module):
    """Every op family of the rows rewrite: an RGB stem, batch norm, max (ceil mode) and
    average pools, a
    dense 3x3 conv, a strided pointwise shortcut and residual add, a depthwise conv, a
    squeeze-and-excitation block, a channel concatenation and shuffle, grouped convs
    (pointwise and 3x3), an exported GELU, a global pool."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, stride=2, padding=1)
        self.bn = nn.BatchNorm2d(16)
        self.dense = nn.Conv2d(16, 48, 3, stride=2, padding=1)
        self.shortcut = nn.Conv2d(16, 48, 1, stride=2)
        self.mix = nn.Conv2d(48, 32, 3, padding=1)
        self.depthwise = nn.Conv2d(32, 32, 3, padding=1, groups=32)
        self.squeeze = nn.Conv2d(32, 8, 1)
        self.excite = nn.Conv2d(8, 32, 1)
        self.point = nn.Conv2d(64, 32, 1, groups=2)
        self.group = nn.Conv2d(32, 32, 3, padding=1, groups=2)
        self.head = nn.Linear(32, 10)

    def forward(self, x):
        x = nn.functional.max_pool2d(torch.relu(self.bn(self.stem(x))), 3, 2, 1, ceil_mode=True)
        x = torch.relu(self.mix(torch.relu(self.dense(x) + self.shortcut(x))))
        d = nn.functional.silu(self.depthwise(x))
        scale = torch.sigmoid(self.excite(torch.relu(self.squeeze(d.mean((2, 3), keepdim=True)))))
        y = torch.cat([d * scale, x], 1)
        n, c, h, w = y.shape
        y = y.reshape(n, 2, c // 2, h, w).transpose(1, 2).reshape(n, c, h, w)
        y = nn.functional.gelu(self.point(y))  # exported as x * (erf(x / sqrt(2)) + 1) / 2
        y = nn.functional.avg_pool2d(torch.relu(self.group(y)), 2)
        return self.head(y.mean((2, 3)))


def _export(size=(19, 17), dynamic_size=False):
    torch.manual_seed(0)
    net = _Net().eval()
    with torch.no_grad():
        net.bn.running_mean.uniform_(-0.2, 0.2)
        net.bn.running_var.uniform_(0.5, 1.5)
    dynamic = {
        "x": {0: "batch", 2: "h", 3: "w"} if dynamic_size else {0: "batch"},
        "y": {0: "batch"},
    }
    return net, _onnx(net, torch.randn(2, 3, *size), dynamic)


def _onnx(net, x, dynamic_axes):
    """``net`` on ``x`` exported to ONNX (input ``x``, output ``y``)."""
    buffer = io.BytesIO()
    torch.onnx.export(
        net,
        (x,),
        buffer,
        input_names=["x"],
        output_names=["y"],
        dynamic_axes=dynamic_axes,
        opset_version=17,
        dynamo=False,
    )
    return onnx.load_from_string(buffer.getvalue())


@pytest.fixture(scope="module")
def exported():
    return _export()


def test_every_conv_runs_on_rows(exported):
    """No conv2d is left to the direct conv, the depthwise conv and pools are the
    vectorised window kernels of the rows, and an im2col gather copies whole taps."""
    _, model = exported
    mod, params = tvmamp.from_onnx(model)
    kernels = scheduled_kernels(mod, "O2", TARGET, params)
    assert not [name for name in kernels if "conv2d" in name], list(kernels)
    # transposes to rows: the squeeze conv's (of the pooled [n, c, 1, 1]), none between the
    # convs (the GELU's erf runs on rows); the RGB stem's gather pads the input transposed to
    # NHWC, not padded rows of it
    assert len([name for name in kernels if "nchw_rows" in name]) == 1, list(kernels)
    assert sum("matmul" in name for name in kernels) >= 5, list(kernels)
    windows = [name for name in kernels if "depthwise_rows" in name or "pool_rows" in name]
    assert len(windows) >= 3, list(kernels)
    for name in windows:
        assert "T.vectorized" in kernels[name].script(), name
    # the 48-channel conv's gather copies each tap's channels in whole vectors (as one loop
    # of 9 x 48 columns in vectors of 27, every vector recomputed its tap and padding test)
    widths = re.findall(r"T\.vectorized\(T\.int64\((\d+)\)\)", kernels["im2col"].script())
    assert widths and all(48 % int(w) == 0 for w in widths), widths
    # so do the grouped convs' gathers (16 and 32 channels a group)
    groups = [f.script() for name, f in kernels.items() if name.startswith("group_columns")]
    widths = [w for text in groups for w in re.findall(r"vectorized\(T\.int64\((\d+)\)", text)]
    assert len(groups) == 2 and widths and all(32 % int(w) == 0 for w in widths), widths


def test_symbolic_batch_matches_torch_and_the_static_build(exported):
    """Batches 1, 3 and 5 (rows not whole tiles) match torch fp32 within bf16's error, and
    batch 3 matches the static build of that batch."""
    net, model = exported
    mod, params = tvmamp.from_onnx(model)
    exe = tvmamp.build(mod, "O2", TARGET, "bfloat16", params=params)
    outs = {}
    for batch in (1, 3, 5):
        x = np.random.default_rng(batch).standard_normal((batch, 3, 19, 17)).astype("float32")
        with torch.no_grad():
            ref = net(torch.from_numpy(x)).numpy()
        outs[batch] = np.asarray(exe(x))
        assert outs[batch].shape == ref.shape
        err = np.abs(outs[batch] - ref).max() / np.abs(ref).max()
        assert err < 3e-2, (batch, err)
    static, params = tvmamp.from_onnx(model, shape_dict={"x": (3, 3, 19, 17)})
    x = np.random.default_rng(3).standard_normal((3, 3, 19, 17)).astype("float32")
    same = np.asarray(tvmamp.build(static, "O2", TARGET, "bfloat16", params=params)(x))
    np.testing.assert_allclose(outs[3], same, rtol=1e-2, atol=1e-2 * np.abs(same).max())


@pytest.fixture(scope="module")
def exported_any_size():
    return _export(dynamic_size=True)


def test_dynamic_image_sizes_run_on_rows(exported_any_size):
    """Exported with a dynamic height and width too (as detection and segmentation models
    are), the convs run on rows as under a dynamic batch, where ConvAsGemm's gathers and GEMMs
    went back to NCHW around each conv, and the batch norms, activations and pools between
    them were NCHW loops over symbolic sizes (torchvision's MobileNetV3-Small: 6.6x
    onnxruntime's time; 0.95x on rows). Sizes whose rows are not whole tiles match torch."""
    net, model = exported_any_size
    mod, params = tvmamp.from_onnx(model)
    kernels = scheduled_kernels(mod, "O2", TARGET, params)
    assert not [name for name in kernels if "conv2d" in name], list(kernels)
    # ConvAsGemm's gathers are takes of [groups, rows, taps, channels]
    takes = {name: f for name, f in kernels.items() if name.startswith("take")}
    gathers = [n for n, f in takes.items() if len(f.params[-1].shape) > 2]
    assert not gathers, gathers
    windows = [name for name in kernels if "depthwise_rows" in name or "pool_rows" in name]
    assert len(windows) >= 2, list(kernels)
    for name in windows:
        assert "T.vectorized" in kernels[name].script(), name
    _matches_torch(net, mod, params, ((1, 3, 19, 17), (3, 3, 24, 13), (2, 3, 9, 30)))


def _conv_module(batch):
    weight = np.random.default_rng(0).standard_normal((16, 8, 3, 3)).astype("bfloat16")
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((batch, 8, 10, 10), "bfloat16"))
    with bb.function("main", [x]):
        with bb.dataflow():
            conv = bb.emit(relax.op.nn.conv2d(x, relax.const(weight), padding=1))
            out = bb.emit_output(relax.op.nn.relu(conv))
        bb.emit_func_output(out)
    return bb.get()


def test_without_a_row_tile_a_symbolic_batch_is_left_alone():
    """``row_tile=None`` (Intel, whose vdpbf16ps runs at half the fp32 rate) leaves convs over
    a symbolic batch to the direct conv, unchanged."""
    mod = _conv_module(tvm.tirx.Var("batch", "int64"))
    tvm.ir.assert_structural_equal(Conv2dToGemm()(mod), mod)
    rewritten = Conv2dToGemm(row_tile=8)(mod).script()
    assert "R.nn.conv2d" not in rewritten and "R.matmul" in rewritten


def test_static_batch_is_rewritten_as_before():
    """A row tile changes nothing for a static batch."""
    mod = _conv_module(2)
    tvm.ir.assert_structural_equal(Conv2dToGemm(row_tile=8)(mod), Conv2dToGemm()(mod))


def test_intel_keeps_the_direct_conv_and_builds(exported):
    """Built, not run (any host): on Sapphire Rapids a GEMM over symbolic rows would run on
    half-rate vdpbf16ps rather than AMX, so the convs stay direct convs on fp32 FMAs."""
    _, model = exported
    mod, params = tvmamp.from_onnx(model)
    target = tvm.target.Target({"kind": "llvm", "mcpu": "sapphirerapids", "num-cores": 2})
    converted = tvmamp.convert(mod, "O2", target, params=params)
    front = run_front_phases(converted)
    names = [gvar.name_hint for gvar in front.get_global_vars()]
    assert any("conv2d" in name for name in names), names
    assert not any("im2col" in name or "group_columns" in name for name in names), names
    tvmamp.build(mod, "O2", target, "bfloat16", params=params)


class _UNet(nn.Module):
    """A U-Net's encoder and decoder: a skip connection concatenated with the upsampled
    (bilinear, then nearest) deeper features."""

    def __init__(self):
        super().__init__()
        self.down = nn.Conv2d(3, 8, 3, padding=1)
        self.deep = nn.Conv2d(8, 16, 3, padding=1)
        self.up = nn.Conv2d(24, 8, 3, padding=1)
        self.head = nn.Conv2d(8, 2, 1)

    def forward(self, x):
        skip = torch.relu(self.down(x))
        deep = torch.relu(self.deep(nn.functional.max_pool2d(skip, 2)))
        deep = nn.functional.interpolate(deep, scale_factor=2.0, mode="bilinear")
        y = torch.relu(self.up(torch.cat([deep, skip], 1)))
        return self.head(nn.functional.interpolate(y, scale_factor=2.0, mode="nearest"))


class _Ghost(nn.Module):
    """GhostNet's ghost module: a primary conv, a cheap depthwise conv of it, both
    concatenated and sliced to the output channels."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, stride=2, padding=1)
        self.primary = nn.Conv2d(16, 12, 1)
        self.cheap = nn.Conv2d(12, 12, 3, padding=1, groups=12)
        self.out = nn.Conv2d(20, 8, 3, padding=1)

    def forward(self, x):
        x = torch.relu(self.stem(x))
        primary = torch.relu(self.primary(x))
        ghost = torch.cat([primary, torch.relu(self.cheap(primary))], 1)[:, :20]
        return self.out(ghost)


class _DeepSkip(nn.Module):
    """Three pools down, a transposed conv one level up, joined with the skip: the importer
    unifies ``h // 4`` with ``h // 8 * 2``."""

    def __init__(self):
        super().__init__()
        self.down = nn.Conv2d(3, 8, 3, padding=1)
        self.up = nn.ConvTranspose2d(8, 8, 2, stride=2)
        self.out = nn.Conv2d(16, 8, 3, padding=1)

    def forward(self, x):
        skip = nn.functional.max_pool2d(nn.functional.max_pool2d(self.down(x), 2), 2)
        deep = self.up(nn.functional.max_pool2d(skip, 2))
        return self.out(torch.cat([deep, skip], 1))


def test_a_skip_joined_at_a_size_no_shape_names_builds():
    """The rows' check of the join matched ``shape([b, h // 4, w // 4])``, and TVM's
    VMShapeLower computes no size a match_cast's value alone names: the bf16 build failed
    with "Check failed: (it != slot_map_.end())" (a U-Net under dynamic image sizes)."""
    torch.manual_seed(0)
    net = _DeepSkip().eval()
    model = _onnx(net, torch.randn(1, 3, 32, 32), {"x": {0: "batch", 2: "h", 3: "w"}})
    mod, params = tvmamp.from_onnx(model)
    _matches_torch(net, mod, params, ((1, 3, 32, 32), (2, 3, 24, 40)))


def _on_rows_export(net, dynamic_size):
    torch.manual_seed(0)
    axes = {"x": {0: "batch", 2: "h", 3: "w"}} if dynamic_size else None
    model = _onnx(net.eval(), torch.randn(2, 3, 16, 12), axes)
    mod, params = tvmamp.from_onnx(model)
    return mod, params, scheduled_kernels(mod, "O2", TARGET, params)


def _check_on_rows_numerics(net, mod, params, dynamic_size):
    shapes = ((1, 3, 16, 12), (2, 3, 10, 18)) if dynamic_size else ((2, 3, 16, 12),)
    _matches_torch(net, mod, params, shapes)


def _matches_torch(net, mod, params, shapes):
    """``mod`` built at O2 matches torch fp32 within bf16's error at each input shape."""
    exe = tvmamp.build(mod, "O2", TARGET, "bfloat16", params=params)
    for shape in shapes:
        x = np.random.default_rng(shape[3]).standard_normal(shape).astype("float32")
        with torch.no_grad():
            ref = net(torch.from_numpy(x)).numpy()
        out = np.asarray(exe(x))
        assert out.shape == ref.shape
        err = np.abs(out - ref).max() / np.abs(ref).max()
        assert err < 3e-2, (shape, err)


@pytest.mark.parametrize("dynamic_size", [True, False], ids=["dynamic size", "static"])
def test_a_decoder_stays_on_rows(dynamic_size):
    """The upsamplings are gathers on the rows, and the concat with the skip connection (whose
    sizes the importer unifies with a match_cast under dynamic sizes) takes rows: nothing goes
    back to NCHW and to rows again (a U-Net under dynamic image sizes: 3.3 of 14 ms, and 1.5x
    onnxruntime's time; 1.0x now)."""
    torch.manual_seed(0)
    net = _UNet()
    mod, params, kernels = _on_rows_export(net, dynamic_size)
    assert len([name for name in kernels if "resize_rows" in name]) == 2, list(kernels)
    assert not [name for name in kernels if "nchw_rows" in name], list(kernels)
    _check_on_rows_numerics(net, mod, params, dynamic_size)


@pytest.mark.parametrize("dynamic_size", [True, False], ids=["dynamic size", "static"])
def test_a_channel_slice_stays_on_rows(dynamic_size):
    """A ghost module's slice of its concatenated channels is a slice of the rows' columns: it
    went back to NCHW and to rows again (GhostNet: 1.6x onnxruntime's time under dynamic image
    sizes)."""
    torch.manual_seed(0)
    net = _Ghost()
    mod, params, kernels = _on_rows_export(net, dynamic_size)
    assert not [name for name in kernels if "nchw_rows" in name], list(kernels)
    # the slice is not of an NCHW value (a transpose back, fused with it)
    assert not [n for n in kernels if "transpose" in n and "strided_slice" in n], list(kernels)
    _check_on_rows_numerics(net, mod, params, dynamic_size)


class _TwoPlusOneD(nn.Module):
    """R(2+1)D's block: a spatial 3-D conv, then a temporal one over 32 x 32 frames."""

    def __init__(self):
        super().__init__()
        self.spatial = nn.Conv3d(8, 32, (1, 3, 3), padding=(0, 1, 1))
        self.temporal = nn.Conv3d(32, 16, (3, 1, 1), padding=(1, 0, 0))

    def forward(self, x):
        return self.temporal(torch.relu(self.spatial(x)))


def test_whole_rows_over_a_dynamic_batch_are_transposed_in_tiles():
    """``batch * 1024`` pixels are whole 8-row tiles: no padded rows, and the temporal conv's
    input becomes rows by a transpose of each frame's ``[C, H*W]`` view, where a gather with
    a clamp of the padded rows ran at 5 % of the copy peak (19 of 65 ms of r2plus1d_18)."""
    torch.manual_seed(0)
    net = _TwoPlusOneD().eval()
    model = _onnx(net, torch.randn(1, 8, 4, 32, 32), {"x": {0: "batch"}})
    mod, params = tvmamp.from_onnx(model)
    kernels = scheduled_kernels(mod, "O2", TARGET, params)
    assert not [name for name in kernels if "nchw_rows" in name], list(kernels)
    _matches_torch(net, mod, params, ((1, 8, 4, 32, 32), (2, 8, 4, 32, 32)))
