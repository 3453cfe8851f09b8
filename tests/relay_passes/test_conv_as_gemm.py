"""ConvAsGemm: a conv1d over a symbolic length, a conv2d over a symbolic height or width,
become an im2col gather and a GEMM."""

import numpy as np
import pytest
import tvm
from relax_modules import op_names
from tolerances import assert_close, tolerance
from tvm import relax

import tvmamp
from tvmamp.pipeline import run_front_phases
from tvmamp.relay_passes.conv_as_gemm import ConvAsGemm

TARGET = "llvm -mcpu=znver4 -mattr=-sse4a"

# (channels, filters, taps, stride, padding, dilation, groups)
CASES = {
    "wav2vec2 first layer": (1, 8, 10, 5, 0, 1, 1),
    "padded, dilated": (6, 10, 3, 1, 2, 2, 1),
    "strided": (8, 12, 3, 2, 1, 1, 1),
    "grouped (positional conv)": (8, 12, 5, 1, 2, 1, 4),
    "depthwise": (8, 8, 9, 1, 4, 1, 8),
}


def _conv(op, spatial, weight, stride, padding, dilation, groups) -> tvm.IRModule:
    """``op`` (conv1d or conv2d) of ``x[n, C, *spatial]`` (``n`` symbolic) by ``weight``."""
    channels = weight.shape[1] * groups
    bb = relax.BlockBuilder()
    shape = (tvm.tirx.Var("n", "int64"), channels, *spatial)
    x = relax.Var("x", relax.TensorType(shape, "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            conv = op(x, relax.const(weight), stride, padding, dilation, groups=groups)
            out = bb.emit_output(conv)
        bb.emit_func_output(out)
    return bb.get()


def _conv_module(length, channels, filters, taps, stride, padding, dilation, groups):
    rng = np.random.default_rng(taps)
    weight = rng.standard_normal((filters, channels // groups, taps)).astype("float32") + 0.1
    conv = _conv(relax.op.nn.conv1d, (length,), weight, stride, padding, dilation, groups)
    return conv, weight


def _conv1d(x, weight, stride, padding, dilation, groups):
    """float64 numpy conv1d, NCW / OIW."""
    n, channels, _ = x.shape
    filters, per_group, taps = weight.shape
    xp = np.pad(x.astype("float64"), ((0, 0), (0, 0), (padding, padding)))
    out_width = (xp.shape[2] - dilation * (taps - 1) - 1) // stride + 1
    out = np.zeros((n, filters, out_width))
    per_filter = filters // groups
    for f in range(filters):
        c0 = f // per_filter * per_group
        for t in range(taps):
            start = t * dilation
            window = xp[
                :, c0 : c0 + per_group, start : start + (out_width - 1) * stride + 1 : stride
            ]
            out[:, f] += np.einsum("ncw,c->nw", window, weight[f, :, t])
    return out


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("level", ["O0", "O2"])
def test_symbolic_length_conv1d_matches_numpy(case, level):
    """Each geometry, at two batches and lengths, against float64 numpy; the conv1d is gone
    (it was TVM's generic loops, which no CPU rule schedules) and a matmul took its place."""
    channels, filters, taps, stride, padding, dilation, groups = CASES[case]
    length = tvm.tirx.Var("w", "int64")
    mod, weight = _conv_module(length, channels, filters, taps, stride, padding, dilation, groups)
    ops = op_names(ConvAsGemm()(mod))
    assert "relax.nn.conv1d" not in ops and "relax.matmul" in ops
    kernels = run_front_phases(tvmamp.convert(mod, level, TARGET)).functions_items()
    names = [gvar.name_hint for gvar, func in kernels if isinstance(func, tvm.tirx.PrimFunc)]
    assert not [name for name in names if "conv1d" in name], names
    exe = tvmamp.build(mod, level, TARGET)
    rng = np.random.default_rng(len(case))
    for batch, width in ((2, 40), (1, 77)):
        x = rng.standard_normal((batch, channels, width)).astype("float32")
        ref = _conv1d(x, weight, stride, padding, dilation, groups)
        dtype = "float32" if level == "O0" else "bfloat16"
        tol = tolerance(dtype, np.abs(ref).max())
        assert_close(exe(x), ref, **tol, what=f"{case} {level} {x.shape}")


def test_grouped_conv_over_frames_of_a_strided_conv():
    """wav2vec 2.0's positional conv (grouped, many taps) over the frames of a strided conv,
    a length of ``(w - 40) // 32 + 1``: its gather, fused over every loop outside its vector,
    failed to lower ("padding factor ... is not divisible", TVM's iter-map rewriter), and
    the build stopped. Built at O2 and checked against float64 numpy at two lengths."""
    rng = np.random.default_rng(7)
    first = rng.standard_normal((16, 1, 40)).astype("float32")
    positional = rng.standard_normal((16, 4, 32)).astype("float32") * 0.1
    bb = relax.BlockBuilder()
    x = relax.Var(
        "x",
        relax.TensorType((tvm.tirx.Var("n", "int64"), 1, tvm.tirx.Var("w", "int64")), "float32"),
    )
    with bb.function("main", [x]):
        with bb.dataflow():
            frames = bb.emit(relax.op.nn.conv1d(x, relax.const(first), 32))
            conv = relax.op.nn.conv1d(frames, relax.const(positional), 1, 16, groups=4)
            out = bb.emit_output(conv)
        bb.emit_func_output(out)
    exe = tvmamp.build(bb.get(), "O2", TARGET)
    for batch, width in ((2, 400), (1, 1000)):
        x = rng.standard_normal((batch, 1, width)).astype("float32")
        ref = _conv1d(_conv1d(x, first, 32, 0, 1, 1), positional, 1, 16, 1, 4)
        assert_close(exe(x), ref, **tolerance("bfloat16", np.abs(ref).max()), what=x.shape)


def test_static_and_channel_symbolic_convs_are_left():
    """A static conv1d (Conv1dAsConv2d's) and one with symbolic channels are left as they are."""
    static, _ = _conv_module(40, 4, 6, 3, 1, 1, 1, 1)
    tvm.ir.assert_structural_equal(ConvAsGemm()(static), static)
    bb = relax.BlockBuilder()
    c = tvm.tirx.Var("c", "int64")
    x = relax.Var("x", relax.TensorType((1, c, tvm.tirx.Var("w", "int64")), "float32"))
    w = relax.Var("k", relax.TensorType((6, c, 3), "float32"))
    with bb.function("main", [x, w]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.nn.conv1d(x, w))
        bb.emit_func_output(out)
    mod = bb.get()
    tvm.ir.assert_structural_equal(ConvAsGemm()(mod), mod)


# (channels, filters, kernel, stride, padding, dilation, groups)
CASES_2D = {
    "dense 3x3": (4, 8, 3, 1, 1, 1, 1),
    "strided 3x3, dilated": (6, 10, 3, 2, 2, 2, 1),
    "stem 5x5 stride 2": (3, 8, 5, 2, 2, 1, 1),
    "grouped": (8, 12, 3, 1, 1, 1, 4),
    "depthwise": (8, 8, 3, 2, 1, 1, 8),
    "pointwise": (8, 16, 1, 1, 0, 1, 1),
}


@pytest.mark.parametrize("case", list(CASES_2D))
@pytest.mark.parametrize("level", ["O0", "O2"])
def test_conv2d_over_a_symbolic_height_and_width_matches_torch(case, level):
    """A CNN exported with dynamic image sizes: each conv2d was TVM's loops (a small CNN ran
    300 times slower than its static build). Against torch in float64 at two image sizes;
    no conv2d kernel is left."""
    torch = pytest.importorskip("torch")
    channels, filters, kernel, stride, padding, dilation, groups = CASES_2D[case]
    rng = np.random.default_rng(len(case))
    weight = rng.standard_normal((filters, channels // groups, kernel, kernel)).astype("float32")
    spatial = (tvm.tirx.Var("h", "int64"), tvm.tirx.Var("w", "int64"))
    mod = _conv(relax.op.nn.conv2d, spatial, weight, stride, padding, dilation, groups)
    kernels = run_front_phases(tvmamp.convert(mod, level, TARGET)).functions_items()
    names = [gvar.name_hint for gvar, func in kernels if isinstance(func, tvm.tirx.PrimFunc)]
    assert not [name for name in names if "conv2d" in name], names
    exe = tvmamp.build(mod, level, TARGET)
    for shape in ((2, channels, 13, 11), (1, channels, 9, 16)):
        x = rng.standard_normal(shape).astype("float32")
        ref = torch.nn.functional.conv2d(
            *(torch.from_numpy(a).double() for a in (x, weight)),
            None,
            stride,
            padding,
            dilation,
            groups,
        ).numpy()
        dtype = "float32" if level == "O0" else "bfloat16"
        tol = tolerance(dtype, np.abs(ref).max())
        assert_close(exe(x), ref, **tol, what=f"{case} {level} {shape}")


@pytest.mark.parametrize("mcpu", ["sapphirerapids", "cooperlake"])
def test_builds_for_intel_cpus(mcpu):
    """The gather and GEMM of a symbolic conv build for Intel's AMX and half-rate
    ``vdpbf16ps`` targets (this may run on an AMD host, so it is built, not run): symbolic rows
    never go to AMX, which needs static extents."""
    rng = np.random.default_rng(3)
    weight = rng.standard_normal((16, 4, 5)).astype("float32")
    mod = _conv(relax.op.nn.conv1d, (tvm.tirx.Var("w", "int64"),), weight, 2, 2, 1, 4)
    target = tvm.target.Target({"kind": "llvm", "mcpu": mcpu, "num-cores": 1})
    kernels = run_front_phases(tvmamp.convert(mod, "O2", target)).functions_items()
    names = [gvar.name_hint for gvar, func in kernels if isinstance(func, tvm.tirx.PrimFunc)]
    assert not [name for name in names if "conv1d" in name], names
    tvmamp.build(mod, "O2", target)  # compiles for the target: raises on failure


def test_a_conv_after_an_upsampling_runs_on_the_bf16_gemm(caplog):
    """A U-Net's conv after a 2x upsampling, over ``n * (h * 2) * (w * 2)`` rows: TVM cannot
    prove that the GEMM's padded rows cover them, and the slice of the real rows, fused into
    the GEMM, kept the GEMM rule from scheduling it (a scalar loop at 2 GFLOP/s: 209 of a
    U-Net's 290 ms). Those rows are a view now."""
    import logging

    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(5)
    weight = rng.standard_normal((16, 8, 3, 3)).astype("float32")
    h, w = tvm.tirx.Var("h", "int64"), tvm.tirx.Var("w", "int64")
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((tvm.tirx.Var("n", "int64"), 8, h, w), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            up = bb.emit(relax.op.image.resize2d(x, (h * 2, w * 2), method="nearest_neighbor"))
            conv = relax.op.nn.conv2d(up, relax.const(weight), padding=1)
            out = bb.emit_output(conv)
        bb.emit_func_output(out)
    with caplog.at_level(logging.INFO, logger="tvmamp.schedules"):
        exe = tvmamp.build(
            bb.get(), "O2", "llvm -mcpu=znver4 -mattr=-sse4a -num-cores=1", dtype="bfloat16"
        )
    refused = [r.getMessage() for r in caplog.records if "CPUMatmulBF16 left" in r.getMessage()]
    assert not refused, refused
    for shape in ((2, 8, 5, 7), (1, 8, 6, 3)):
        data = rng.standard_normal(shape).astype("float32")
        up = np.repeat(np.repeat(data, 2, axis=2), 2, axis=3)
        ref = torch.nn.functional.conv2d(
            torch.from_numpy(up).double(), torch.from_numpy(weight).double(), padding=1
        ).numpy()
        assert_close(exe(data), ref, **tolerance("bfloat16", np.abs(ref).max()), what=str(shape))
