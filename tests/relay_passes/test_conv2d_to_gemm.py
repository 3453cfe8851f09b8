"""Conv2dToGemm: IR before/after (convs chained on NHWC rows), and what it leaves alone."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.ir.expr import Constant
from tvm.script import ir as I
from tvm.script import relax as R

import tvmamp
from tvmamp.relay_passes.conv2d_im2col import (
    Geometry,
    emit_conv_gemm,
    emit_run_im2col,
    run_weight,
)
from tvmamp.relay_passes.conv2d_to_gemm import Conv2dToGemm
from tvmamp.relay_passes.grouped_conv_gemm import emit_grouped_gemm, grouped_weight

BF16 = "bfloat16"


def _rewrite(mod: tvm.IRModule) -> tvm.IRModule:
    out = Conv2dToGemm(BF16)(mod)
    relax.analysis.well_formed(out)
    return out


class _Attrs:
    """The conv2d attributes Geometry.of reads, for building the expected module."""

    def __init__(self, stride=1, pad=1):
        self.strides, self.dilation, self.padding = [stride, stride], [1, 1], [pad] * 4


def _weight_matrix(bb, w, c, f):
    return bb.emit(relax.op.reshape(relax.op.permute_dims(w, (2, 3, 1, 0)), (9 * c, f)))


def _input_rows(bb, x, n, c, h, w):
    nhwc = relax.op.permute_dims(x, (0, 2, 3, 1))
    return bb.emit(relax.op.reshape(nhwc, (n * h * w, c)))


def _to_nchw(bb, rows, n, h, w, c, output=False):
    nhwc = bb.emit(relax.op.reshape(rows, (n, h, w, c)))
    nchw = relax.op.permute_dims(nhwc, (0, 3, 1, 2))
    return bb.emit_output(nchw) if output else bb.emit(nchw)


@I.ir_module
class TwoConvs:
    @R.function
    def main(
        x: R.Tensor((1, 3, 6, 5), BF16),
        w1: R.Tensor((4, 3, 3, 3), BF16),
        b1: R.Tensor((1, 4, 1, 1), BF16),
        w2: R.Tensor((5, 4, 3, 3), BF16),
    ):
        with R.dataflow():
            y = R.nn.conv2d(x, w1, padding=1, out_dtype="float32")
            z = R.astype(y, BF16)
            z = R.add(z, b1)
            z = R.nn.relu(z)
            o = R.nn.conv2d(z, w2, strides=2, padding=1, out_dtype="float32")
            R.output(o)
        return o


def _expected_two_convs() -> tvm.IRModule:
    """Rows between the convs: no transpose until the output; bias as a ``[4]`` vector."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 3, 6, 5), BF16))
    w1 = relax.Var("w1", relax.TensorType((4, 3, 3, 3), BF16))
    b1 = relax.Var("b1", relax.TensorType((1, 4, 1, 1), BF16))
    w2 = relax.Var("w2", relax.TensorType((5, 4, 3, 3), BF16))
    g1 = Geometry.of(_Attrs(), [1, 3, 6, 5], [4, 3, 3, 3])
    g2 = Geometry.of(_Attrs(stride=2), [1, 4, 6, 5], [5, 4, 3, 3])
    with bb.function("main", [x, w1, b1, w2]):
        with bb.dataflow():
            col = emit_run_im2col(bb, _input_rows(bb, x, 1, 3, 6, 5), g1)
            y = bb.emit(relax.op.matmul(col, bb.emit(run_weight(w1, g1, 4)), out_dtype="float32"))
            z = bb.emit(relax.op.astype(y, BF16))
            z = bb.emit(relax.op.add(z, relax.op.reshape(b1, (4,))))
            z = bb.emit(relax.op.nn.relu(z))
            col = emit_run_im2col(bb, z, g2)
            o = bb.emit(relax.op.matmul(col, bb.emit(run_weight(w2, g2, 5)), out_dtype="float32"))
            out = _to_nchw(bb, o, 1, 3, 3, 5, output=True)
        bb.emit_func_output(out)
    return bb.get()


def test_consecutive_convs_stay_on_rows():
    tvm.ir.assert_structural_equal(_rewrite(TwoConvs), _expected_two_convs())


@I.ir_module
class BatchNormThenPool:
    @R.function
    def main(
        x: R.Tensor((1, 2, 4, 4), BF16),
        w: R.Tensor((3, 2, 3, 3), BF16),
        gamma: R.Tensor((3,), "float32"),
        beta: R.Tensor((3,), "float32"),
        mean: R.Tensor((3,), "float32"),
        var: R.Tensor((3,), "float32"),
    ):
        with R.dataflow():
            y = R.nn.conv2d(x, w, padding=1, out_dtype="float32")
            bn = R.nn.batch_norm(y, gamma, beta, mean, var, axis=1, epsilon=1e-3, training=False)
            z = bn[0]
            m = bn[1]
            p = R.nn.softmax(z, axis=1)
            q = R.add(z, z)
            R.output(p, q, m)
        return (p, q, m)


def _expected_batch_norm() -> tvm.IRModule:
    """Batch-norm as ``x * scale + shift`` on rows; one NCHW transpose, shared by two uses."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 2, 4, 4), BF16))
    w = relax.Var("w", relax.TensorType((3, 2, 3, 3), BF16))
    gamma, beta, mean, var = (relax.Var(n, relax.TensorType((3,), "float32")) for n in "gbmv")
    g = Geometry.of(_Attrs(), [1, 2, 4, 4], [3, 2, 3, 3])
    one, eps = relax.const(1.0, "float32"), relax.const(1e-3, "float32")
    with bb.function("main", [x, w, gamma, beta, mean, var]):
        with bb.dataflow():
            col = emit_run_im2col(bb, _input_rows(bb, x, 1, 2, 4, 4), g)
            y = bb.emit(relax.op.matmul(col, bb.emit(run_weight(w, g, 3)), out_dtype="float32"))
            inv = relax.op.divide(one, relax.op.sqrt(relax.op.add(var, eps)))
            scale = bb.emit(relax.op.multiply(inv, gamma))
            shift = relax.op.negative(relax.op.multiply(mean, scale))
            shift = bb.emit(relax.op.add(shift, beta))
            z = bb.emit(relax.op.add(bb.emit(relax.op.multiply(y, scale)), shift))
            m = bb.emit_output(mean)
            nchw = _to_nchw(bb, z, 1, 4, 4, 3)
            p = bb.emit_output(relax.op.nn.softmax(nchw, axis=1))
            q = _to_nchw(bb, bb.emit(relax.op.add(z, z)), 1, 4, 4, 3, output=True)
            outs = [p, q, m]
        bb.emit_func_output(relax.Tuple(outs))
    return bb.get()


def test_batch_norm_on_rows_and_one_transpose_for_other_uses():
    expected = _expected_batch_norm()
    tvm.ir.assert_structural_equal(_rewrite(BatchNormThenPool), expected, map_free_vars=True)


@I.ir_module
class Grouped:
    @R.function
    def main(x: R.Tensor((1, 4, 5, 5), BF16), w: R.Tensor((4, 2, 3, 3), BF16)):
        with R.dataflow():
            y = R.nn.conv2d(x, w, padding=1, groups=2, out_dtype="float32")
            z = R.nn.relu(y)
            R.output(z)
        return z


def test_narrow_grouped_and_nhwc_convs_are_left_alone():
    tvm.ir.assert_structural_equal(_rewrite(Grouped), Grouped)  # 2 channels per group
    nhwc = relax.transform.ConvertLayout({"relax.nn.conv2d": ["NHWC", "OHWI"]})(Grouped)
    tvm.ir.assert_structural_equal(_rewrite(nhwc), nhwc)


@I.ir_module
class WideConvs:
    @R.function
    def main(x: R.Tensor((1, 32, 6, 5), BF16), w: R.Tensor((8, 32, 3, 3), BF16)):
        with R.dataflow():
            y = R.nn.conv2d(x, w, strides=2, padding=1, out_dtype="float32")
            R.output(y)
        return y


def _expected_wide_conv() -> tvm.IRModule:
    """32 channels: the gather and the GEMM are one kernel, reading the rows."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 32, 6, 5), BF16))
    w = relax.Var("w", relax.TensorType((8, 32, 3, 3), BF16))
    g = Geometry.of(_Attrs(stride=2), [1, 32, 6, 5], [8, 32, 3, 3])
    with bb.function("main", [x, w]):
        with bb.dataflow():
            rows = _input_rows(bb, x, 1, 32, 6, 5)
            y = emit_conv_gemm(bb, rows, _weight_matrix(bb, w, 32, 8), g, "float32")
            out = _to_nchw(bb, y, 1, 3, 3, 8, output=True)
        bb.emit_func_output(out)
    return bb.get()


def test_wide_convs_fuse_the_gather_into_the_gemm():
    tvm.ir.assert_structural_equal(_rewrite(WideConvs), _expected_wide_conv())
    # Below ``gather_channels`` the gather stays a kernel of its own, copying kernel rows.
    narrow = Conv2dToGemm(BF16, gather_channels=64)(WideConvs)
    names = [gv.name_hint for gv in narrow.get_global_vars()]
    assert "im2col_runs" in names and "conv2d_gemm" not in names


def test_gather_channels_must_be_positive():
    with pytest.raises(ValueError, match="gather_channels=0 is not a positive int"):
        Conv2dToGemm(BF16, gather_channels=0)


def _stem(c: int) -> tvm.IRModule:
    """A 7x7 stride-2 conv on ``c`` input channels, as an RGB stem is."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, c, 16, 16), BF16))
    w = relax.Var("w", relax.TensorType((8, c, 7, 7), BF16))
    with bb.function("main", [x, w]):
        with bb.dataflow():
            conv = relax.op.nn.conv2d(x, w, strides=2, padding=3, out_dtype="float32")
            out = bb.emit_output(conv)
        bb.emit_func_output(out)
    return bb.get()


def test_large_kernels_on_few_channels_are_gemms_unless_min_channels_says_otherwise():
    rgb = _stem(3)
    for rewritten in (_rewrite(rgb), _rewrite(_stem(8))):  # whole kernel rows gathered at once
        names = [gv.name_hint for gv in rewritten.get_global_vars()]
        assert "im2col_runs" in names, names
    direct = Conv2dToGemm(BF16, min_channels=8)
    tvm.ir.assert_structural_equal(direct(rgb), rgb)


def test_min_channels_must_be_positive():
    with pytest.raises(ValueError, match="min_channels=0 is not a positive int"):
        Conv2dToGemm(BF16, min_channels=0)


@I.ir_module
class GroupedPointwise:
    @R.function
    def main(
        x: R.Tensor((1, 48, 5, 3), BF16),
        w: R.Tensor((96, 16, 1, 1), BF16),
        b: R.Tensor((1, 96, 1, 1), BF16),
    ):
        with R.dataflow():
            y = R.nn.conv2d(x, w, groups=3, out_dtype="float32")
            z = R.astype(y, BF16)
            z = R.add(z, b)
            R.output(z)
        return z


def _expected_grouped_pointwise() -> tvm.IRModule:
    """A batched GEMM over the 3 groups reading the rows as ``[15, 3, 16]``; the result and
    its epilogue stay ``[15, 3, 32]``, the bias broadcast as ``[3, 32]``."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 48, 5, 3), BF16))
    w = relax.Var("w", relax.TensorType((96, 16, 1, 1), BF16))
    b = relax.Var("b", relax.TensorType((1, 96, 1, 1), BF16))
    attrs = _Attrs(pad=0)
    attrs.groups = 3
    g = Geometry.of(attrs, [1, 48, 5, 3], [96, 16, 1, 1])
    with bb.function("main", [x, w, b]):
        with bb.dataflow():
            nhwc = relax.op.permute_dims(x, (0, 2, 3, 1))
            rows = bb.emit(relax.op.reshape(nhwc, (15, 3, 16)))
            matrices = bb.emit(grouped_weight(w, g, 96))
            y = emit_grouped_gemm(bb, rows, matrices, g, "float32")
            z = bb.emit(relax.op.astype(y, BF16))
            z = bb.emit(relax.op.add(z, relax.op.reshape(b, (3, 32))))
            out = _to_nchw(bb, z, 1, 5, 3, 96, output=True)
        bb.emit_func_output(out)
    return bb.get()


def test_grouped_pointwise_conv_is_a_batched_gemm_on_rows():
    tvm.ir.assert_structural_equal(_rewrite(GroupedPointwise), _expected_grouped_pointwise())


@I.ir_module
class ShuffleUnit:
    """ShuffleNet's grouped 1x1, channel shuffle and depthwise 3x3, then a grouped 3x3."""

    @R.function
    def main(
        x: R.Tensor((1, 48, 6, 5), BF16),
        w1: R.Tensor((48, 16, 1, 1), BF16),
        w2: R.Tensor((48, 1, 3, 3), BF16),
        w3: R.Tensor((48, 16, 3, 3), BF16),
    ):
        with R.dataflow():
            y = R.nn.conv2d(x, w1, groups=3, out_dtype="float32")
            y = R.astype(R.nn.relu(y), BF16)
            y = R.reshape(y, R.shape([1, 3, 16, 6, 5]))
            y = R.permute_dims(y, axes=[0, 2, 1, 3, 4])
            y = R.reshape(y, R.shape([1, 48, 6, 5]))
            y = R.nn.conv2d(y, w2, strides=2, padding=1, groups=48, out_dtype="float32")
            y = R.nn.conv2d(R.astype(y, BF16), w3, padding=1, groups=3, out_dtype="float32")
            R.output(y)
        return y


def _kernel_names(mod: tvm.IRModule) -> list[str]:
    return sorted(gv.name_hint for gv in mod.get_global_vars() if gv.name_hint != "main")


def _transposes(mod: tvm.IRModule) -> int:
    """The ``permute_dims`` calls of ``main``: layout changes between NCHW and rows."""
    found = []
    op = tvm.ir.Op.get("relax.permute_dims")
    relax.analysis.post_order_visit(
        mod["main"], lambda e: found.append(e) if isinstance(e, relax.Call) and e.op == op else None
    )
    return len(found)


def test_channel_shuffle_and_depthwise_conv_stay_on_rows():
    out = _rewrite(ShuffleUnit)
    names = _kernel_names(out)
    assert names == [
        "channel_permute",
        "depthwise_rows",
        "grouped_conv_gemm",
        "grouped_conv_gemm1",
    ], names
    assert _transposes(out) == 2 + 3  # the input and the output; three weight layouts


@I.ir_module
class PoolsConcatMean:
    @R.function
    def main(x: R.Tensor((1, 8, 9, 7), BF16), w: R.Tensor((16, 8, 3, 3), BF16)):
        with R.dataflow():
            y = R.nn.conv2d(x, w, padding=1, out_dtype="float32")
            y = R.astype(y, BF16)
            p = R.nn.max_pool2d(y, pool_size=[3, 3], strides=[2, 2], padding=[1, 1, 1, 1])
            q = R.nn.avg_pool2d(y, pool_size=[3, 3], strides=[2, 2], padding=[1, 1, 1, 1])
            z = R.nn.relu(R.concat((p, q), axis=1))
            m = R.mean(z, axis=[2, 3])
            R.output(m)
        return m


def test_pools_concat_and_global_mean_stay_on_rows():
    out = _rewrite(PoolsConcatMean)
    assert _kernel_names(out) == ["avg_pool_rows", "im2col_runs", "max_pool_rows"]
    assert _transposes(out) == 2  # the input and the weight: the mean reads the rows


@pytest.mark.parametrize("kind", ["max", "avg"])
def test_a_ceil_mode_max_pool_stays_on_rows_and_matches_torch(kind):
    """SqueezeNet's max pools have ``ceil_mode``: on rows, with the last windows padded by the
    max's identity (9 x 7 -> 5 x 4 with 2 x 2 stride 2, where floor mode gives 4 x 3). An
    average with ``ceil_mode`` stays NCHW."""
    import torch

    pool = R.nn.max_pool2d if kind == "max" else R.nn.avg_pool2d

    @I.ir_module
    class CeilPool:
        @R.function
        def main(x: R.Tensor((1, 8, 9, 7), BF16), w: R.Tensor((16, 8, 3, 3), BF16)):
            with R.dataflow():
                y = R.astype(R.nn.conv2d(x, w, padding=1, out_dtype="float32"), BF16)
                p = pool(y, pool_size=[2, 2], strides=[2, 2], ceil_mode=True)
                R.output(p)
            return p

    names = _kernel_names(_rewrite(CeilPool))
    assert ("max_pool_rows" in names) == (kind == "max"), names
    rng = np.random.default_rng(5)
    x = rng.standard_normal((1, 8, 9, 7)).astype(ml_dtypes.bfloat16)
    w = rng.standard_normal((16, 8, 3, 3)).astype(ml_dtypes.bfloat16)
    out = np.asarray(
        tvmamp.build(CeilPool, "O0", "llvm -mcpu=znver4 -mattr=-sse4a")(x, w), "float32"
    )
    conv = torch.nn.functional.conv2d(
        torch.from_numpy(x.astype("float32")), torch.from_numpy(w.astype("float32")), padding=1
    ).bfloat16()
    fn = torch.nn.functional.max_pool2d if kind == "max" else torch.nn.functional.avg_pool2d
    ref = fn(conv.float(), 2, 2, ceil_mode=True).numpy()
    assert out.shape == ref.shape == (1, 16, 5, 4)
    np.testing.assert_allclose(out, ref, rtol=1e-2, atol=1e-2 * np.abs(ref).max())


@pytest.mark.parametrize(("n", "c", "viewed"), [(1, 32, True), (1, 24, False), (2, 32, False)])
def test_one_image_enters_the_rows_through_a_view_and_a_2d_transpose(n, c, viewed, rng):
    """``[1, C, H, W]`` with C and H*W multiples of 16: rows = transpose of the free
    ``[C, H*W]`` view (a register-tiled copy); other inputs keep the 4-D transpose. Both match
    torch."""
    import torch

    @I.ir_module
    class OneConv:
        @R.function
        def main(x: R.Tensor((n, c, 8, 8), BF16), w: R.Tensor((16, c, 3, 3), BF16)):
            with R.dataflow():
                y = R.nn.conv2d(x, w, padding=1, out_dtype="float32")
                R.output(y)
            return y

    script = _rewrite(OneConv).script()
    assert ("R.memory.view" in script) == viewed
    x = rng.standard_normal((n, c, 8, 8)).astype(ml_dtypes.bfloat16)
    w = rng.standard_normal((16, c, 3, 3)).astype(ml_dtypes.bfloat16)
    out = np.asarray(
        tvmamp.build(OneConv, "O0", "llvm -mcpu=znver4 -mattr=-sse4a")(x, w), "float64"
    )
    ref = torch.nn.functional.conv2d(
        torch.from_numpy(x.astype("float64")), torch.from_numpy(w.astype("float64")), padding=1
    ).numpy()
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-4 * np.abs(ref).max())


def test_pools_of_nchw_values_and_channel_multipliers_are_left_alone():
    @I.ir_module
    class NchwPool:
        @R.function
        def main(x: R.Tensor((1, 8, 9, 7), BF16), w: R.Tensor((16, 1, 3, 3), BF16)):
            with R.dataflow():
                p = R.nn.max_pool2d(x, pool_size=[2, 2], strides=[2, 2])
                y = R.nn.conv2d(p, w, padding=1, groups=8, out_dtype="float32")  # 2 per group
                R.output(y)
            return y

    tvm.ir.assert_structural_equal(_rewrite(NchwPool), NchwPool)


def test_min_group_channels_must_be_positive():
    with pytest.raises(ValueError, match="min_group_channels=0 is not a positive int"):
        Conv2dToGemm(BF16, min_group_channels=0)


def test_constant_weights_are_laid_out_at_rewrite_time():
    """A constant weight's GEMM layout is computed by the pass (no op left for FoldConstant,
    which would compile a kernel for each)."""
    w = np.random.default_rng(3).standard_normal((96, 16, 1, 1)).astype(ml_dtypes.bfloat16)
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 48, 5, 3), BF16))
    with bb.function("main", [x]):
        with bb.dataflow():
            conv = relax.op.nn.conv2d(x, relax.const(w), groups=3, out_dtype="float32")
            out = bb.emit_output(conv)
        bb.emit_func_output(out)
    rewritten = _rewrite(bb.get())
    calls = []
    relax.analysis.post_order_visit(
        rewritten["main"], lambda e: calls.append(e) if isinstance(e, relax.Call) else None
    )
    (gemm,) = [c for c in calls if c.op == tvm.ir.Op.get("relax.call_tir")]
    matrices = gemm.args[1].fields[1].value.numpy()
    expected = w.reshape(3, 32, 16).transpose(0, 2, 1)  # [G, Cg, Fg]
    np.testing.assert_array_equal(matrices.astype("float32"), expected.astype("float32"))
    layouts = [c for c in calls if c.op.name in ("relax.reshape", "relax.permute_dims")]
    assert all(not isinstance(c.args[0], Constant) for c in layouts), layouts


@I.ir_module
class MBConvSiLU:
    """EfficientNet's expand 1x1, SiLU, depthwise 3x3 and squeeze-excitation, then project."""

    @R.function
    def main(
        x: R.Tensor((1, 16, 8, 8), BF16),
        w1: R.Tensor((32, 16, 1, 1), BF16),
        w2: R.Tensor((32, 1, 3, 3), BF16),
        w3: R.Tensor((16, 32, 1, 1), BF16),
    ):
        with R.dataflow():
            y = R.astype(R.nn.silu(R.nn.conv2d(x, w1, out_dtype="float32")), BF16)
            y = R.nn.conv2d(y, w2, padding=1, groups=32, out_dtype="float32")
            y = R.astype(R.nn.silu(y), BF16)
            gate = R.sigmoid(R.mean(y, axis=[2, 3], keepdims=True))
            y = R.nn.conv2d(R.multiply(y, gate), w3, out_dtype="float32")
            R.output(y)
        return y


def test_the_llvm_pipeline_keeps_silu_and_squeeze_excitation_on_rows():
    """FastMath runs after the rows rewrite: before, SiLU became a call_tir the rows did not
    follow, and each MBConv went back to NCHW for its depthwise conv (EfficientNet-like model
    at O2: 3.05 -> 2.57 ms, one thread)."""
    from tvmamp.targets.llvm import partition_passes

    target = tvm.target.Target({"kind": "llvm", "mcpu": "znver4", "mattr": ["-sse4a"]})
    with target:
        out = tvm.transform.Sequential(partition_passes(target, None))(MBConvSiLU)
    assert "depthwise_rows" in _kernel_names(out)
    assert _transposes(out) == 2 + 3  # the input and the output; three weight layouts
