"""LowPrecisionFastMath: fp16/bf16 exp, erf, tanh, gelu and softmax get vectorised fp32 kernels."""

import math

import numpy as np
import pytest
import tvm
from tolerances import assert_close
from tvm import relax

import tvmamp
from tvmamp.relay_passes.fast_math import LowPrecisionFastMath
from tvmamp.tensors import np_dtype

SHAPE = (4, 96)


def _module(dtype):
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(SHAPE, dtype))
    with bb.function("main", [x]):
        with bb.dataflow():
            g = bb.emit(relax.op.nn.gelu(x))
            s = bb.emit(relax.op.nn.softmax(x, axis=-1))
            e = bb.emit(relax.op.exp(relax.op.multiply(x, relax.const(0.5, dtype))))
            t = bb.emit(relax.op.tanh(x))
            out = bb.emit_output(relax.Tuple([g, s, e, t]))
        bb.emit_func_output(out)
    return bb.get()


def _ops(mod):
    names = []
    relax.analysis.post_order_visit(
        mod["main"], lambda e: names.append(e.op.name) if isinstance(e, relax.Call) else None
    )
    return names


def test_fp32_ops_are_left_exact():
    mod = _module("float32")
    tvm.ir.assert_structural_equal(LowPrecisionFastMath()(mod), mod)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_low_ops_become_fast_kernels(dtype):
    after = LowPrecisionFastMath()(_module(dtype))
    ops = _ops(after)
    assert not {"relax.nn.gelu", "relax.nn.softmax", "relax.exp", "relax.tanh"} & set(ops)
    fast = sorted(gv.name_hint for gv in after.get_global_vars() if gv.name_hint.endswith("_fast"))
    assert fast == ["exp_fast", "gelu_fast", "softmax_fast", "tanh_fast"]
    relax.analysis.well_formed(after)  # raises when it is not


def _reference(x):
    x = x.astype(np.float64)
    soft = np.exp(x - x.max(-1, keepdims=True))
    return (
        0.5 * x * (1 + np.vectorize(math.erf)(x / np.sqrt(2))),
        soft / soft.sum(-1, keepdims=True),
        np.exp(0.5 * x),
        np.tanh(x),
    )


# Every element within twice the unit roundoff of the low dtype of numpy's value on the same
# (rounded) input: the kernels compute in fp32 and round once (measured: at most 1.0x the
# unit roundoff, 4.9e-4 for fp16 and 3.9e-3 for bf16, on gelu, softmax, exp and tanh alike).
RTOL = {"float16": 1e-3, "bfloat16": 8e-3}


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_numerics_and_no_scalar_libm_calls(dtype):
    """O3 runs all four low; the kernels match numpy and call no scalar erff/expf/tanhf."""
    x = np.random.default_rng(0).uniform(-3, 3, SHAPE).astype("float32")
    low = np_dtype(dtype)
    x_low = x.astype(low).astype("float32")  # the input the low kernels see
    exe = tvmamp.build(_module("float32"), "O3", "llvm", dtype)
    for name, out, ref in zip(("gelu", "softmax", "exp", "tanh"), exe(x), _reference(x_low)):
        # elementwise, so each softmax probability (1e-4 .. 0.07) is held to its own size
        assert_close(out, ref, rtol=RTOL[dtype], atol=1e-7, what=name)
        np.testing.assert_array_equal(out, out.astype(low).astype("float32"))  # rounded low
    llvm_ir = exe.get_source("ll")
    for libm in ("@erff(", "@expf(", "@tanhf("):
        assert f"call float {libm}" not in llvm_ir and f"declare float {libm}" not in llvm_ir
    fp32 = tvmamp.build(_module("float32"), "O0", "llvm").get_source("ll")
    assert "erff" in fp32  # the fp32 build stays exact (libm)
