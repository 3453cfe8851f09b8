"""Partitioning for the reference NPU: exactly the supported ops and patterns are offloaded."""

import pytest
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

import tvmamp
import tvmamp.targets.npu as npu
from tvmamp import models
from tvmamp.policy import Policy
from tvmamp.targets.npu.fallback import HostFallback

COMPUTE_ON_HOST_IN_FP32 = ("relax.matmul", "relax.nn.conv2d", "relax.add", "relax.multiply")


def report(mod, params, level="O2", **kwargs):
    return npu.partition_report(tvmamp.convert(mod, level, "npu", params=params, **kwargs))


def host_ops(rep):
    return sorted(p.op for p in rep.on_host)


def test_mlp_offloads_every_layer_as_a_fused_dense():
    rep = report(*models.simple_net(batch=16, hidden=32, layers=3))
    assert rep.patterns() == {"dense_bias_relu": 2, "dense_bias": 1}
    assert rep.on_host == ()
    assert all(p.dtype == "float16" for p in rep.on_npu)


def test_mlp_with_channels_off_the_matrix_engine_stays_on_the_host_in_fp32():
    rep = report(*models.simple_net(batch=16, hidden=24, layers=2))
    assert rep.on_npu == ()
    matmuls = [p for p in rep.on_host if p.op == "relax.matmul"]
    assert len(matmuls) == 2 and all(p.dtype == "float32" for p in matmuls)
    assert all("K 24 is not a multiple of 16" in p.reason for p in matmuls)


def test_conv_net_offloads_the_aligned_conv_and_relus_only():
    """The batch norms fold into the convs (FoldBatchNorm): the aligned conv, its folded bias and
    ReLU are one composite; the 3-channel conv stays on the host, its bias add and ReLU go."""
    rep = report(*models.conv_net(batch=1, channels=16, size=16, blocks=2))
    assert rep.patterns() == {"conv2d_bias_relu": 1, "add": 1, "relu": 1}
    reasons = {(p.op, p.dtype, p.reason) for p in rep.on_host}
    assert ("relax.nn.conv2d", "float32", "input channels 3 is not a multiple of 16") in reasons
    assert ("relax.matmul", "float32", "N 10 is not a multiple of 16") in reasons
    assert host_ops(rep) == sorted(
        ["relax.nn.conv2d", "relax.mean", "relax.permute_dims", "relax.matmul", "relax.add"]
    )


def test_transformer_layer_offloads_gemms_and_elementwise_ops():
    rep = report(*models.transformer_layer(batch=2, seq=16, dim=64, heads=4))
    assert rep.patterns() == {
        "dense_bias": 5,
        "dense_bias_gelu": 1,
        "dense": 1,
        "matmul": 1,
        "multiply": 1,
        "add": 2,
    }
    on_host = set(host_ops(rep))
    assert on_host == {
        "relax.reshape",
        "relax.permute_dims",
        "relax.nn.softmax",
        "relax.nn.layer_norm",
    }
    assert all(
        p.dtype == "float32"
        for p in rep.on_host
        if p.op != "relax.reshape" and p.op != "relax.permute_dims"
    )


def test_transformer_layer_breaking_the_limits_keeps_its_gemms_on_the_host():
    rep = report(*models.transformer_layer(batch=1, seq=10, dim=40, heads=2))
    assert rep.patterns() == {"add": 1}  # the (1, 10, 160) bias add of mlp.fc1 fits the vector unit
    gemms = [p for p in rep.on_host if p.op == "relax.matmul"]
    assert len(gemms) == 8 and all("is not a multiple of 16" in p.reason for p in gemms)
    assert all(p.dtype == "float32" for p in rep.on_host if p.op in COMPUTE_ON_HOST_IN_FP32)


def test_custom_black_list_keeps_an_op_off_the_npu():
    rep = report(*models.simple_net(batch=16, hidden=32, layers=3), custom_black_list=["relu"])
    assert rep.patterns() == {"dense_bias": 3}
    relus = [p for p in rep.on_host if p.op == "relax.nn.relu"]
    assert len(relus) == 2 and all("black list" in p.reason and p.dtype == "float32" for p in relus)


def test_the_black_list_holds_at_o3_too():
    rep = report(
        *models.simple_net(batch=16, hidden=32, layers=2), "O3", custom_black_list=["relu"]
    )
    assert rep.patterns() == {"dense_bias": 2}


def test_ops_the_npu_cannot_run_stay_fp32_in_the_policy():
    policy = tvmamp.convert(
        *models.simple_net(batch=4, hidden=16, layers=1)[:1], "O2", "npu"
    ).policy
    black = set(policy.black_list())
    assert {"relax.nn.softmax", "relax.subtract", "relax.nn.silu", "relax.sigmoid"} <= black
    assert not {"relax.matmul", "relax.add", "relax.nn.relu", "relax.nn.gelu"} & black
    assert "relax.reshape" not in black  # data movement is exact in fp16


def test_bf16_request_is_a_clear_error_at_every_level():
    mod, params = models.simple_net(batch=4, hidden=16, layers=1)
    for level in ("O2", "O0"):
        with pytest.raises(ValueError, match="tvmamp_npu supports only float16; dtype 'bfloat16'"):
            tvmamp.convert(mod, level, "npu", dtype="bfloat16", params=params)


def test_npu_target_is_the_host_cpu_named_after_the_npu():
    target, entry = tvmamp.targets.resolve_target("npu -num-cores=1")
    assert target.kind.name == "llvm" and int(target.attrs["num-cores"]) == 1
    assert "tvmamp_npu" in [str(k) for k in target.keys] and entry.descriptor is npu.TVMAMP_NPU


@pytest.mark.parametrize(
    "change,match",
    [
        ({"ops": ("relax.nn.softmax",)}, "op 'relax.nn.softmax' is not known"),
        ({"fused": ("dense_bias_silu",)}, "fused pattern 'dense_bias_silu' is not known"),
        ({"channel_multiple": 0}, "channel_multiple must be a positive int"),
        ({"name": "my-npu"}, "must be a C identifier"),
        ({"data_layout": "NHWC"}, "layouts NHWC/OIHW are not supported"),
    ],
)
def test_bad_descriptors_are_rejected(change, match):
    fields = {"name": "bad_npu", **change}
    with pytest.raises(ValueError, match=match):
        npu.NpuDescriptor(**fields)


@I.ir_module
class Before:
    @R.function
    def main(x: R.Tensor((1, 3, 8, 8), "float32"), w: R.Tensor((16, 3, 3, 3), "float16")):
        with R.dataflow():
            xh = R.astype(x, "float16")
            y = R.nn.conv2d(xh, w, out_dtype="float32")
            yh = R.astype(y, "float16")
            z = R.nn.relu(yh)
            R.output(z)
        return z


@I.ir_module
class Expected:
    @R.function
    def main(x: R.Tensor((1, 3, 8, 8), "float32"), w: R.Tensor((16, 3, 3, 3), "float16")):
        with R.dataflow():
            wf = R.astype(w, "float32")
            y = R.nn.conv2d(x, wf, out_dtype="float32")
            zf = R.nn.relu(y)
            z = R.astype(zf, "float16")
            R.output(z)
        return z


def test_host_fallback_widens_rejected_calls_without_round_trips():
    policy = Policy.for_level("O2", "float16")
    after = HostFallback(npu.TVMAMP_NPU, policy)(Before)
    tvm.ir.assert_structural_equal(after, Expected)
    relax.analysis.well_formed(after)  # raises when the rewrite left a broken module
