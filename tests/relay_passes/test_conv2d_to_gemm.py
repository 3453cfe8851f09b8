"""Conv2dToGemm: IR before/after (convs chained on NHWC rows), and what it leaves alone."""

from __future__ import annotations

import pytest
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

from tvmamp.relay_passes.conv2d_im2col import Geometry, emit_conv_gemm, emit_im2col
from tvmamp.relay_passes.conv2d_to_gemm import Conv2dToGemm

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
            col = emit_im2col(bb, _input_rows(bb, x, 1, 3, 6, 5), g1)
            y = bb.emit(relax.op.matmul(col, _weight_matrix(bb, w1, 3, 4), out_dtype="float32"))
            z = bb.emit(relax.op.astype(y, BF16))
            z = bb.emit(relax.op.add(z, relax.op.reshape(b1, (4,))))
            z = bb.emit(relax.op.nn.relu(z))
            col = emit_im2col(bb, z, g2)
            o = bb.emit(relax.op.matmul(col, _weight_matrix(bb, w2, 4, 5), out_dtype="float32"))
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
            p = R.nn.max_pool2d(z, pool_size=[2, 2], strides=[2, 2])
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
            col = emit_im2col(bb, _input_rows(bb, x, 1, 2, 4, 4), g)
            y = bb.emit(relax.op.matmul(col, _weight_matrix(bb, w, 2, 3), out_dtype="float32"))
            inv = relax.op.divide(one, relax.op.sqrt(relax.op.add(var, eps)))
            scale = bb.emit(relax.op.multiply(inv, gamma))
            shift = relax.op.negative(relax.op.multiply(mean, scale))
            shift = bb.emit(relax.op.add(shift, beta))
            z = bb.emit(relax.op.add(bb.emit(relax.op.multiply(y, scale)), shift))
            m = bb.emit_output(mean)
            nchw = _to_nchw(bb, z, 1, 4, 4, 3)
            p = bb.emit_output(relax.op.nn.max_pool2d(nchw, pool_size=[2, 2], strides=[2, 2]))
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


def test_grouped_and_nhwc_convs_are_left_alone():
    tvm.ir.assert_structural_equal(_rewrite(Grouped), Grouped)
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
    # Below ``gather_channels`` the gather stays a kernel of its own.
    narrow = Conv2dToGemm(BF16, gather_channels=64)(WideConvs)
    names = [gv.name_hint for gv in narrow.get_global_vars()]
    assert "im2col" in names and "conv2d_gemm" not in names


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


def test_large_kernels_on_few_channels_stay_direct_convs():
    rgb = _stem(3)
    tvm.ir.assert_structural_equal(_rewrite(rgb), rgb)  # an RGB stem: the direct conv is faster
    for rewritten in (_rewrite(_stem(8)), Conv2dToGemm(BF16, min_channels=1)(rgb)):
        names = [gv.name_hint for gv in rewritten.get_global_vars()]
        assert "im2col" in names, names


def test_min_channels_must_be_positive():
    with pytest.raises(ValueError, match="min_channels=0 is not a positive int"):
        Conv2dToGemm(BF16, min_channels=0)
