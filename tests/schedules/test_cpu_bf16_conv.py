"""bf16 convs on NHWC rows: the im2col gather, chained convs with batch-norm and residuals."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import tvm
from tvm import relax

import tvmamp
import tvmamp.models
from tvmamp.pipeline import front_phases
from tvmamp.relay_passes.conv2d_im2col import Geometry, emit_im2col, emit_run_im2col, run_length
from tvmamp.targets.llvm import _host_flags

BF16 = "bfloat16"
AMX = "llvm -mcpu=sapphirerapids -num-cores=1"
TARGETS = [
    pytest.param(
        "llvm -mcpu=znver4 -mattr=-sse4a -num-cores=1", "vdpbf16ps", "avx512_bf16", id="vdpbf16ps"
    ),
    pytest.param(AMX, "tdpbf16ps", "amx_bf16", id="amx"),
]


def _needs_host(flag: str) -> None:
    if flag not in _host_flags():
        pytest.skip(f"the host CPU lacks {flag}")


class _Attrs:
    def __init__(self, stride, dilation, pad):
        self.strides, self.dilation, self.padding = stride, dilation, pad


def _numpy_im2col(x: np.ndarray, g: Geometry) -> np.ndarray:
    """Reference gather from NCHW ``x``: rows are output pixels, columns (ky, kx, c)."""
    pt, pl, pb, pr = g.pad
    padded = np.pad(x, ((0, 0), (0, 0), (pt, pb), (pl, pr)))
    cols = np.empty((g.n, g.out_h, g.out_w, g.kh, g.kw, g.c), x.dtype)
    for ky in range(g.kh):
        for kx in range(g.kw):
            y0, x0 = ky * g.dilation[0], kx * g.dilation[1]
            win = padded[:, :, y0 : y0 + g.stride[0] * g.out_h : g.stride[0]]
            win = win[:, :, :, x0 : x0 + g.stride[1] * g.out_w : g.stride[1]]
            cols[:, :, :, ky, kx, :] = win.transpose(0, 2, 3, 1)
    return cols.reshape(g.n * g.out_h * g.out_w, g.kh * g.kw * g.c)


@pytest.mark.parametrize(
    ("shape", "kernel", "stride", "dilation", "pad"),
    [
        ((2, 3, 9, 7), (3, 3), (2, 2), (2, 1), (0, 1, 2, 1)),  # odd channels, asymmetric
        ((1, 64, 6, 5), (3, 3), (1, 1), (1, 1), (1, 1, 1, 1)),  # two vectors per tap
        ((1, 40, 5, 5), (5, 3), (1, 2), (1, 1), (2, 1, 2, 1)),  # channels not a vector multiple
    ],
)
def test_im2col_gather_matches_numpy(rng, shape, kernel, stride, dilation, pad):
    n, c, h, w = shape
    g = Geometry.of(_Attrs(stride, dilation, pad), list(shape), [1, c, *kernel])
    bb = relax.BlockBuilder()
    rows = relax.Var("rows", relax.TensorType((n * h * w, c), BF16))
    with bb.function("main", [rows]):
        with bb.dataflow():
            out = bb.emit_output(emit_im2col(bb, rows, g))
        bb.emit_func_output(out)
    x = rng.standard_normal(shape).astype(ml_dtypes.bfloat16)
    exe = tvmamp.build(bb.get(), "O0", "llvm -num-cores=1")
    got = np.asarray(exe(x.transpose(0, 2, 3, 1).reshape(n * h * w, c)))
    np.testing.assert_array_equal(got.astype("float32"), _numpy_im2col(x, g).astype("float32"))


@pytest.mark.parametrize(
    ("shape", "kernel", "stride", "pad"),
    [
        ((2, 3, 13, 11), (7, 7), (2, 2), (3, 3, 3, 3)),  # an RGB stem: runs of 21, one zero
        ((1, 5, 6, 7), (3, 2), (1, 2), (0, 1, 2, 1)),  # even runs of 10, asymmetric padding
        ((1, 1, 9, 8), (5, 5), (1, 1), (2, 2, 2, 2)),  # one channel
    ],
)
def test_run_im2col_matches_numpy(rng, shape, kernel, stride, pad):
    n, c, h, w = shape
    g = Geometry.of(_Attrs(stride, (1, 1), pad), list(shape), [1, c, *kernel])
    bb = relax.BlockBuilder()
    rows = relax.Var("rows", relax.TensorType((n * h * w, c), BF16))
    with bb.function("main", [rows]):
        with bb.dataflow():
            out = bb.emit_output(emit_run_im2col(bb, rows, g))
        bb.emit_func_output(out)
    x = (rng.uniform(0.5, 1.5, shape) * rng.choice([-1, 1], shape)).astype(ml_dtypes.bfloat16)
    exe = tvmamp.build(bb.get(), "O0", "llvm -num-cores=1")
    got = np.asarray(exe(x.transpose(0, 2, 3, 1).reshape(n * h * w, c)), "float32")
    run = run_length(g)
    assert run % 2 == 0 and got.shape == (n * g.out_h * g.out_w, g.kh * run)
    got = got.reshape(-1, g.kh, run)
    ref = _numpy_im2col(x, g).astype("float32").reshape(-1, g.kh, g.kw * c)
    np.testing.assert_array_equal(got[:, :, : g.kw * c], ref)
    assert not got[:, :, g.kw * c :].any()  # the pair's rounding: zeros


@pytest.mark.parametrize(("target", "instruction", "flag"), TARGETS)
@pytest.mark.parametrize(  # at least 32 output pixels, so that AMX runs them
    ("c", "f", "size", "kernel", "stride", "pad"),
    [
        (3, 20, (23, 21), (7, 7), 2, 3),  # an RGB stem
        (1, 9, (12, 11), (5, 5), 1, 2),  # one channel
        (5, 17, (10, 13), (3, 2), 2, (0, 1, 2, 1)),  # asymmetric kernel and padding
        (24, 33, (9, 8), (3, 3), 1, 1),  # below gather_channels, runs of 72
    ],
)
def test_narrow_conv_gathers_kernel_rows_and_matches_numpy(
    rng, target, instruction, flag, c, f, size, kernel, stride, pad
):
    _needs_host(flag)
    mod, w = _single_conv(c, f, size, kernel, stride, pad)
    pads = (pad,) * 4 if isinstance(pad, int) else pad
    g = Geometry.of(_Attrs((stride,) * 2, (1, 1), pads), [1, c, *size], list(w.shape))
    x = (rng.uniform(0.5, 1.5, (1, c, *size)) * rng.choice([-1, 1], (1, c, *size))).astype(
        "float32"
    )
    exe = tvmamp.build(mod, "O2", target, BF16)
    assert instruction in exe.get_source("asm")
    names = [gv.name_hint for gv in _scheduled(mod, target).get_global_vars()]
    assert "im2col_runs" in names, names
    cols = _numpy_im2col(x.astype("float64"), g)
    ref = cols @ w.transpose(2, 3, 1, 0).reshape(-1, f).astype("float64")
    ref = ref.reshape(1, g.out_h, g.out_w, f).transpose(0, 3, 1, 2)
    np.testing.assert_allclose(
        np.asarray(exe(x), "float64"), ref, rtol=2e-2, atol=2e-2 * np.abs(ref).max()
    )


def test_stem_builds_for_amx_with_the_run_gather():
    """Build only (any host): a 7x7 RGB stem gathers kernel rows into a tdpbf16ps GEMM."""
    mod, _ = _single_conv(3, 64, (32, 32), (7, 7), 2, 3)
    exe = tvmamp.build(mod, "O2", {"kind": "llvm", "mcpu": "sapphirerapids"}, BF16)
    asm = exe.get_source("asm")
    assert "tdpbf16ps" in asm and "im2col_runs" in asm


def _conv_chain(rng, n=2, c=5, f=33, size=(11, 9)):
    """conv 3x3 + BN + relu, conv stride 2 + bias, conv + residual + relu, max-pool; fp32."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((n, c, *size), "float32"))

    def const(*shape, scale=1.0, offset=0.0):
        return relax.const((rng.standard_normal(shape) * scale + offset).astype("float32"))

    def conv(data, c_in, c_out, **kw):
        w = const(c_out, c_in, 3, 3, scale=1 / np.sqrt(9 * c_in))
        return bb.emit(relax.op.nn.conv2d(data, w, padding=1, **kw))

    with bb.function("main", [x]):
        with bb.dataflow():
            y = conv(x, c, 7)
            bn = relax.op.nn.batch_norm(
                y, const(7, scale=0.1, offset=1.0), const(7, scale=0.1), const(7, scale=0.1),
                relax.const(rng.uniform(0.5, 1.5, 7).astype("float32")), axis=1, training=False,
            )  # fmt: skip
            y = bb.emit(relax.op.nn.relu(bb.emit(relax.TupleGetItem(bb.emit(bn), 0))))
            y = bb.emit(relax.op.add(conv(y, 7, f, strides=2), const(1, f, 1, 1)))
            z = bb.emit(relax.op.nn.relu(bb.emit(relax.op.add(conv(y, f, f), y))))
            pool = bb.emit(relax.op.nn.max_pool2d(z, pool_size=[2, 2], strides=[2, 2]))
            out = bb.emit_output(relax.Tuple([pool, z]))
        bb.emit_func_output(out)
    return bb.get()


@pytest.mark.parametrize(("target", "instruction", "flag"), TARGETS)
def test_conv_chain_matches_fp32(rng, target, instruction, flag):
    _needs_host(flag)
    mod = _conv_chain(rng)
    x = rng.standard_normal((2, 5, 11, 9)).astype("float32")
    refs = tvmamp.build(mod, "O0", target)(x)
    exe = tvmamp.build(mod, "O2", target, BF16)
    assert instruction in exe.get_source("asm")
    for out, ref in zip(exe(x), refs, strict=True):
        err = np.abs(np.asarray(out, "float64") - ref).max() / np.abs(ref).max()
        assert err <= 1e-2


def _kernels(mod, params, target: str) -> list[str]:
    """The names of the kernels ``main`` calls after fusion, in order."""
    converted = tvmamp.convert(mod, "O2", target, BF16, params=params)
    with converted.target:
        phases = front_phases(converted.target, converted.entry, converted.policy)
        fused = tvm.transform.Sequential(phases)(converted.mod)
    names = []

    def visit(expr):
        if (
            isinstance(expr, relax.Call)
            and expr.args
            and isinstance(expr.args[0], tvm.ir.GlobalVar)
        ):
            names.append(expr.args[0].name_hint)

    relax.analysis.post_order_visit(fused["main"], visit)
    return names


def test_convnet_fuses_epilogues_and_transposes_only_the_input():
    mod, params = tvmamp.models.conv_net(channels=16, size=12, blocks=3)
    kernels = _kernels(mod, params, AMX)
    # conv + bias + batch-norm (folded to scale and shift) + relu: one kernel per conv
    gemms = [k for k in kernels if k.startswith("fused_matmul") and "_relu" in k]
    assert len(gemms) == 3, kernels
    # 16 channels (below gather_channels): each conv gathers whole kernel rows.
    gathers = [k for k in kernels if "im2col" in k]
    assert gathers == ["im2col_runs", "im2col_runs1", "im2col_runs1"], kernels
    # The input; the global average pool reads the rows, so the output needs no transpose.
    assert sum("transpose" in k for k in kernels) == 1, kernels


def test_convnet_model_matches_fp32(rng):
    _needs_host("amx_bf16")
    mod, params = tvmamp.models.conv_net(channels=32, size=14, blocks=3)
    x = rng.standard_normal((1, 3, 14, 14)).astype("float32")
    ref = tvmamp.build(mod, "O0", AMX, params=params)(x)
    exe = tvmamp.build(mod, "O2", AMX, BF16, params=params)
    assert "tdpbf16ps" in exe.get_source("asm")
    err = np.abs(np.asarray(exe(x), "float64") - ref).max() / np.abs(ref).max()
    assert err <= 1e-2


def _single_conv(c, f, size, kernel, stride, pad):
    """One fp32 conv2d (no bias) on ``[1, c, *size]``; returns the module and its weight."""
    w = np.random.default_rng(7).standard_normal((f, c, *kernel)).astype("float32")
    w /= np.sqrt(c * kernel[0] * kernel[1])
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, c, *size), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            conv = relax.op.nn.conv2d(x, relax.const(w), strides=stride, padding=pad)
            out = bb.emit_output(conv)
        bb.emit_func_output(out)
    return bb.get(), w


def _force_fused_gather(monkeypatch) -> None:
    """Make the pipeline fuse the gather into the GEMM for any channel count."""
    import tvmamp.relay_passes.conv2d_to_gemm as conv2d_to_gemm

    rewrite = conv2d_to_gemm.Conv2dToGemm
    monkeypatch.setattr(
        conv2d_to_gemm,
        "Conv2dToGemm",
        lambda dtype, **options: rewrite(dtype, gather_channels=1, **options),
    )


@pytest.mark.parametrize(("target", "instruction", "flag"), TARGETS)
@pytest.mark.parametrize(  # at least 32 output pixels, so that AMX runs them
    ("c", "f", "size", "kernel", "stride", "pad"),
    [
        (64, 40, (9, 8), (3, 3), 1, 1),  # two 32-channel vectors per tap; F not a tile multiple
        (32, 33, (15, 13), (3, 3), 2, 1),  # stride 2, odd sizes
        (5, 7, (13, 11), (3, 3), 2, (0, 1, 2, 1)),  # odd channels (forced), asymmetric padding
        (32, 16, (16, 16), (1, 1), 2, 0),  # a strided 1x1 (ResNet's downsample) gathers too
    ],
)
def test_fused_gather_conv_matches_numpy(
    rng, monkeypatch, target, instruction, flag, c, f, size, kernel, stride, pad
):
    _needs_host(flag)
    _force_fused_gather(monkeypatch)
    mod, w = _single_conv(c, f, size, kernel, stride, pad)
    pads = (pad,) * 4 if isinstance(pad, int) else pad
    g = Geometry.of(_Attrs((stride,) * 2, (1, 1), pads), [1, c, *size], list(w.shape))
    x = rng.standard_normal((1, c, *size)).astype("float32")
    exe = tvmamp.build(mod, "O2", target, BF16)
    assert instruction in exe.get_source("asm")
    assert not any("im2col" in gv.name_hint for gv in _scheduled(mod, target).get_global_vars())
    cols = _numpy_im2col(x.astype("float64"), g)
    ref = cols @ w.transpose(2, 3, 1, 0).reshape(-1, f).astype("float64")
    ref = ref.reshape(1, g.out_h, g.out_w, f).transpose(0, 3, 1, 2)
    err = np.abs(np.asarray(exe(x), "float64") - ref).max() / np.abs(ref).max()
    assert err <= 1e-2


COOPERLAKE = "llvm -mcpu=cooperlake -num-cores=1"  # Intel avx512_bf16 without AMX


def test_intel_without_amx_keeps_direct_convs_on_fp32_fma(rng):
    """vdpbf16ps runs at half the fp32 FMA rate there (Emerald Rapids with AMX off: the conv net
    at O2 took 17.6 ms against fp32's 7.2): bf16 convs stay direct convs, widened to fp32 FMAs,
    instead of im2col GEMMs on vdpbf16ps. With AMX they still become GEMMs."""
    _needs_host("avx512_bf16")
    mod = _conv_chain(rng)
    x = rng.standard_normal((2, 5, 11, 9)).astype("float32")
    exe = tvmamp.build(mod, "O2", COOPERLAKE, BF16)
    asm = exe.get_source("asm")
    assert "vdpbf16ps" not in asm and "vfmadd" in asm
    kernels = {
        t: [gv.name_hint for gv in _scheduled(mod, t).get_global_vars()] for t in (COOPERLAKE, AMX)
    }
    assert (
        sum("conv2d" in k for k in kernels[COOPERLAKE]) == 3 and "im2col" not in kernels[COOPERLAKE]
    )
    assert "im2col" in kernels[AMX] and not any("conv2d" in k for k in kernels[AMX])
    for out, ref in zip(exe(x), tvmamp.build(mod, "O0", COOPERLAKE)(x), strict=True):
        assert np.abs(np.asarray(out, "float64") - ref).max() / np.abs(ref).max() <= 1e-2


def _scheduled(mod, target: str, params=None) -> tvm.IRModule:
    """``mod`` converted at O2 bf16, fused, scheduled and with its packing split out."""
    converted = tvmamp.convert(mod, "O2", target, BF16, params=params)
    with converted.target:
        phases = [
            *front_phases(converted.target, converted.entry, converted.policy),
            *converted.entry.schedule_passes(converted.target),
        ]
        return tvm.transform.Sequential(phases)(converted.mod)


def _calls(mod: tvm.IRModule) -> list[tuple[str, list[list[int]], list[int]]]:
    """``(kernel name, argument shapes, output shape)`` of each ``call_tir`` of ``main``."""
    calls = []

    def visit(expr):
        if isinstance(expr, relax.Call) and expr.op == tvm.ir.Op.get("relax.call_tir"):
            shapes = [[int(d) for d in a.ty.shape] for a in expr.args[1].fields]
            calls.append((expr.args[0].name_hint, shapes, [int(d) for d in expr.ty.shape]))

    relax.analysis.post_order_visit(mod["main"], visit)
    return calls


@pytest.mark.parametrize(
    "target", [AMX, "llvm -mcpu=znver4 -mattr=-sse4a -num-cores=1"], ids=["amx", "avx512"]
)
def test_one_activation_copy_per_conv(target):
    mod, params = tvmamp.models.conv_net(channels=32, size=16, blocks=3)
    calls = _calls(_scheduled(mod, target, params))
    # Only the first conv (C = 3, below gather_channels) keeps a gather kernel of its own.
    assert [name for name, _, _ in calls if "im2col" in name] == ["im2col_runs"], calls
    convs = [call for call in calls if "conv2d_gemm" in call[0]]
    copies = [call for call in convs if call[0].endswith("_weight_prepack")]  # split out
    gemms = [call for call in convs if not call[0].endswith("_weight_prepack")]
    assert len(gemms) == 2 and len(copies) == 2, calls  # convs 2 and 3 (conv 1 has C = 3)
    for _, (source,), packed in copies:
        assert source == [16 * 16, 32], calls  # read straight from the rows [n*h*w, c] ...
        if target == AMX:  # ... into whole 16 x 32 AMX tiles of the 256 x 288 im2col matrix
            assert packed == [1, 256 // 16, 288 // 32, 16, 32], calls
    for (_, _, packed), (_, (operand, *_), _) in zip(copies, gemms, strict=True):
        assert operand == packed, calls  # and the GEMM reads that copy
