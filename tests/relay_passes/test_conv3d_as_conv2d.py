"""Conv3dAsConv2d: 3-D convolutions as 2-D ones over folded depth windows."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import tvm
from tolerances import assert_close, tolerance
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

import tvmamp
from tvmamp.relay_passes.conv3d_as_conv2d import Conv3dAsConv2d


def _ops(mod) -> set[str]:
    found = set()
    relax.analysis.post_order_visit(
        mod["main"], lambda e: found.add(e.op.name) if isinstance(e, relax.Call) else None
    )
    return found


# (in, out, kernel, stride, padding, dilation, groups, input shape)
CASES = [
    (3, 8, 3, 1, (1, 2, 0), 1, 1, (2, 3, 6, 9, 8)),  # per-axis padding, batch 2
    (8, 12, (3, 1, 3), (2, 1, 2), 1, (2, 1, 1), 4, (1, 8, 9, 7, 10)),  # grouped, dilated depth
    (6, 6, 2, 2, 0, 1, 6, (1, 6, 4, 6, 6)),  # depthwise, stride 2
    (19, 16, 3, 2, 1, 1, 1, (1, 19, 5, 12, 12)),  # odd channels, stride 2
]


@pytest.mark.parametrize("level", ["O0", "O2"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_conv3d_matches_torch(case, level):
    cin, cout, k, s, p, d, g, shape = case
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv3d(cin, cout, k, s, p, d, g), torch.nn.ReLU())
    _check_rewritten(model.eval(), shape, "relax.nn.conv3d", level, case)


def _check_rewritten(model, shape, op: str, level: str, case) -> None:
    """``model`` on a random ``shape`` input: ``op`` is rewritten away, and the ``level``
    build matches torch within its dtype's tolerance."""
    x = torch.randn(shape)
    with torch.no_grad():
        ref = model(x).numpy()
    mod, params = tvmamp.from_torch(model, (x,))
    assert op not in _ops(Conv3dAsConv2d()(mod))
    exe = tvmamp.build(mod, level, "llvm", params=params)
    out = exe.vm["main"](tvm.runtime.tensor(x.numpy(), exe.device)).numpy()
    dtype = "float32" if level == "O0" else exe.policy.low_dtype
    assert_close(out, ref, **tolerance(dtype, np.abs(ref).max()), what=f"{case} {level}")


def test_dynamic_depth_is_left_alone():
    @tvm.script.ir_module
    class Dynamic:
        @R.function
        def main(
            x: R.Tensor((1, 2, "d", 4, 4), "float32"), w: R.Tensor((3, 2, 3, 3, 3), "float32")
        ):
            with R.dataflow():
                y = R.nn.conv3d(x, w, padding=1)
                R.output(y)
            return y

    tvm.ir.assert_structural_equal(Conv3dAsConv2d()(Dynamic), Dynamic)


@pytest.mark.parametrize("level", ["O0", "O2"])
@pytest.mark.parametrize("case", CASES[:2], ids=str)
def test_conv3d_over_a_symbolic_batch_matches_torch(case, level):
    """A dynamic batch axis: TVM's conv3d loops ran 20x slower than the static build. Built
    once, run at batches 1 and 3."""
    cin, cout, k, s, p, d, g, shape = case
    torch.manual_seed(0)
    conv = torch.nn.Conv3d(cin, cout, k, s, p, d, g).eval()
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((tvm.tirx.Var("n", "int64"), *shape[1:]), "float32"))
    weight, bias = (relax.const(t.detach().numpy()) for t in (conv.weight, conv.bias))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = relax.op.nn.conv3d(x, weight, conv.stride, conv.padding, conv.dilation, g)
            y = bb.emit_output(relax.op.add(y, relax.op.reshape(bias, (1, cout, 1, 1, 1))))
        bb.emit_func_output(y)
    mod = bb.get()
    assert "relax.nn.conv3d" not in _ops(Conv3dAsConv2d()(mod))
    exe = tvmamp.build(mod, level, "llvm")
    dtype = "float32" if level == "O0" else exe.policy.low_dtype
    for batch in (1, 3):
        data = torch.randn((batch, *shape[1:]))
        with torch.no_grad():
            ref = conv(data).numpy()
        out = np.asarray(exe(data.numpy()))
        assert_close(out, ref, **tolerance(dtype, np.abs(ref).max()), what=f"{case} {batch}")


def test_a_dense_conv_folds_each_frame_as_a_contiguous_run_of_channels():
    """Channel ``kd * C + c``: the copy that feeds the 2-D conv's rows moves whole frames of
    channels (a (2+1)D block's temporal conv, ``c * KD + kd`` before: 23 of 28 ms in that copy,
    at 0.5 GB/s)."""

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((1, 4, 3, 5, 5), "float32"), w: R.Tensor((6, 4, 3, 1, 1), "float32")):
            y = R.nn.conv3d(x, w, padding=[1, 0, 0, 1, 0, 0])
            return y

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((1, 4, 3, 5, 5), "float32"), w: R.Tensor((6, 4, 3, 1, 1), "float32")):
            padded = R.nn.pad(x, pad_width=[0, 0, 0, 0, 1, 1, 0, 0, 0, 0])
            f0 = R.strided_slice(padded, (2,), (0,), (3,), (1,))
            f1 = R.strided_slice(padded, (2,), (1,), (4,), (1,))
            f2 = R.strided_slice(padded, (2,), (2,), (5,), (1,))
            stacked = R.stack((f0, f1, f2), axis=1)
            windows = R.permute_dims(stacked, axes=[0, 3, 1, 2, 4, 5])
            x2 = R.reshape(windows, R.shape([3, 12, 5, 5]))
            w2 = R.reshape(R.permute_dims(w, axes=[0, 2, 1, 3, 4]), R.shape([6, 12, 1, 1]))
            y2 = R.nn.conv2d(x2, w2)
            y = R.permute_dims(R.reshape(y2, R.shape([1, 3, 6, 5, 5])), axes=[0, 2, 1, 3, 4])
            return y

    tvm.ir.assert_structural_equal(Conv3dAsConv2d()(Before), Expected)


# (kernel, stride, padding, ceil_mode, input shape)
POOL_CASES = [
    ((1, 3, 3), (1, 2, 2), (0, 1, 1), False, (1, 16, 4, 14, 14)),  # S3D's spatial pools
    ((3, 3, 3), (2, 2, 2), 1, False, (2, 8, 7, 9, 11)),
    ((2, 2, 2), 2, 0, True, (1, 8, 5, 7, 9)),  # ceil mode reads past the depth
    ((2, 3, 3), 2, 1, True, (1, 4, 7, 8, 8)),
]


@pytest.mark.parametrize("level", ["O0", "O2"])
@pytest.mark.parametrize("case", POOL_CASES, ids=str)
def test_max_pool3d_matches_torch(case, level):
    """A 2-D pool of the frames, then their maximum over each depth window: TVM's loops for
    the 3-D pool ran at 0.4 GB/s (59 of 203 ms of S3D)."""
    kernel, stride, padding, ceil, shape = case
    torch.manual_seed(0)
    pool = torch.nn.MaxPool3d(kernel, stride, padding, ceil_mode=ceil)
    model = torch.nn.Sequential(torch.nn.Conv3d(shape[1], shape[1], 1), pool)
    _check_rewritten(model.eval(), shape, "relax.nn.max_pool3d", level, case)
