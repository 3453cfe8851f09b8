"""LowPrecisionFastMath: fp16/bf16 exp, erf, tanh, gelu and softmax get vectorised fp32 kernels."""

import math

import numpy as np
import pytest
import tvm
from relax_modules import op_names, unary_module
from tolerances import assert_close, tolerance
from tvm import relax

import tvmamp
from tvmamp.pipeline import legalize_passes
from tvmamp.relay_passes.fast_math import FastMath, LowPrecisionFastMath
from tvmamp.schedules.cpu import cpu_schedule_passes
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


def test_fp32_ops_are_left_exact():
    mod = _module("float32")
    tvm.ir.assert_structural_equal(LowPrecisionFastMath()(mod), mod)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_low_ops_become_fast_kernels(dtype):
    after = LowPrecisionFastMath()(_module(dtype))
    ops = op_names(after)
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
    """O3 runs all four low, O0 in fp32; both match numpy and call no scalar erff/expf/tanhf."""
    x = np.random.default_rng(0).uniform(-3, 3, SHAPE).astype("float32")
    low = np_dtype(dtype)
    x_low = x.astype(low).astype("float32")  # the input the low kernels see
    exe = tvmamp.build(_module("float32"), "O3", "llvm", dtype)
    exact = _reference(x)
    for name, out, ref, ref32 in zip(
        ("gelu", "softmax", "exp", "tanh"), exe(x), _reference(x_low), exact
    ):
        # elementwise, so each softmax probability (1e-4 .. 0.07) is held to its own size
        assert_close(out, ref, rtol=RTOL[dtype], atol=1e-7, what=name)
        if dtype == "float16":
            np.testing.assert_array_equal(out, out.astype(low).astype("float32"))  # rounded low
        else:
            # TVM computes bf16 arithmetic in fp32 and rounds only where it stores bf16; the
            # result's fp32 cast fuses into the op, so only the rounded input shows
            assert np.abs(out - ref32).max() > 10 * np.abs(out - ref).max(), name
    llvm_ir = exe.get_source("ll")
    for libm in ("@erff(", "@expf(", "@tanhf("):
        assert f"call float {libm}" not in llvm_ir and f"declare float {libm}" not in llvm_ir
    fp32 = tvmamp.build(_module("float32"), "O0", "llvm")
    for name, out, ref in zip(("gelu", "softmax", "exp", "tanh"), fp32(x), _reference(x)):
        assert_close(out, ref, **tolerance("float32"), what=f"fp32 {name}")
    llvm_ir = fp32.get_source("ll")
    for libm in ("@erff(", "@expf(", "@tanhf("):  # fp32 gets the vector polynomials too
        assert f"call float {libm}" not in llvm_ir and f"declare float {libm}" not in llvm_ir


def _unary(op, shape=(3, 77), dtype="float32"):
    return unary_module(op, shape, dtype)


_ELEMENTWISE = (relax.op.exp, relax.op.sigmoid, relax.op.nn.silu)


def test_fast_math_rejects_unknown_dtype():
    with pytest.raises(ValueError, match="float64.*float32, float16, bfloat16"):
        FastMath(("float64",))


@pytest.mark.parametrize(
    "op, ref",
    [
        (relax.op.exp, np.exp),
        (relax.op.sigmoid, lambda v: 1 / (1 + np.exp(-v))),
        (relax.op.nn.silu, lambda v: v / (1 + np.exp(-v))),
        # softmax: x - max rounds in fp32 first (as libm's would), so a relative bound
        (lambda x: relax.op.nn.softmax(x, axis=-1), lambda v: _reference(v)[1]),
    ],
)
def test_fp32_fast_kernels_are_accurate_and_call_no_libm(op, ref):
    """FastMath on fp32: within 4 fp32 ulps of float64 numpy (softmax: 1e-5 relative, as
    the O0 tolerance), no scalar ``expf`` left."""
    mod = FastMath()(_unary(op))
    assert any(gv.name_hint.endswith("_fast") for gv in mod.get_global_vars())
    x = np.random.default_rng(3).uniform(-20, 20, (3, 77)).astype("float32")
    if op is relax.op.exp:
        x *= 4  # the whole range, to |x| = 80
    target = tvm.target.Target(
        {"kind": "llvm", "mcpu": "znver4", "mattr": ["-sse4a"], "num-cores": 1}
    )
    with target:
        lowered = tvm.transform.Sequential([*legalize_passes(), *cpu_schedule_passes(target)])(mod)
    exe = tvm.compile(lowered, target=target)
    vm = relax.VirtualMachine(exe, tvm.cpu())
    out = vm["main"](tvm.runtime.tensor(x)).numpy().astype("float64")
    expected = ref(x.astype("float64"))
    ulp = np.spacing(np.abs(expected).astype("float32")).astype("float64")
    bound = 4 * ulp if op in _ELEMENTWISE else 1e-5 * np.abs(expected)
    assert (np.abs(out - expected) <= bound + 1e-30).all()
    assert "expf" not in exe.mod.inspect_source("ll")


@pytest.mark.parametrize("exponent", [2.0, 3.0, 4.0])
def test_small_integer_powers_become_multiplies(exponent):
    """GPT-2's tanh GELU computes ``x ** 3``; TVM lowers power to a scalar powf per element."""
    x = np.random.default_rng(1).uniform(-3, 3, (3, 77)).astype("float32")
    mod = _unary(lambda v: relax.op.power(v, relax.const(exponent, "float32")))
    exe = tvmamp.build(mod, "O0", "llvm")
    assert_close(exe(x), x.astype("float64") ** exponent, **tolerance("float32"))
    assert "powf" not in exe.get_source("ll")


@pytest.mark.parametrize("exponent", [0.75, 0.5, 0.25, -0.75, -0.5, 1.25, 2.5, -2.0])
def test_quarter_powers_become_square_roots_within_a_few_ulp(exponent):
    """AlexNet's LRN: ``(k + a * mean(x^2)) ** 0.75``. Within 4 fp32 ulps of float64, no powf;
    a negative base gives NaN, as powf."""
    x = np.random.default_rng(4).uniform(0.01, 50, (3, 77)).astype("float32")
    x[0, :3] = [0.0, np.inf, -1.0]
    mod = _unary(lambda v: relax.op.power(v, relax.const(exponent, "float32")))
    exe = tvmamp.build(mod, "O0", "llvm")
    out = np.asarray(exe(x), "float64")
    with np.errstate(divide="ignore", invalid="ignore"):
        expected = x.astype("float64") ** exponent
    finite = np.isfinite(expected)
    ulp = np.spacing(np.abs(expected[finite]).astype("float32")).astype("float64")
    assert (np.abs(out[finite] - expected[finite]) <= 4 * ulp).all()
    np.testing.assert_array_equal(out[~finite], expected[~finite])  # inf, NaN where powf has them
    assert "powf" not in exe.get_source("ll")


def test_other_powers_are_left_to_tvm():
    mod = _unary(lambda v: relax.op.power(v, relax.const(2.3, "float32")))
    tvm.ir.assert_structural_equal(FastMath()(mod), mod)
    x = np.random.default_rng(2).uniform(0.5, 3, (3, 77)).astype("float32")
    assert_close(tvmamp.build(mod, "O0")(x), x.astype("float64") ** 2.3, **tolerance("float32"))


@pytest.mark.parametrize("level", ["O0", "O2"])
def test_softmax_over_a_symbolic_axis(level):
    """A softmax over a dynamic sequence length (a BERT exported with dynamic axes) builds and
    matches numpy, where its body of whole vectors or its tail is empty (16, 5) and where
    neither is."""
    n, s = tvm.tirx.Var("n", "int64"), tvm.tirx.Var("s", "int64")
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((n, 4, s, s), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.nn.softmax(x, axis=-1))
        bb.emit_func_output(out)
    exe = tvmamp.build(bb.get(), level, "llvm")
    rng = np.random.default_rng(0)
    for shape in [(2, 4, 7, 7), (1, 4, 33, 33), (1, 4, 16, 16), (2, 4, 5, 5)]:
        a = rng.standard_normal(shape).astype("float32")
        ref = np.exp(a - a.max(-1, keepdims=True))
        np.testing.assert_allclose(exe(a), ref / ref.sum(-1, keepdims=True), rtol=1e-5, atol=1e-6)


def _log_softmax64(v, axis):
    v = v.astype("float64")
    shifted = v - v.max(axis, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis, keepdims=True))


def _softmax64(v, axis):
    e = np.exp(v.astype("float64") - v.max(axis, keepdims=True))
    return e / e.sum(axis, keepdims=True)


@pytest.mark.parametrize("axis", [1, 2, -1])
@pytest.mark.parametrize(
    "op, ref",
    [(relax.op.nn.softmax, _softmax64), (relax.op.nn.log_softmax, _log_softmax64)],
    ids=["softmax", "log_softmax"],
)
@pytest.mark.parametrize("level", ["O0", "O2"])
def test_softmax_along_any_axis_is_a_kernel_over_the_last(op, ref, axis, level):
    """A softmax or log-softmax along an axis other than the last (CoaT's over its tokens)
    recomputed its max and sum for each element: 1700x slower than between transposes, a
    log-softmax 12000x. The fast kernel runs over the last axis, moved there and back; a
    log-softmax has the fast exp (TVM's called libm per element)."""
    shape = (2, 5, 37, 3)
    mod = FastMath()(_unary(lambda x: op(x, axis=axis), shape))
    kernels = [gv.name_hint for gv in mod.get_global_vars() if gv.name_hint != "main"]
    name = "log_softmax_fast" if op is relax.op.nn.log_softmax else "softmax_fast"
    assert kernels == [name], kernels
    ops = op_names(mod)
    moved = axis % len(shape) != len(shape) - 1
    assert ops.count("relax.permute_dims") == (2 if moved else 0), ops
    x = np.random.default_rng(axis + 7).uniform(-20, 20, shape).astype("float32")
    out = tvmamp.build(_unary(lambda x: op(x, axis=axis), shape), level, "llvm -num-cores=1")(x)
    expected = ref(x, axis)
    dtype = "float32" if level == "O0" else "bfloat16"
    assert_close(out, expected, **tolerance(dtype, np.abs(expected).max()), what=f"{level}")


SAFE_SHAPE = (2, 3, 8, 48)


def _safe_softmax_module(cast=None, fill=float("-inf"), max_axis=-1, zeros_shape=SAFE_SHAPE):
    """PyTorch's export of attention's safe softmax, one binding per op, as ``from_torch`` gives
    it: ``where(not(max(int8(not(x == fill)), -1)), 0, softmax(x, -1))``, the probabilities
    cast to ``cast`` before the ``where`` when given (as mixed precision inserts)."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(SAFE_SHAPE, "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            soft = bb.emit(relax.op.nn.softmax(x, axis=-1))
            if cast is not None:
                soft = bb.emit(relax.op.astype(soft, cast))
            flag = bb.emit(relax.op.equal(x, relax.const(fill, "float32")))
            flag = bb.emit(relax.op.logical_not(flag))
            flag = bb.emit(relax.op.astype(flag, "int8"))
            flag = bb.emit(relax.op.max(flag, axis=[max_axis], keepdims=True))
            flag = bb.emit(relax.op.astype(flag, "bool"))
            flag = bb.emit(relax.op.logical_not(flag))
            zeros = bb.emit(relax.op.full(zeros_shape, relax.const(0.0, cast or "float32")))
            out = bb.emit_output(relax.op.where(flag, zeros, soft))
        bb.emit_func_output(out)
    return bb.get()


@pytest.mark.parametrize("cast", [None, "bfloat16"])
def test_safe_softmax_becomes_one_kernel(cast):
    """The ``all(x == -inf)`` check is the softmax kernel's own row max: no second reduction."""
    after = FastMath()(_safe_softmax_module(cast))
    ops = set(op_names(after))
    assert not {"relax.where", "relax.equal", "relax.max", "relax.nn.softmax"} & ops
    (kernel,) = [gv.name_hint for gv in after.get_global_vars() if gv.name_hint != "main"]
    assert kernel.startswith("softmax_fast")
    assert ("relax.astype" in ops) == (cast is not None)
    relax.analysis.well_formed(after)  # raises when it is not


@pytest.mark.parametrize(
    "module",
    [
        _safe_softmax_module(fill=-1e4),  # another fill value: a different function
        _safe_softmax_module(max_axis=2),  # the check over another axis than the softmax's
        _safe_softmax_module(zeros_shape=(4, *SAFE_SHAPE)),  # zeros that broadcast the result
    ],
    ids=["fill", "axis", "broadcast"],
)
def test_look_alike_of_safe_softmax_keeps_its_where(module):
    ops = set(op_names(FastMath()(module)))
    assert {"relax.where", "relax.equal", "relax.max"} <= ops


@pytest.mark.parametrize("cast", [None, "bfloat16"])
def test_safe_softmax_zeroes_rows_of_minus_inf(cast):
    """Rows all ``-inf`` give 0 (a plain softmax gives NaN); partly masked rows their softmax."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal(SAFE_SHAPE).astype("float32")
    x[0, 1, 3] = -np.inf  # a fully masked row
    x[1, 2, :, 40:] = -np.inf  # padding: the last 8 keys of every row of one head
    x[1, 0, 5, ::3] = -np.inf
    out = tvmamp.build(_safe_softmax_module(cast), "O0", "llvm")(x)
    finite = np.where(np.isinf(x), -np.inf, x.astype("float64"))
    peak = finite.max(-1, keepdims=True)
    soft = np.exp(finite - np.where(np.isinf(peak), 0, peak))
    total = soft.sum(-1, keepdims=True)
    ref = np.divide(soft, total, out=np.zeros_like(soft), where=total > 0)
    assert not np.isnan(np.asarray(out, "float32")).any()
    assert np.all(np.asarray(out, "float32")[0, 1, 3] == 0)
    rtol = 1e-5 if cast is None else 2 * 2.0**-8
    np.testing.assert_allclose(np.asarray(out, "float32"), ref, rtol=rtol, atol=1e-7)


@pytest.mark.parametrize("level", ["O0", "O2"])
def test_attention_with_a_fully_masked_query_matches_torch(rng, level):
    """torch's ``scaled_dot_product_attention`` gives 0 for a query that may attend to nothing
    (its safe softmax); the build does too, through ``from_torch``, with no NaN."""
    import torch
    import torch.nn.functional as F

    class Attention(torch.nn.Module):
        def forward(self, q, k, v, mask):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    q, k, v = (rng.standard_normal((2, 4, 16, 32)).astype("float32") for _ in range(3))
    mask = np.tril(np.ones((16, 16), bool))
    mask[5] = False
    args = [torch.from_numpy(a) for a in (q, k, v, mask)]
    with torch.inference_mode():
        ref = Attention()(*args).numpy()
    mod, _ = tvmamp.from_torch(Attention(), tuple(args))
    out = np.asarray(tvmamp.build(mod, level, "llvm", dtype="bfloat16")(q, k, v, mask), "float32")
    assert not np.isnan(out).any()
    assert np.all(out[:, :, 5] == 0) and np.all(ref[:, :, 5] == 0)
    assert_close(out, ref, **tolerance("float32" if level == "O0" else "bfloat16"))


def _erf64(v):
    return np.vectorize(math.erf, otypes=[np.float64])(v)


_SPECIAL = np.array(
    [np.nan, np.inf, -np.inf, 100.0, -100.0, 88.8, 88.0, -87.0, -90.0, 0.5, -0.5, 3.0, -3.0, 0.0]
    * 3,
    dtype="float32",
)


@pytest.mark.parametrize(
    "op, ref",
    [
        (relax.op.exp, np.exp),
        (relax.op.sigmoid, lambda v: 1 / (1 + np.exp(-v))),
        (relax.op.nn.silu, lambda v: v / (1 + np.exp(-v))),
        (relax.op.erf, _erf64),
        (relax.op.nn.gelu, lambda v: 0.5 * v * (1 + _erf64(v / math.sqrt(2)))),
    ],
)
def test_fast_kernels_keep_nan_and_infinities(op, ref):
    """NaN stays NaN, exp overflows to +inf and underflows to 0, as libm: the clamped
    polynomial made them finite (exp(NaN) = 2.4e38, erf(NaN) = 1), so a NaN vanished."""
    x = _SPECIAL.reshape(2, -1)
    out = np.asarray(tvmamp.build(FastMath()(_unary(op, x.shape)), "O0", "llvm")(x), "float64")
    with np.errstate(all="ignore"):  # float64, then rounded to fp32 (exp(100) is inf)
        expected = ref(x.astype("float64")).astype("float32").astype("float64")
    np.testing.assert_array_equal(np.isnan(out), np.isnan(expected))
    np.testing.assert_array_equal(np.isinf(out), np.isinf(expected))
    finite = np.isfinite(expected)  # the polynomials' accuracy is tested above
    np.testing.assert_allclose(out[finite], expected[finite], rtol=1e-5, atol=1e-6)


def test_softmax_rows_with_nan_or_infinity_are_nan():
    """torch gives NaN for a row holding NaN or +inf; the clamped exp gave finite rows."""
    x = np.random.default_rng(1).standard_normal((3, 40)).astype("float32")
    x[0, 7], x[1, 30] = np.nan, np.inf
    mod = FastMath()(_unary(lambda v: relax.op.nn.softmax(v, axis=-1), x.shape))
    out = np.asarray(tvmamp.build(mod, "O0", "llvm")(x))
    assert np.isnan(out[:2]).all() and np.isfinite(out[2]).all()
