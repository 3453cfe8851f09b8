"""ReLU, clip, maximum and minimum keep NaN, as torch does (relay_passes/nan_ops)."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

import tvmamp
from tvmamp.relay_passes.nan_ops import LEGALIZE_MAP

torch = pytest.importorskip("torch")
F = torch.nn.functional
from torch_modules import check_against_torch  # noqa: E402


@I.ir_module
class Before:
    @R.function
    def main(x: R.Tensor((4, 8), "bfloat16")):
        a = R.nn.relu(x)
        b = R.clip(x, 0, 6)
        return (a, b)


@I.ir_module
class Expected:
    @T.prim_func(private=True, s_tir=True)
    def relu(
        x: T.Buffer((T.int64(4), T.int64(8)), "bfloat16"),
        relu: T.Buffer((T.int64(4), T.int64(8)), "bfloat16"),
    ):
        T.func_attr({"tirx.noalias": True})
        for i0, i1 in T.grid(T.int64(4), T.int64(8)):
            with T.sblock("relu"):
                v_i0, v_i1 = T.axis.remap("SS", [i0, i1])
                T.reads(x[v_i0, v_i1])
                T.writes(relu[v_i0, v_i1])
                relu[v_i0, v_i1] = T.Select(
                    x[v_i0, v_i1] < T.bfloat16(0.0), T.bfloat16(0.0), x[v_i0, v_i1]
                )

    @T.prim_func(private=True, s_tir=True)
    def clip(
        x: T.Buffer((T.int64(4), T.int64(8)), "bfloat16"),
        clip: T.Buffer((T.int64(4), T.int64(8)), "bfloat16"),
    ):
        T.func_attr({"tirx.noalias": True})
        for i0, i1 in T.grid(T.int64(4), T.int64(8)):
            with T.sblock("clip"):
                v_i0, v_i1 = T.axis.remap("SS", [i0, i1])
                T.reads(x[v_i0, v_i1])
                T.writes(clip[v_i0, v_i1])
                clip[v_i0, v_i1] = T.Select(
                    T.bfloat16(6.0)
                    < T.Select(x[v_i0, v_i1] < T.bfloat16(0.0), T.bfloat16(0.0), x[v_i0, v_i1]),
                    T.bfloat16(6.0),
                    T.Select(x[v_i0, v_i1] < T.bfloat16(0.0), T.bfloat16(0.0), x[v_i0, v_i1]),
                )

    @R.function
    def main(x: R.Tensor((4, 8), "bfloat16")):
        cls = Expected
        a = R.call_tir(cls.relu, (x,), out_ty=R.Tensor((4, 8), dtype="bfloat16"))
        b = R.call_tir(cls.clip, (x,), out_ty=R.Tensor((4, 8), dtype="bfloat16"))
        return (a, b)


def test_relu_and_clip_are_selects_that_a_nan_falls_through():
    tvm.ir.assert_structural_equal(relax.transform.LegalizeOps(LEGALIZE_MAP)(Before), Expected)


def _with_nan_and_inf(rng, shape) -> np.ndarray:
    x = rng.standard_normal(shape).astype("float32")
    flat = x.reshape(-1)
    picks = rng.choice(flat.size, 6, replace=False)
    flat[picks[:2]] = np.nan
    flat[picks[2:4]] = np.inf
    flat[picks[4:]] = -np.inf
    return x


CONV = torch.nn.Conv2d(4, 8, 3, padding=1).eval()
OPS = {
    "relu": F.relu,
    "relu6": F.relu6,
    "hardtanh": F.hardtanh,
    "clamp": lambda x: x.clamp(-0.5, 0.5),
    "clamp_min": lambda x: x.clamp(min=0.1),
    "conv_relu": lambda x: F.relu(CONV(x)),  # two NaN pixels spread over 3 x 3 windows
}


@pytest.mark.parametrize("op", sorted(OPS))
def test_nan_and_inf_pass_as_in_torch(rng, op):
    """Before: relu(NaN) was 0, and a conv + ReLU over an image with two NaN pixels gave no NaN
    where torch gives 144."""
    check_against_torch(OPS[op], _with_nan_and_inf(rng, (2, 4, 8, 8)))


@pytest.mark.parametrize("swap", [False, True])
@pytest.mark.parametrize("op", ["maximum", "minimum"])
def test_maximum_and_minimum_return_a_nan_operand(rng, op, swap):
    """Broadcast operands, NaN in each; TVM's rule gave the other operand."""
    a = _with_nan_and_inf(rng, (3, 16))
    b = _with_nan_and_inf(rng, (16,))
    args = (b, a) if swap else (a, b)
    check_against_torch(getattr(torch, op), *args)


def test_integer_ops_keep_tvms_rules(rng):
    a = rng.integers(-50, 50, (4, 9)).astype("int64")
    check_against_torch(lambda x: torch.maximum(F.relu(x), x.clamp(max=7)), a)


def test_clip_with_bounds_the_wrong_way_round_gives_the_upper_one(rng):
    """numpy and ONNX: all ``hi`` where ``lo > hi`` (TVM's rule gave ``lo``)."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((64,), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.clip(x, 1, -1))
        bb.emit_func_output(out)
    data = _with_nan_and_inf(rng, (64,))
    got = tvmamp.build(bb.get(), "O0", "llvm -num-cores=1")(data)
    np.testing.assert_array_equal(np.asarray(got), np.clip(data, 1, -1))


@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16"])
def test_isnan_from_the_bits(dtype):
    """NaN of either sign (x86 makes negative ones) and signalling NaN are NaN; infinities,
    the largest finite value, zeros and subnormals are not."""
    import ml_dtypes
    from tvm import te

    from tvmamp.relay_passes.nan_ops import isnan

    wide = "float64" if dtype == "float64" else "float32"
    specials = np.array([np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, 1.5, -2.0], wide)
    bits = {"float32": ("uint32", [0x7F800001, 0xFFC00000, 0x7F7FFFFF, 0x00000001])}
    bits["float64"] = ("uint64", [0x7FF0000000000001, 0xFFF8000000000000, 0x7FEFFFFFFFFFFFFF, 1])
    bits["bfloat16"] = bits["float32"]
    kind, words = bits[dtype]
    values = np.concatenate([specials, np.array(words, kind).view(wide)])
    data = values.astype(ml_dtypes.bfloat16) if dtype == "bfloat16" else values
    x = te.placeholder((len(data),), dtype, name="x")
    out = te.compute(x.shape, lambda i: isnan(x(i)).astype("int8"), name="out")
    func = tvm.compile(te.create_prim_func([x, out]), target="llvm")
    got = tvm.runtime.empty((len(data),), "int8")
    func(tvm.runtime.tensor(data), got)
    np.testing.assert_array_equal(got.numpy(), np.isnan(data.astype(wide)).astype("int8"))
