"""The AMP pass's overflow guard: constants that reach an op through data-movement ops."""

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

import tvmamp
from tvmamp import models
from tvmamp.policy import Policy
from tvmamp.relay_passes import AutoMixedPrecision

# a (16, 8) weight whose largest entries (1e5) do not fit float16 (max 65504)
BIG = np.linspace(-1e5, 1e5, 16 * 8, dtype="float32").reshape(16, 8)
HUGE = np.full((16, 8), 3.4e38, "float32")  # above bfloat16's max (3.39e38), below fp32's


def run(mod, level="O2", dtype="float16"):
    amp = AutoMixedPrecision(Policy.for_level(level, dtype))
    out = amp(mod)
    relax.analysis.well_formed(out)
    return out, amp.report


def forced(report):
    return [(f.name, f.op, f.dtype) for f in report.forced]


@I.ir_module
class Permuted:
    @R.function
    def main(x: R.Tensor((4, 8), "float32")):
        with R.dataflow():
            wt = R.permute_dims(R.const(BIG))
            y = R.matmul(x, wt)
            z = R.nn.relu(y)
            R.output(z)
        return z


def test_weight_through_permute_dims_forces_its_matmul_to_fp32():
    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((4, 8), "float32")):
            with R.dataflow():
                wt = R.permute_dims(R.const(BIG))  # the constant stays fp32
                y = R.matmul(x, wt)
                z = R.nn.relu(y)  # O2: the result, read from the fp32 matmul, stays fp32
                R.output(z)
            return z

    out, report = run(Permuted, "O2")
    tvm.ir.assert_structural_equal(out, Expected)
    assert forced(report) == [("y", "relax.matmul", "float32")]
    reason = report.forced[0].reason
    assert "exceeds the float16 range" in reason and "relax.permute_dims" in reason
    assert [(n.node, n.dtype, n.reason) for n in report.nodes][0] == (
        "main/y",
        "float32",
        "overflow",
    )
    assert report.constants_converted == 0


@I.ir_module
class Reshaped:
    @R.function
    def main(x: R.Tensor((4, 8), "float32")):
        with R.dataflow():
            w = R.reshape(R.const(BIG.reshape(-1)), R.shape([16, 8]))
            wt = R.permute_dims(w)
            y = R.matmul(x, wt)
            z = R.nn.relu(y)
            R.output(z)
        return z


def test_weight_through_a_reshape_and_permute_chain_at_o1():
    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((4, 8), "float32")):
            with R.dataflow():
                w = R.reshape(R.const(BIG.reshape(-1)), R.shape([16, 8]))
                wt = R.permute_dims(w)
                y = R.matmul(x, wt)
                z = R.nn.relu(y)  # O1: its input is fp32 now, so it stays fp32
                R.output(z)
            return z

    out, report = run(Reshaped, "O1")
    tvm.ir.assert_structural_equal(out, Expected)
    assert forced(report) == [("y", "relax.matmul", "float32")]
    assert "relax.reshape -> relax.permute_dims" in report.forced[0].reason


def test_broadcast_bias_forces_the_add():
    bias = np.full((16,), 1e5, "float32")

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((4, 16), "float32")):
            with R.dataflow():
                b = R.broadcast_to(R.expand_dims(R.const(bias), 0), R.shape([4, 16]))
                y = R.add(x, b)
                R.output(y)
            return y

    out, report = run(Before, "O3")
    assert forced(report) == [("y", "relax.add", "float32")]
    assert "relax.expand_dims -> relax.broadcast_to" in report.forced[0].reason
    add = out["main"].body.blocks[0].bindings[-1].value
    assert [str(a.ty.dtype) for a in add.args] == ["float32", "float32"]


def test_lookup_in_a_big_table_guards_the_ops_that_use_its_rows():
    """take with run-time indices: the rows it returns are values of the constant table."""

    @I.ir_module
    class Before:
        @R.function
        def main(idx: R.Tensor((4,), "int64"), w: R.Tensor((8, 8), "float32")):
            with R.dataflow():
                rows = R.take(R.const(BIG), idx, axis=0)  # (4, 8)
                y = R.matmul(rows, w)
                R.output(y)
            return y

    out, report = run(Before, "O3")  # O3: take would run low too
    assert forced(report) == [("rows", "relax.take", "float32"), ("y", "relax.matmul", "float32")]
    take = out["main"].body.blocks[0].bindings[0].value
    assert str(take.args[0].ty.dtype) == "float32"  # the table is never converted


@I.ir_module
class SplitThenCast:
    @R.function
    def main(x: R.Tensor((4, 8), "float32")):
        with R.dataflow():
            parts = R.split(R.const(BIG), 2, axis=0)
            top = parts[1]  # (8, 8), holds the 1e5 end of BIG
            w = R.astype(top, "bfloat16")  # a user cast that bfloat16 can hold
            s = R.strided_slice(w, axes=[0], begin=[0], end=[8])
            w32 = R.astype(s, "float32")
            y = R.matmul(x, w32)
            R.output(y)
        return y


def test_split_getitem_slice_and_user_casts_are_followed():
    """The slice would read bfloat16 1e5 values in float16, and so would the matmul."""
    _, report = run(SplitThenCast, "O2")
    assert forced(report) == [
        ("s", "relax.strided_slice", "float32"),
        ("y", "relax.matmul", "float32"),
    ]
    assert "relax.split -> relax.astype (max |value| 1e+05)" in report.forced[0].reason
    assert "relax.split -> relax.astype -> relax.strided_slice" in report.forced[1].reason


def test_a_weight_that_fits_is_converted_not_forced():
    small = np.linspace(-1.0, 1.0, 16 * 8, dtype="float32").reshape(16, 8)

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((4, 8), "float32")):
            with R.dataflow():
                wt = R.permute_dims(R.const(small))
                y = R.matmul(x, wt)
                R.output(y)
            return y

    out, report = run(Before, "O2")
    assert report.forced == []
    assert report.constants_converted == 1


def test_bfloat16_guard_uses_the_bfloat16_range():
    _, report = run(Permuted, "O2", "bfloat16")  # 1e5 fits bfloat16
    assert report.forced == []

    @I.ir_module
    class Huge:
        @R.function
        def main(x: R.Tensor((4, 8), "float32")):
            with R.dataflow():
                wt = R.permute_dims(R.const(HUGE))
                y = R.matmul(x, wt)
                R.output(y)
            return y

    _, report = run(Huge, "O2", "bfloat16")
    assert forced(report) == [("y", "relax.matmul", "float32")]
    assert "exceeds the bfloat16 range" in report.forced[0].reason


def test_values_that_round_to_the_low_max_are_not_forced():
    near = np.full((16, 8), 65510.0, "float32")  # rounds to 65504 in float16, not to inf

    @I.ir_module
    class Near:
        @R.function
        def main(x: R.Tensor((4, 8), "float32")):
            with R.dataflow():
                y = R.matmul(x, R.permute_dims(R.const(near)))
                R.output(y)
            return y

    _, report = run(Near, "O2")
    assert report.forced == []


def _simple_net_with_a_big_weight():
    """SimpleNet whose first weight does not fit float16; its input is scaled down to match."""
    mod, params = models.simple_net(batch=8, hidden=64, layers=3)
    params = dict(params)
    params["linear0.weight"] = params["linear0.weight"] * np.float32(1e6)
    assert np.abs(params["linear0.weight"]).max() > 65504
    x = (1e-6 * np.random.default_rng(1).standard_normal((8, 64))).astype("float32")
    return mod, params, x


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_bound_params_are_guarded_and_match_fp32(level):
    mod, params, x = _simple_net_with_a_big_weight()
    ref = np.asarray(tvmamp.build(mod, level="O0", params=params)(x))
    exe = tvmamp.build(mod, level=level, dtype="float16", params=params)
    out = np.asarray(exe(x))
    assert np.isfinite(out).all()
    # elementwise: every output within 1e-2 of its reference (plus a floor of 1e-2 of the
    # mean magnitude for outputs near zero)
    np.testing.assert_allclose(out, ref, rtol=1e-2, atol=1e-2 * np.abs(ref).mean())
    assert forced(exe.stats) == [("lv1", "relax.matmul", "float32")]
    assert "linear0.weight through relax.permute_dims" in exe.stats.forced[0].reason


# An attention mask as Hugging Face models build it: where(mask, 0, finfo(float32).min), bound
# to a variable, then added to the scores. bf16 rounds finfo(float32).min to -inf, and a fully
# masked row (left padding) then gives softmax(-inf, ..., -inf) = NaN.
F32_MIN = float(np.finfo(np.float32).min)


@I.ir_module
class Masked:
    @R.function
    def main(s: R.Tensor((2, 4), "float32"), keep: R.Tensor((2, 4), "bool")):
        with R.dataflow():
            zero = R.const(0.0, "float32")
            low = R.const(F32_MIN, "float32")
            mask = R.where(keep, zero, low)
            biased = R.add(s, mask)
            p = R.nn.softmax(biased, axis=-1)
            R.output(p)
        return p


def test_a_huge_mask_constant_taints_where_and_the_add_that_reads_it():
    # at O2 both only feed the fp32 softmax and read fp32 values, so they stay fp32 anyway
    _, report = run(Masked, "O2", "bfloat16")
    assert [(n.node, n.dtype, n.reason) for n in report.nodes[:2]] == [
        ("main/mask", "float32", "feeds_fp32"),
        ("main/biased", "float32", "feeds_fp32"),
    ]
    # at O3 (every op low) only the guard keeps them fp32
    out, report = run(Masked, "O3", "bfloat16")
    assert forced(report) == [
        ("mask", "relax.where", "float32"),
        ("biased", "relax.add", "float32"),
        ("p", "relax.nn.softmax", "float32"),  # the add's output is tainted too
    ]
    assert "through relax.where" in report.forced[1].reason
    body = out["main"].body.blocks[0].bindings
    dtypes = {b.var.name: str(b.var.ty.dtype) for b in body}
    assert dtypes["mask"] == "float32" and dtypes["biased"] == "float32"


def test_a_fully_masked_row_stays_finite_at_o2_bf16(rng):
    scores = rng.standard_normal((2, 4)).astype("float32")
    keep = np.array([[True, True, False, True], [False, False, False, False]])
    exe = tvmamp.build(Masked, "O2", "llvm -num-cores=1", dtype="bfloat16")
    out = exe(scores, keep)
    assert np.isfinite(out).all()
    biased = scores + np.where(keep, 0.0, F32_MIN)
    ref = np.exp(biased - biased.max(-1, keepdims=True))
    ref /= ref.sum(-1, keepdims=True)
    np.testing.assert_allclose(out, ref, rtol=2e-2, atol=1e-2)
