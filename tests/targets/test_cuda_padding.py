"""The CUDA target's Relax phases: tensor-core padding and NHWC conv layout (IR and numerics).

Both passes are target-independent Relax, so their numerics are checked on the CPU against the
unrewritten fp32 model (the passes are told to rewrite fp32 ops for that).
"""

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

from tvmamp import models
from tvmamp.relay_passes.nhwc_layout import ConvertConvToNHWC
from tvmamp.relay_passes.tensor_core_padding import TensorCorePadding, tensor_core_multiple
from tvmamp.targets import resolve_target
from tvmamp.targets.cuda import partition_passes


@I.ir_module
class OddMatmul:
    @R.function
    def main(x: R.Tensor((2, 30, 20), "float16"), w: R.Tensor((20, 10), "float16")) -> R.Tensor(
        (2, 30, 10), "float32"
    ):
        with R.dataflow():
            y = R.matmul(x, w, out_dtype="float32")
            R.output(y)
        return y


@I.ir_module
class OddMatmulPadded:
    @R.function
    def main(x: R.Tensor((2, 30, 20), "float16"), w: R.Tensor((20, 10), "float16")) -> R.Tensor(
        (2, 30, 10), "float32"
    ):
        with R.dataflow():
            xp = R.nn.pad(x, pad_width=[0, 0, 0, 2, 0, 12], pad_value=0.0)
            wp = R.nn.pad(w, pad_width=[0, 12, 0, 6], pad_value=0.0)
            yp = R.matmul(xp, wp, out_dtype="float32")
            y = R.strided_slice(yp, axes=[1, 2], begin=[0, 0], end=[30, 10])
            R.output(y)
        return y


@I.ir_module
class OddConv:
    @R.function
    def main(
        x: R.Tensor((1, 8, 8, 3), "bfloat16"), w: R.Tensor((10, 3, 3, 3), "bfloat16")
    ) -> R.Tensor((1, 8, 8, 10), "float32"):
        with R.dataflow():
            y = R.nn.conv2d(
                x, w, padding=1, data_layout="NHWC", kernel_layout="OHWI", out_dtype="float32"
            )
            R.output(y)
        return y


@I.ir_module
class OddConvPadded:
    @R.function
    def main(
        x: R.Tensor((1, 8, 8, 3), "bfloat16"), w: R.Tensor((10, 3, 3, 3), "bfloat16")
    ) -> R.Tensor((1, 8, 8, 10), "float32"):
        with R.dataflow():
            xp = R.nn.pad(x, pad_width=[0, 0, 0, 0, 0, 0, 0, 5], pad_value=0.0)
            wp = R.nn.pad(w, pad_width=[0, 6, 0, 0, 0, 0, 0, 5], pad_value=0.0)
            yp = R.nn.conv2d(
                xp, wp, padding=1, data_layout="NHWC", kernel_layout="OHWI", out_dtype="float32"
            )
            y = R.strided_slice(yp, axes=[3], begin=[0], end=[10])
            R.output(y)
        return y


def test_matmul_m_k_n_are_padded_and_sliced_back():
    tvm.ir.assert_structural_equal(TensorCorePadding(16)(OddMatmul), OddMatmulPadded)


def test_conv2d_channels_are_padded_and_sliced_back():
    tvm.ir.assert_structural_equal(TensorCorePadding(8)(OddConv), OddConvPadded)


def test_aligned_and_fp32_ops_are_left_alone():
    aligned = TensorCorePadding(2)
    tvm.ir.assert_structural_equal(aligned(OddMatmul), OddMatmul)
    assert aligned.padded == 0
    fp32_only = TensorCorePadding(16, dtypes=("float32",))
    tvm.ir.assert_structural_equal(fp32_only(OddConv), OddConv)


def test_bad_multiple_is_a_value_error():
    with pytest.raises(ValueError, match="multiple 0 must be a positive int"):
        TensorCorePadding(0)


@pytest.mark.parametrize("cc,multiple", [(70, 8), (75, 8), (80, 16), (90, 16)])
def test_multiple_follows_the_compute_capability(cc, multiple):
    assert tensor_core_multiple(cc) == multiple


def run_llvm(mod, inputs):
    exe = tvm.compile(mod, target="llvm")
    vm = relax.VirtualMachine(exe, tvm.cpu())
    return vm["main"](*[tvm.runtime.tensor(x) for x in inputs]).numpy()


def bound(make):
    mod, params = make()
    func = mod["main"].bind_params({k: relax.const(v) for k, v in params.items()})
    return tvm.IRModule({"main": func}), models.example_inputs(mod)


def odd_mlp():
    return models.simple_net(batch=5, hidden=20, layers=2)


@pytest.mark.parametrize("make,multiple", [(models.conv_net, 16), (odd_mlp, 8), (odd_mlp, 16)])
def test_padded_model_computes_the_same_on_cpu(make, multiple):
    mod, inputs = bound(make)
    rewrite = TensorCorePadding(multiple, dtypes=("float32",))
    padded = rewrite(mod)
    relax.analysis.well_formed(padded)
    assert rewrite.padded >= 2
    want = run_llvm(mod, inputs)
    np.testing.assert_allclose(run_llvm(padded, inputs), want, rtol=1e-5, atol=1e-5)


def conv_layouts(mod):
    layouts = []

    def visit(expr):
        if isinstance(expr, relax.Call) and expr.op.name == "relax.nn.conv2d":
            layouts.append((str(expr.attrs.data_layout), str(expr.attrs.kernel_layout)))

    relax.analysis.post_order_visit(mod["main"], visit)
    return layouts


def test_nhwc_conversion_keeps_the_numbers():
    mod, inputs = bound(models.conv_net)
    nhwc = ConvertConvToNHWC(dtypes=("float32",))(mod)
    assert conv_layouts(mod) == [("NCHW", "OIHW")] * 2
    assert conv_layouts(nhwc) == [("NHWC", "OHWI")] * 2
    want = run_llvm(mod, inputs)
    np.testing.assert_allclose(run_llvm(nhwc, inputs), want, rtol=1e-5, atol=1e-5)
    assert ConvertConvToNHWC()(mod).same_as(mod)  # no low-precision conv: unchanged


def test_cuda_partition_passes_pad_the_low_dtype_only():
    import tvmamp

    mod, params = models.conv_net()
    converted = tvmamp.convert(mod, "O2", "cuda -arch=sm_80", "float16", params=params)
    target, _ = resolve_target("cuda -arch=sm_80")
    passes = partition_passes(target, converted.policy)
    assert [p.multiple for p in passes if isinstance(p, TensorCorePadding)] == [16]
    with target:
        out = tvm.transform.Sequential(passes)(converted.mod)
    assert conv_layouts(out) == [("NHWC", "OHWI")] * 2
    calls = []
    relax.analysis.post_order_visit(out["main"], lambda e: calls.append(e))
    pads = [c for c in calls if isinstance(c, relax.Call) and c.op.name == "relax.nn.pad"]
    assert pads and all(str(c.ty.dtype) == "float16" for c in pads)
