"""AutoMixedPrecision: quantization scales and zero points, and what computes them, stay fp32.

ONNX's DynamicQuantizeLinear imports as min/max reductions, ``(max - min) / 255`` and a rounded
zero point: follow ops, which O2 and O3 ran in bf16 (the scale up to 0.4 % off onnxruntime's,
a tenth of the quantized values a step away).
"""

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

import tvmamp
from tvmamp.policy import Policy
from tvmamp.relay_passes import AutoMixedPrecision

BF16 = "bfloat16"
TARGET = "llvm -num-cores=1"


def run(mod, level, dtype=BF16, **custom):
    amp = AutoMixedPrecision(Policy.for_level(level, dtype, **custom))
    out = amp(mod)
    relax.analysis.well_formed(out)
    return out, amp.report


def reasons(report):
    return {n.node: (n.dtype, n.reason) for n in report.nodes}


@I.ir_module
class DynamicQuantize:
    """``Relu(MatMul(x, w))`` through DynamicQuantizeLinear, as TVM's importer writes it."""

    @R.function
    def main(x: R.Tensor((4, 8), "float32"), w: R.Tensor((8, 16), "float32")):
        with R.dataflow():
            y = R.matmul(x, w)
            r = R.nn.relu(y)
            mx = R.max(r)
            hi = R.maximum(R.const(0.0, "float32"), mx)
            mn = R.min(r)
            lo = R.minimum(R.const(0.0, "float32"), mn)
            span = R.subtract(hi, lo)
            scale = R.divide(span, R.const(255.0, "float32"))
            shift = R.divide(lo, scale)
            zf = R.subtract(R.const(0.0, "float32"), shift)
            zc = R.clip(zf, 0, 255)
            zr = R.round(zc)
            zp = R.astype(zr, "uint8")
            q = R.quantize(r, scale, zp, out_dtype="uint8", axis=0)
            out = (q, scale, zp)
            R.output(out)
        return out


PARAM_NODES = ["mx", "hi", "mn", "lo", "span", "scale", "shift", "zf", "zc", "zr"]


def test_o2_computes_the_scale_and_zero_point_and_the_quantized_tensor_in_fp32():
    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((4, 8), "float32"), w: R.Tensor((8, 16), "float32")):
            with R.dataflow():
                x16 = R.astype(x, BF16)
                w16 = R.astype(w, BF16)
                y = R.matmul(x16, w16, out_dtype="float32")
                # the quantize and its min/max read r as written: fp32, from the accumulator
                r = R.nn.relu(y)
                mx = R.max(r)
                hi = R.maximum(R.const(0.0, "float32"), mx)
                mn = R.min(r)
                lo = R.minimum(R.const(0.0, "float32"), mn)
                span = R.subtract(hi, lo)
                scale = R.divide(span, R.const(255.0, "float32"))
                shift = R.divide(lo, scale)
                zf = R.subtract(R.const(0.0, "float32"), shift)
                zc = R.clip(zf, 0, 255)
                zr = R.round(zc)
                zp = R.astype(zr, "uint8")
                q = R.quantize(r, scale, zp, out_dtype="uint8", axis=0)
                out = (q, scale, zp)
                R.output(out)
            return out

    out, report = run(DynamicQuantize, "O2")
    tvm.ir.assert_structural_equal(out, Expected)
    decided = reasons(report)
    assert decided["main/r"] == ("float32", "feeds_fp32")
    for node in PARAM_NODES:
        assert decided[f"main/{node}"] == ("float32", "quant_params"), node


# O1 and OD ran them in fp32 already (follow ops of fp32 inputs); these are the levels that did
# not: O3, and O2 on a target without fp32 feeds (the fp16-only NPU)
@pytest.mark.parametrize("level, custom", [("O2", {"fp32_feeds": False}), ("O3", {})])
def test_quantization_parameters_are_fp32_at_every_level(level, custom):
    _, report = run(DynamicQuantize, level, **custom)
    decided = reasons(report)
    for node in PARAM_NODES:
        assert decided[f"main/{node}"] == ("float32", "quant_params"), node
    if level == "O3":  # the quantized activation itself follows the level
        assert decided["main/r"] == (BF16, "policy")


@I.ir_module
class IntegerMatmul:
    """onnxruntime's quantize_dynamic: ``Cast(MatMulInteger(q, w, zp)) * (x_scale * w_scale)``,
    and an activation ``h`` that a max also reads (for a scale) but that is never quantized."""

    @R.function
    def main(
        x: R.Tensor((4, 8), "float32"),
        w: R.Tensor((8, 16), "int32"),
        w_scale: R.Tensor((), "float32"),
        h: R.Tensor((4, 16), "float32"),
    ):
        with R.dataflow():
            mx = R.max(x)
            scale = R.divide(mx, R.const(127.0, "float32"))
            q = R.quantize(x, scale, R.const(0, "int8"), out_dtype="int8", axis=0)
            qi = R.astype(q, "int32")
            acc = R.matmul(qi, w, out_dtype="int32")
            accf = R.astype(acc, "float32")
            sw = R.multiply(scale, w_scale)
            y = R.multiply(accf, sw)
            hr = R.nn.relu(h)
            hmax = R.max(hr)
            hs = R.divide(hmax, R.const(127.0, "float32"))
            g = R.add(y, hr)
            gq = R.quantize(g, hs, R.const(0, "int8"), out_dtype="int8", axis=0)
            out = (g, gq)
            R.output(out)
        return out


def test_the_dequantizing_scale_of_an_integer_matmul_is_fp32_its_product_follows_the_level():
    _, report = run(IntegerMatmul, "O3")
    decided = reasons(report)
    for node in ("mx", "scale", "sw", "hmax", "hs"):
        assert decided[f"main/{node}"] == ("float32", "quant_params"), node
    # the dequantized product, and hr, which the model adds to it as well, run low
    for node in ("y", "hr", "g"):
        assert decided[f"main/{node}"] == (BF16, "policy"), node


# ---- against onnxruntime -----------------------------------------------------------------


def _dynamic_quantize_model(rng):
    """``x + b`` through DynamicQuantizeLinear, DequantizeLinear, and a MatMulInteger."""
    from onnx import TensorProto as TP
    from onnx import helper as h
    from onnx import numpy_helper as nh
    from onnx_graphs import onnx_model

    nodes = [
        h.make_node("Add", ["x", "b"], ["xb"]),
        h.make_node("DynamicQuantizeLinear", ["xb"], ["q", "s", "z"]),
        h.make_node("DequantizeLinear", ["q", "s", "z"], ["d"]),
        h.make_node("MatMulInteger", ["q", "w", "z"], ["acc"]),
        h.make_node("Cast", ["acc"], ["accf"], to=TP.FLOAT),
        h.make_node("Mul", ["s", "ws"], ["sw"]),
        h.make_node("Mul", ["accf", "sw"], ["y"]),
    ]
    outputs = [("q", TP.UINT8, [8, 64]), ("s", TP.FLOAT, []), ("z", TP.UINT8, [])]
    outputs += [("d", TP.FLOAT, [8, 64]), ("y", TP.FLOAT, [8, 16])]
    inits = [
        nh.from_array(rng.standard_normal(64).astype(np.float32), "b"),
        nh.from_array(rng.integers(-127, 128, (64, 16)).astype(np.int8), "w"),
        nh.from_array(np.float32(0.0123), "ws"),
    ]
    return onnx_model(
        nodes,
        [h.make_tensor_value_info("x", TP.FLOAT, [8, 64])],
        [h.make_tensor_value_info(*o) for o in outputs],
        inits,
    )


def test_dynamic_quantize_at_o2_matches_onnxruntime(rng):
    ort = pytest.importorskip("onnxruntime")
    model = _dynamic_quantize_model(rng)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    mod, params = tvmamp.from_onnx(model)
    o2 = tvmamp.build(mod, "O2", TARGET, dtype=BF16, params=params)
    o3 = tvmamp.build(mod, "O3", TARGET, dtype=BF16, params=params)
    for _ in range(3):
        x = (rng.standard_normal((8, 64)) * 2 + 0.5).astype(np.float32)
        q, s, z, d, y = session.run(None, {"x": x})
        got = [np.asarray(v) for v in o2(x)]
        # the scale and zero point are onnxruntime's, bit for bit, so every quantized value is
        # (in bf16 the scale was up to 0.4 % off and 28 to 72 of the 512 values a step away)
        assert got[1] == s and got[2] == z
        np.testing.assert_array_equal(got[0], q)
        np.testing.assert_allclose(got[3], d, rtol=1e-6, atol=0)
        # y is the model's result of fp32 ops: as onnxruntime's, but for float rounding
        np.testing.assert_allclose(got[4], y, rtol=1e-6, atol=1e-6 * np.abs(y).max())
        # O3 runs x + b in bf16: its values move by at most half a step (bf16 keeps 8 bits),
        # and the parameters are computed from them in fp32, so no value is more than a step off
        steps = np.abs(np.asarray(o3(x)[0]).astype(int) - q.astype(int))
        assert steps.max() <= 1
