"""ConvTransposeToSubPixel: IR before/after, numerics against torch, and what it leaves alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

import tvmamp
from tvmamp.pipeline import front_phases
from tvmamp.relay_passes.conv_transpose import ConvTransposeToSubPixel

_CONV_T = tvm.ir.Op.get("relax.nn.conv2d_transpose")
_CONV = tvm.ir.Op.get("relax.nn.conv2d")


def _rewrite(mod: tvm.IRModule) -> tvm.IRModule:
    out = ConvTransposeToSubPixel()(mod)
    relax.analysis.well_formed(out)
    return out


def _ops(mod: tvm.IRModule) -> list[tvm.ir.Op]:
    ops = []
    relax.analysis.post_order_visit(
        mod["main"], lambda e: ops.append(e.op) if isinstance(e, relax.Call) else None
    )
    return ops


@I.ir_module
class Stride2:
    @R.function
    def main(x: R.Tensor((1, 3, 5, 6), "float32"), w: R.Tensor((3, 2, 4, 4), "float32")):
        with R.dataflow():
            y = R.nn.conv2d_transpose(x, w, strides=2, padding=1)
            R.output(y)
        return y


def _expected_stride2() -> tvm.IRModule:
    """Kernel 4, stride 2, padding 1: four 2x2 convs (residue 0 pads before, 1 after)."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 3, 5, 6), "float32"))
    w = relax.Var("w", relax.TensorType((3, 2, 4, 4), "float32"))
    with bb.function("main", [x, w]):
        with bb.dataflow():
            oihw = bb.emit(relax.op.permute_dims(w, (1, 0, 2, 3)))
            rows = []
            for first_y, pad_y in ((1, (1, 0)), (0, (0, 1))):
                row = []
                for first_x, pad_x in ((1, (1, 0)), (0, (0, 1))):
                    sub = relax.op.strided_slice(
                        oihw, [2, 3], [first_y, first_x], [first_y + 4, first_x + 4], (2, 2)
                    )
                    sub = bb.emit(relax.op.flip(relax.op.flip(sub, 2), 3))
                    pad = (pad_y[0], pad_x[0], pad_y[1], pad_x[1])
                    conv = relax.op.nn.conv2d(x, sub, padding=pad, out_dtype="float32")
                    row.append(bb.emit(conv))
                rows.append(bb.emit(relax.op.stack(row, axis=4)))
            out = bb.emit(relax.op.stack(rows, axis=3))
            out = bb.emit_output(relax.op.reshape(out, (1, 2, 10, 12)))
        bb.emit_func_output(out)
    return bb.get()


def test_stride2_becomes_four_interleaved_convs():
    tvm.ir.assert_structural_equal(_rewrite(Stride2), _expected_stride2())


def _module(shape, w_shape, dtype="float32", **attrs) -> tvm.IRModule:
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(shape, dtype))
    w = relax.Var("w", relax.TensorType(w_shape, dtype))
    with bb.function("main", [x, w]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.nn.conv2d_transpose(x, w, **attrs))
        bb.emit_func_output(out)
    return bb.get()


def _run(mod: tvm.IRModule, *arrays) -> np.ndarray:
    vm = relax.VirtualMachine(relax.build(mod, "llvm"), tvm.cpu())
    return vm["main"](*(tvm.runtime.tensor(a) for a in arrays)).numpy()


CASES = [  # (input, out channels, kernel, stride, padding, output_padding)
    ((2, 3, 5, 7), 4, 3, 2, 1, 1),
    ((1, 5, 6, 5), 3, 4, 2, 1, 0),
    ((1, 3, 5, 4), 2, 3, 3, 1, 1),
    ((1, 2, 4, 5), 3, 4, 3, 1, 2),
    ((1, 3, 5, 5), 2, 4, (3, 2), (2, 1), (1, 1)),
    ((1, 2, 4, 4), 3, 1, 3, 0, 2),  # kernel < stride: some residues get no tap (zeros)
    ((1, 2, 5, 4), 3, 3, 3, 3, 0),  # padding past the kernel: the input is cropped
    ((1, 3, 4, 5), 2, 2, 2, 0, 0),  # kernel = stride: one conv, then depth-to-space
    ((1, 3, 4, 5), 2, 6, 3, 3, 1),  # kernel and padding multiples of the stride: one conv
]


@pytest.mark.parametrize(("shape", "f", "k", "stride", "pad", "out_pad"), CASES)
def test_matches_torch_conv_transpose2d(rng, shape, f, k, stride, pad, out_pad):
    x = rng.standard_normal(shape).astype("float32")
    w = rng.standard_normal((shape[1], f, k, k)).astype("float32")
    attrs = {"strides": stride, "padding": pad, "output_padding": out_pad}
    mod = _rewrite(_module(x.shape, w.shape, **attrs))
    assert _CONV_T not in _ops(mod) and _CONV in _ops(mod)
    ref = torch.nn.functional.conv_transpose2d(
        torch.from_numpy(x), torch.from_numpy(w), stride=stride, padding=pad, output_padding=out_pad
    ).numpy()
    np.testing.assert_allclose(_run(mod, x, w), ref, rtol=1e-5, atol=1e-5)


def test_asymmetric_padding_matches_tvm_legalization(rng):
    x = rng.standard_normal((1, 3, 6, 5)).astype("float32")
    w = rng.standard_normal((3, 4, 4, 3)).astype("float32")
    mod = _module(x.shape, w.shape, strides=(2, 3), padding=(0, 2, 3, 1), output_padding=(1, 2))
    rewritten = _rewrite(mod)
    assert _CONV_T not in _ops(rewritten)
    np.testing.assert_allclose(_run(rewritten, x, w), _run(mod, x, w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("k", "stride", "pad", "convs"), [(2, 2, 0, 1), (4, 2, 2, 1), (4, 2, 1, 4)]
)
def test_residues_reading_one_window_share_one_conv(k, stride, pad, convs):
    mod = _rewrite(_module((1, 3, 5, 6), (3, 2, k, k), strides=stride, padding=pad))
    assert _ops(mod).count(_CONV) == convs


@pytest.mark.parametrize(
    "attrs",
    [
        {"strides": 1, "padding": 1},  # no zeros to skip
        {"strides": 2, "padding": 1, "groups": 2},
        {"strides": 2, "padding": 1, "dilation": 2},
    ],
    ids=["stride1", "grouped", "dilated"],
)
def test_unhandled_transposed_convs_are_left_alone(attrs):
    mod = _module((1, 4, 5, 5), (4, 2, 3, 3), **attrs)
    tvm.ir.assert_structural_equal(_rewrite(mod), mod)


def _bias_relu_model(c=6, f=5, k=3, stride=2, pad=1, out_pad=1) -> torch.nn.Module:
    torch.manual_seed(0)
    conv = torch.nn.ConvTranspose2d(c, f, k, stride, pad, output_padding=out_pad)
    return torch.nn.Sequential(conv, torch.nn.ReLU()).eval()


def _relax_of(model: torch.nn.Module, shape) -> tvm.IRModule:
    conv = model[0]
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(shape, "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = relax.op.nn.conv2d_transpose(
                x, relax.const(conv.weight.detach().numpy()), strides=conv.stride,
                padding=conv.padding, output_padding=conv.output_padding,
            )  # fmt: skip
            bias = relax.const(conv.bias.detach().numpy().reshape(1, -1, 1, 1))
            out = bb.emit_output(relax.op.nn.relu(relax.op.add(y, bias)))
        bb.emit_func_output(out)
    return bb.get()


def _kernels(mod: tvm.IRModule, level: str, target: str) -> list[str]:
    """The names of the kernels after the build's partition, legalize and fuse phases."""
    converted = tvmamp.convert(mod, level, target)
    with converted.target:
        phases = front_phases(converted.target, converted.entry, converted.policy)
        fused = tvm.transform.Sequential(phases)(converted.mod)
    return [gv.name_hint for gv in fused.get_global_vars()]


@pytest.mark.parametrize(("level", "tol"), [("O0", 1e-5), ("O2", 1e-2)])
def test_built_model_has_no_dilated_conv_and_matches_torch(rng, level, tol):
    model, shape = _bias_relu_model(), (1, 6, 7, 9)
    x = rng.standard_normal(shape).astype("float32")
    target = "llvm -num-cores=1"
    names = _kernels(_relax_of(model, shape), level, target)
    assert not any("conv2d_transpose" in n for n in names), names
    exe = tvmamp.build(_relax_of(model, shape), level, target)
    with torch.no_grad():
        ref = model(torch.from_numpy(x)).numpy()
    out = np.asarray(exe(x), "float64")
    assert np.abs(out - ref).max() / np.abs(ref).max() <= tol


@pytest.mark.parametrize(("level", "tol"), [("O0", 1e-5), ("O2", 1e-2)])
def test_symbolic_batch_is_rewritten_and_matches_torch(rng, level, tol):
    """A dynamic batch axis: TVM's dilated conv ran a transposed conv2d 2.8x (conv1d 9x)
    slower than the static build. Built once, run at batches 1 and 3."""
    model = _bias_relu_model()
    mod = _relax_of(model, (tvm.tirx.Var("n", "int64"), 6, 7, 9))
    target = "llvm -num-cores=1"
    names = _kernels(mod, level, target)
    assert not any("conv2d_transpose" in n for n in names), names
    exe = tvmamp.build(mod, level, target)
    for batch in (1, 3):
        x = rng.standard_normal((batch, 6, 7, 9)).astype("float32")
        with torch.no_grad():
            ref = model(torch.from_numpy(x)).numpy()
        out = np.asarray(exe(x), "float64")
        assert out.shape == ref.shape
        assert np.abs(out - ref).max() / np.abs(ref).max() <= tol
