"""Transposed convs on rows (Conv2dToGemm + conv_transpose_gemm): IR, numerics, what is left."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import tvm
from tvm import relax

import tvmamp
from tvmamp.relay_passes.conv2d_to_gemm import Conv2dToGemm
from tvmamp.relay_passes.conv_transpose import ConvTransposeToSubPixel
from tvmamp.relay_passes.conv_transpose_gemm import TransposeGeometry, emit_col2im
from tvmamp.targets.llvm import _host_flags

BF16 = "bfloat16"
_CONV_T = tvm.ir.Op.get("relax.nn.conv2d_transpose")
TARGETS = [
    pytest.param("llvm -mcpu=znver4 -mattr=-sse4a -num-cores=1", "avx512_bf16", id="vdpbf16ps"),
    pytest.param("llvm -mcpu=sapphirerapids -num-cores=1", "amx_bf16", id="amx"),
]
# (input, out channels, kernel, stride, padding (top, left, bottom, right), output_padding)
CASES = [
    ((1, 5, 6, 5), 7, (3, 3), (3, 3), (1, 1, 1, 1), (0, 0)),  # one tap per residue, cropped
    ((2, 3, 5, 7), 9, (2, 2), (3, 3), (0, 0, 0, 0), (1, 2)),  # kernel < stride: zero rows
    ((1, 6, 7, 6), 5, (4, 4), (2, 2), (1, 1, 1, 1), (0, 0)),  # two taps per axis (DCGAN)
    ((1, 5, 5, 5), 3, (3, 3), (2, 2), (1, 1, 1, 1), (1, 1)),  # kernel not a stride multiple
    ((1, 4, 6, 7), 17, (3, 2), (2, 3), (0, 2, 3, 1), (1, 2)),  # non-square, asymmetric
    ((1, 3, 4, 5), 4, (1, 1), (2, 2), (0, 0, 0, 0), (0, 0)),  # 1x1: three quarters zeros
    ((1, 3, 5, 4), 6, (2, 2), (1, 1), (1, 1, 0, 0), (0, 0)),  # stride 1
    ((1, 2, 5, 4), 3, (3, 3), (3, 3), (3, 3, 3, 3), (0, 0)),  # padding past the kernel
]


def _module(shape, w, dtype, stride, pad, out_pad, bias=None) -> tvm.IRModule:
    """One conv2d_transpose of a ``dtype`` input by the weight ``w`` (+ bias, ReLU)."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(shape, dtype))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = relax.op.nn.conv2d_transpose(
                x,
                relax.const(w.astype(dtype)),
                strides=stride,
                padding=pad,
                output_padding=out_pad,
                out_dtype="float32",
            )
            if bias is not None:
                y = relax.op.nn.relu(relax.op.add(bb.emit(y), relax.const(bias)))
            out = bb.emit_output(y)
        bb.emit_func_output(out)
    return bb.get()


def _torch(x, w, stride, pad, out_pad, bias=None) -> np.ndarray:
    """torch's conv_transpose2d in float64; asymmetric padding cropped from a padding-0 one."""
    full = torch.nn.functional.conv_transpose2d(
        torch.from_numpy(x.astype("float64")), torch.from_numpy(w.astype("float64")), stride=stride
    ).numpy()
    oh = (x.shape[2] - 1) * stride[0] - pad[0] - pad[2] + w.shape[2] + out_pad[0]
    ow = (x.shape[3] - 1) * stride[1] - pad[1] - pad[3] + w.shape[3] + out_pad[1]
    out = np.zeros((*full.shape[:2], oh, ow))
    crop = full[:, :, pad[0] : pad[0] + oh, pad[1] : pad[1] + ow]  # output_padding: zeros
    out[:, :, : crop.shape[2], : crop.shape[3]] = crop
    return out if bias is None else np.maximum(out + bias, 0)


def _data(rng, shape, f, kernel):
    x = rng.uniform(0.5, 1.5, shape) * rng.choice([-1, 1], shape)  # never zero
    w = rng.standard_normal((shape[1], f, *kernel)) / np.sqrt(shape[1])
    return x.astype("float32"), w.astype("float32")


def _run(mod: tvm.IRModule, x: np.ndarray) -> np.ndarray:
    vm = relax.VirtualMachine(relax.build(mod, "llvm"), tvm.cpu())
    return vm["main"](tvm.runtime.tensor(x)).numpy()


@pytest.mark.parametrize(("dtype", "rtol"), [("float32", 1e-5), ("float16", 2e-3)])
@pytest.mark.parametrize(("shape", "f", "kernel", "stride", "pad", "out_pad"), CASES)
def test_gemm_and_col2im_match_torch(rng, dtype, rtol, shape, f, kernel, stride, pad, out_pad):
    x, w = _data(rng, shape, f, kernel)
    mod = Conv2dToGemm(dtype)(_module(shape, w, dtype, stride, pad, out_pad))
    relax.analysis.well_formed(mod)
    assert "col2im" in [gv.name_hint for gv in mod.get_global_vars()]
    ref = _torch(x.astype(dtype), w.astype(dtype), stride, pad, out_pad)
    out = _run(mod, x.astype(dtype))
    assert out.shape == ref.shape
    np.testing.assert_allclose(out, ref, rtol=rtol, atol=rtol * np.abs(ref).max())


@pytest.mark.parametrize(("target", "flag"), TARGETS)
@pytest.mark.parametrize(("shape", "f", "kernel", "stride", "pad", "out_pad"), CASES[:5])
def test_o2_bf16_matches_torch(rng, target, flag, shape, f, kernel, stride, pad, out_pad):
    if flag not in _host_flags():
        pytest.skip(f"the host CPU lacks {flag}")
    x, w = _data(rng, shape, f, kernel)
    bias = rng.uniform(-0.5, 0.5, (1, f, 1, 1)).astype("float32")
    mod = _module(shape, w, "float32", stride, pad, out_pad, bias)
    out = np.asarray(tvmamp.build(mod, "O2", target, BF16)(x), "float64")
    ref = _torch(x, w, stride, pad, out_pad, bias)
    np.testing.assert_allclose(out, ref, rtol=2e-2, atol=2e-2 * np.abs(ref).max())


def test_builds_for_amx_with_the_col2im_kernel(rng):
    """Build only (any host): the transposed conv is a tdpbf16ps GEMM and a col2im gather."""
    x, w = _data(rng, (1, 32, 9, 8), 48, (3, 3))
    mod = _module(x.shape, w, "float32", (3, 3), (1, 1, 1, 1), (0, 0))
    asm = tvmamp.build(mod, "O2", {"kind": "llvm", "mcpu": "sapphirerapids"}, BF16).get_source(
        "asm"
    )
    assert "tdpbf16ps" in asm and "col2im" in asm


def _expected_rows(x_shape, w_bf16: relax.Constant, g: TransposeGeometry) -> tvm.IRModule:
    """Input rows @ ``W2[c, (ky, kx, f)]``, col2im, ReLU on rows, one transpose to NCHW."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(x_shape, BF16))
    with bb.function("main", [x]):
        with bb.dataflow():
            rows = relax.op.reshape(relax.op.permute_dims(x, (0, 2, 3, 1)), (g.h * g.w, g.c))
            w2 = w_bf16.value.numpy().transpose(0, 2, 3, 1).reshape(g.c, -1)
            products = relax.op.matmul(bb.emit(rows), relax.const(w2), out_dtype="float32")
            y = emit_col2im(bb, bb.emit(products), g)
            y = bb.emit(relax.op.nn.relu(y))
            nhwc = bb.emit(relax.op.reshape(y, (1, g.out_h, g.out_w, g.f)))
            out = bb.emit_output(relax.op.permute_dims(nhwc, (0, 3, 1, 2)))
        bb.emit_func_output(out)
    return bb.get()


def test_transposed_conv_becomes_a_gemm_and_col2im_on_rows(rng):
    _, w = _data(rng, (1, 3, 4, 5), 2, (2, 2))
    weight = relax.const(w.astype(BF16))
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 3, 4, 5), BF16))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(relax.op.nn.conv2d_transpose(x, weight, strides=2, out_dtype="float32"))
            out = bb.emit_output(relax.op.nn.relu(y))
        bb.emit_func_output(out)
    g = TransposeGeometry(1, 3, 4, 5, 2, 2, 2, (2, 2), (0, 0), 8, 10)
    expected = _expected_rows((1, 3, 4, 5), weight, g)
    tvm.ir.assert_structural_equal(Conv2dToGemm(BF16)(bb.get()), expected)


@pytest.mark.parametrize(
    ("kernel", "attrs"),
    [
        ((5, 5), {"strides": 2}),  # 9 taps per output pixel: more than max_transpose_taps
        ((2, 2), {"strides": 2, "groups": 2}),
        ((2, 2), {"strides": 2, "dilation": 2}),
    ],
)
def test_unhandled_transposed_convs_are_left_alone(rng, kernel, attrs):
    w = rng.standard_normal((4, 4 // attrs.get("groups", 1), *kernel)).astype(BF16)
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 4, 5, 5), BF16))
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.nn.conv2d_transpose(x, relax.const(w), **attrs))
        bb.emit_func_output(out)
    mod = bb.get()
    rewrite = Conv2dToGemm(BF16)
    assert not rewrite.rewrites(mod["main"].body.blocks[0].bindings[0].value)
    tvm.ir.assert_structural_equal(rewrite(mod), mod)


def test_sub_pixel_rewrite_leaves_what_the_gemm_pass_claims(rng):
    _, w = _data(rng, (1, 3, 4, 5), 2, (3, 3))
    mod = _module((1, 3, 4, 5), w, BF16, (3, 3), (1, 1, 1, 1), (0, 0))
    claimed = ConvTransposeToSubPixel(leave=Conv2dToGemm(BF16).rewrites)(mod)
    tvm.ir.assert_structural_equal(claimed, mod)
    rewritten = ConvTransposeToSubPixel()(mod)
    calls = []
    relax.analysis.post_order_visit(
        rewritten["main"], lambda e: calls.append(e.op) if isinstance(e, relax.Call) else None
    )
    assert _CONV_T not in calls


def test_max_transpose_taps_must_be_positive():
    with pytest.raises(ValueError, match="max_transpose_taps=0 is not a positive int"):
        Conv2dToGemm(BF16, max_transpose_taps=0)
