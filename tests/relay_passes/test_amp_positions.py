"""Positions, coordinates and index values stay fp32; ops TVM cannot run in bf16 stay fp32.

bf16 holds integers exactly only up to 256: a RoPE angle ``position * inv_freq`` or an
interpolation coordinate computed in bf16 is wrong by whole positions in any long context.
"""

import warnings

import numpy as np
import pytest
import tvm
from tolerances import assert_close, tolerance
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

import tvmamp
from tvmamp.policy import Policy
from tvmamp.relay_passes import AutoMixedPrecision

INV_FREQ = (1.0 / 10000 ** (np.arange(0, 8, 2) / 8)).astype("float32").reshape(1, 4)
INV_FREQ_B = np.broadcast_to(INV_FREQ.reshape(1, 4, 1), (2, 4, 1)).copy()
BF16 = "bfloat16"


def run(mod, level, dtype=BF16):
    amp = AutoMixedPrecision(Policy.for_level(level, dtype))
    out = amp(mod)
    relax.analysis.well_formed(out)
    return out, amp.report


def reasons(report):
    return {n.node: (n.dtype, n.reason) for n in report.nodes}


# ---- arange-based positions: input-free, as written at every level -----------------------


@I.ir_module
class ArangeRope:
    @R.function
    def main(x: R.Tensor((16, 4), "float32")):
        with R.dataflow():
            t = R.arange(0, 16, 1, dtype="float32")
            t2 = R.reshape(t, R.shape([16, 1]))
            ang = R.multiply(t2, R.const(INV_FREQ))
            c = R.cos(ang)
            y = R.multiply(x, c)
            R.output(y)
        return y


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_arange_positions_stay_fp32_and_only_their_consumer_casts(level):
    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((16, 4), "float32")):
            with R.dataflow():
                t = R.arange(0, 16, 1, dtype="float32")
                t2 = R.reshape(t, R.shape([16, 1]))
                ang = R.multiply(t2, R.const(INV_FREQ))
                c = R.cos(ang)
                x16 = R.astype(x, "bfloat16")
                c16 = R.astype(c, "bfloat16")  # folded by FoldConstant
                y = R.multiply(x16, c16)
                out = R.astype(y, "float32")
                R.output(out)
            return out

    out, report = run(ArangeRope, level)
    tvm.ir.assert_structural_equal(out, Expected)
    assert (report.casts_inserted, report.constants_converted) == (2, 1)
    assert [n.op for n in report.nodes] == ["relax.multiply"]  # the rest is folded


def test_arange_positions_at_o1_are_left_as_written():
    out, report = run(ArangeRope, "O1")
    tvm.ir.assert_structural_equal(out, ArangeRope)
    assert report.casts_inserted == 0


def test_arange_of_a_symbolic_length_is_input_free_but_its_cast_runs():
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor(("n", 4), "float32")):
            n = T.int64()
            with R.dataflow():
                t = R.arange(0, n, 1, dtype="float32")
                t2 = R.reshape(t, R.shape([n, 1]))
                ang = R.multiply(t2, R.const(INV_FREQ))
                c = R.cos(ang)
                y = R.multiply(x, c)
                R.output(y)
            return y

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor(("n", 4), "float32")):
            n = T.int64()
            with R.dataflow():
                t = R.arange(0, n, 1, dtype="float32")
                t2 = R.reshape(t, R.shape([n, 1]))
                ang = R.multiply(t2, R.const(INV_FREQ))
                c = R.cos(ang)
                x16 = R.astype(x, "bfloat16")
                c16 = R.astype(c, "bfloat16")
                y = R.multiply(x16, c16)
                out = R.astype(y, "float32")
                R.output(out)
            return out

    out, report = run(Before, "O2")
    tvm.ir.assert_structural_equal(out, Expected)
    # no static shape, so FoldConstant cannot fold the cast of c: it is a run-time cast
    assert (report.casts_inserted, report.constants_converted) == (3, 0)


def test_a_part_of_split_positions_is_input_free_but_a_part_of_split_weights_is_not():
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((8, 4), "float32")):
            with R.dataflow():
                t = R.reshape(R.arange(0, 16, 1, dtype="float32"), R.shape([16, 1]))
                halves = R.split(t, 2, axis=0)
                ang = R.multiply(halves[1], R.const(INV_FREQ))  # positions 8..15
                w = R.split(R.const(np.ones((8, 8), "float32")), 2, axis=1)
                y = R.add(R.multiply(x, R.cos(ang)), w[0])
                R.output(y)
            return y

    _, report = run(Before, "O2")
    # the cos of the positions is folded, and so is its cast; the weight part is a run-time
    # value, as before (x, w[0] and the output are cast at run time)
    assert [(n.op, n.dtype) for n in report.nodes] == [
        ("relax.multiply", BF16),
        ("relax.add", BF16),
    ]
    assert (report.casts_inserted, report.constants_converted) == (3, 1)


# ---- index values: floats cast from integer tensors --------------------------------------


@I.ir_module
class MaskRope:
    """HF LLaMA's rotary embedding with position_ids = cumsum(attention_mask) - 1."""

    @R.function
    def main(x: R.Tensor((2, 6, 4), "float32"), mask: R.Tensor((2, 6), "int64")):
        with R.dataflow():
            pos = R.subtract(R.cumsum(mask, axis=-1), R.const(1, "int64"))
            posf = R.astype(R.expand_dims(pos, axis=[1]), "float32")
            freqs = R.matmul(R.const(INV_FREQ_B), posf, out_dtype="float32")  # contracts 1
            ang = R.permute_dims(freqs, axes=[0, 2, 1])
            c = R.cos(ang)
            y = R.multiply(x, c)
            R.output(y)
        return y


def test_integer_positions_stay_fp32_through_an_outer_product_matmul_at_o2():
    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((2, 6, 4), "float32"), mask: R.Tensor((2, 6), "int64")):
            with R.dataflow():
                pos = R.subtract(R.cumsum(mask, axis=-1), R.const(1, "int64"))
                posf = R.astype(R.expand_dims(pos, axis=[1]), "float32")
                freqs = R.matmul(R.const(INV_FREQ_B), posf, out_dtype="float32")
                ang = R.permute_dims(freqs, axes=[0, 2, 1])
                c = R.cos(ang)
                x16 = R.astype(x, "bfloat16")
                c16 = R.astype(c, "bfloat16")
                y = R.multiply(x16, c16)
                out = R.astype(y, "float32")
                R.output(out)
            return out

    out, report = run(MaskRope, "O2")
    tvm.ir.assert_structural_equal(out, Expected)
    decided = reasons(report)
    for node in ("main/freqs", "main/ang", "main/c"):
        assert decided[node] == ("float32", "index_values"), node
    assert decided["main/y"] == ("bfloat16", "policy")


def test_integer_positions_at_o1_no_longer_enter_the_white_matmul_low():
    out, report = run(MaskRope, "O1")
    tvm.ir.assert_structural_equal(out, MaskRope)
    assert reasons(report)["main/freqs"] == ("float32", "index_values")


def test_index_values_meeting_weights_in_a_gemm_or_an_embedding_run_low():
    """A GEMM that accumulates (an image cast from uint8 into a conv, integer features into a
    linear layer) is the model's compute: the policy decides it. An embedding's rows are not
    index values even though its indices are integers."""
    w = np.linspace(-1, 1, 8 * 16, dtype="float32").reshape(8, 16)
    table = np.linspace(-1, 1, 10 * 16, dtype="float32").reshape(10, 16)

    @I.ir_module
    class Before:
        @R.function
        def main(ids: R.Tensor((4, 8), "int64"), tokens: R.Tensor((4,), "int64")):
            with R.dataflow():
                feat = R.astype(ids, "float32")
                h = R.matmul(feat, R.const(w))
                emb = R.take(R.const(table), tokens, axis=0)
                e = R.nn.relu(emb)
                s = R.add(h, e)
                R.output(s)
            return s

    _, report = run(Before, "O2")
    decided = reasons(report)
    assert decided["main/h"] == ("bfloat16", "policy")
    assert decided["main/emb"] == ("float32", "policy")  # take is black-listed
    assert decided["main/e"] == ("bfloat16", "policy")
    assert decided["main/s"] == ("bfloat16", "policy")


def test_a_bool_mask_cast_to_float_mixes_with_activations_as_any_fp32_value():
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((4, 8), "float32"), ids: R.Tensor((4, 8), "int64")):
            with R.dataflow():
                keep = R.astype(R.greater(ids, R.const(0, "int64")), "float32")
                count = R.multiply(keep, R.const(300.0, "float32"))  # 300 is not a bf16 value
                y = R.add(x, count)
                R.output(y)
            return y

    _, o1 = run(Before, "O1")
    _, o2 = run(Before, "O2")
    assert reasons(o2)["main/count"] == ("float32", "index_values")
    assert reasons(o1)["main/y"] == ("float32", "policy")  # unchanged: widest input at O1
    assert reasons(o2)["main/y"] == ("bfloat16", "policy")  # unchanged: follow ops low at O2


# ---- end to end, against torch -------------------------------------------------------------


def _torch():
    return pytest.importorskip("torch")


def _build(model, inputs, level="O2", dtype=BF16):
    mod, params = tvmamp.from_torch(model, inputs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no avx512_bf16 on the test machine: a speed warning
        exe = tvmamp.build(mod, level, "llvm", dtype=dtype, params=params)
    return exe(*[np.asarray(i) for i in inputs])


def _rope_modules(torch):
    inv = 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16))

    class Rope(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("inv", inv.clone())

        def forward(self, x):  # x: [T, 16]
            t = torch.arange(x.shape[0], dtype=torch.float32)
            emb = torch.cat([torch.outer(t, self.inv)] * 2, -1)
            return x * emb.cos() + x.flip(-1) * emb.sin()

    class MaskRope(torch.nn.Module):  # transformers' LlamaRotaryEmbedding, positions from a mask
        def __init__(self):
            super().__init__()
            self.register_buffer("inv", inv.clone())

        def forward(self, x, mask):
            pos = mask.long().cumsum(-1) - 1
            inv_b = self.inv[None, :, None].float().expand(pos.shape[0], -1, 1)
            freqs = (inv_b @ pos[:, None, :].float()).transpose(1, 2)
            emb = torch.cat((freqs, freqs), -1)
            return x * emb.cos() + x.flip(-1) * emb.sin()

    return Rope, MaskRope


def test_rope_over_512_positions_matches_torch_at_o2():
    """Before: max error 0.76 of the output's size at O2 (positions rounded to bf16)."""
    torch = _torch()
    rope, _ = _rope_modules(torch)
    x = torch.randn(512, 16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = rope().eval()(x).numpy()
    assert_close(_build(rope().eval(), (x,)), ref, **tolerance(BF16))


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_rope_with_positions_from_a_mask_matches_torch(level):
    """Before: max error 0.92 of the output's size at O1 and O2 (the K=1 matmul ran in bf16)."""
    torch = _torch()
    _, rope = _rope_modules(torch)
    x = torch.randn(2, 600, 16, generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 600, dtype=torch.int64)
    mask[1, :50] = 0  # left padding
    with torch.no_grad():
        ref = rope().eval()(x, mask).numpy()
    assert_close(_build(rope().eval(), (x, mask), level), ref, **tolerance(BF16))


def test_bicubic_upsampling_coordinates_match_torch_at_o2():
    """torch.export decomposes bicubic interpolation into arange/floor index arithmetic.
    Before: max error 0.26 of the output's size at O2 for 40 -> 120."""
    torch = _torch()
    import torch.nn.functional as F

    class Up(torch.nn.Module):
        def forward(self, x):
            return F.interpolate(x, size=(120, 120), mode="bicubic", align_corners=False)

    x = torch.randn(1, 2, 40, 40, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = Up()(x).numpy()
    assert_close(_build(Up(), (x,)), ref, **tolerance(BF16, scale=2.0))


# ---- ops TVM cannot lower (or lowers wrongly) in bfloat16 ----------------------------------


def _check_against_torch(torch, fn, x, levels=("O2",), exact=False):
    class M(torch.nn.Module):
        def forward(self, x):
            return fn(x)

    with torch.no_grad():
        ref = M()(x).numpy()
    for level in levels:
        out = _build(M(), (x,), level)
        if exact:
            np.testing.assert_array_equal(out, ref)
        else:
            assert_close(out, ref, **tolerance(BF16, scale=3.0))


def test_median_returns_input_values_at_o2():
    """Before: TVM's bf16 median returned -1.16 for a median of 0.05."""
    torch = _torch()
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(3))
    # median only selects: in fp32 it is exact, on the bf16-rounded values of its low input
    # (O2 runs nothing low in front of it here)
    _check_against_torch(torch, lambda x: torch.median(x, 1)[0], x, ("O2", "O3"), exact=True)


@pytest.mark.parametrize(
    "name",
    ["pad_circular", "conv_circular", "fmod", "nan_to_num", "isinf"],
)
def test_ops_without_bf16_kernels_build_and_match_torch_at_o2(name):
    """Each of these failed to compile at O2 bf16 on LLVM (slice_scatter, mod, isnan/isinf)."""
    torch = _torch()
    import torch.nn.functional as F

    conv = torch.nn.Conv2d(4, 3, 3, padding=1, padding_mode="circular").eval()
    fns = {
        "pad_circular": lambda x: F.pad(x, (2, 1, 1, 2), mode="circular"),
        "conv_circular": conv,
        "fmod": lambda x: torch.fmod(x, 1.3),
        "nan_to_num": lambda x: torch.nan_to_num(x, nan=0.0, posinf=7.0, neginf=-7.0),
        "isinf": lambda x: torch.where(torch.isinf(x), torch.zeros_like(x), x),
    }
    x = torch.randn(2, 4, 9, 16, generator=torch.Generator().manual_seed(4))
    if name in ("nan_to_num", "isinf"):
        x[0, 0, 0, :3] = torch.tensor([float("nan"), float("inf"), -float("inf")])
        if name == "isinf":
            x[0, 0, 0, 0] = 0.5  # isinf does not replace NaN
    _check_against_torch(torch, fns[name], x)


def _median_lower(x, axis):
    return np.sort(x, axis)[..., (x.shape[axis] - 1) // 2]


# distinct multiples of 1/8: exact in bfloat16, so the low ops in front of some cases are exact
XF = (np.random.default_rng(5).permutation(48) - 24).astype("float32").reshape(3, 16) / 8
X = XF.copy()
X[0, :3] = [np.nan, np.inf, -np.inf]
ALPHA = np.full(3, 0.2, "float32")
NO_BF16_CASES = {
    # op: (Relax expression of x, numpy reference, input)
    "isnan": (lambda x: relax.op.isnan(x), np.isnan, X),
    "isinf": (lambda x: relax.op.isinf(x), np.isinf, X),
    "isfinite": (lambda x: relax.op.isfinite(x), np.isfinite, X),
    "mod": (
        lambda x: relax.op.mod(x, relax.const(np.float32(1.3))),
        lambda x: np.fmod(x, np.float32(1.3)),
        XF,
    ),
    "slice_scatter": (
        lambda x: relax.op.slice_scatter(
            x, relax.op.strided_slice(x, [1], [0], [4]), 2, 6, 1, axis=1
        ),
        lambda x: np.concatenate([x[:, :2], x[:, :4], x[:, 6:]], 1),
        XF,
    ),
    "nn.prelu": (
        lambda x: relax.op.nn.prelu(x, relax.const(ALPHA), axis=0),
        lambda x: np.where(x > 0, x, x * 0.2),
        XF,
    ),
    "log_add_exp": (
        lambda x: relax.op.log_add_exp(x, relax.op.flip(x, 1)),
        lambda x: np.logaddexp(x, x[:, ::-1]),
        XF,
    ),
    "median": (
        lambda x: relax.TupleGetItem(relax.op.median(x, axis=[1]), 0),
        lambda x: _median_lower(x, 1),
        XF,
    ),
    "sort": (lambda x: relax.op.sort(x, 1), lambda x: np.sort(x, 1), XF),
    "argsort": (lambda x: relax.op.argsort(x, 1, dtype="int64"), lambda x: np.argsort(x, 1), XF),
    "topk": (
        lambda x: relax.TupleGetItem(relax.op.topk(x, 3, 1), 0),
        lambda x: -np.sort(-x, 1)[:, :3],
        XF,
    ),
    "argmax": (lambda x: relax.op.argmax(x, 1), lambda x: np.argmax(x, 1), XF),
    "argmin": (lambda x: relax.op.argmin(x, 1), lambda x: np.argmin(x, 1), XF),
}


@pytest.mark.parametrize("name", sorted(NO_BF16_CASES))
def test_ops_without_a_bf16_kernel_stay_fp32_even_at_o3(name):
    """O3 runs every op low but those TVM cannot lower in bfloat16 (op_lists.NO_BFLOAT16).
    Before: isnan, isinf, isfinite, mod, slice_scatter, prelu, log_add_exp and argmin/argmax
    failed to compile; median, sort, argsort and topk returned wrong values."""
    expr, reference, x = NO_BF16_CASES[name]
    bb = relax.BlockBuilder()
    param = relax.Var("x", relax.TensorType(x.shape, "float32"))
    with bb.function("main", [param]):
        with bb.dataflow():
            out = bb.emit_output(bb.emit(expr(param)))
        bb.emit_func_output(out)
    converted = tvmamp.convert(bb.get(), "O3", "llvm", dtype=BF16)
    last = converted.report.nodes[-1]
    assert (last.op, last.dtype) == (f"relax.{name}", "float32")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = tvmamp.build(bb.get(), "O3", "llvm", dtype=BF16)(x)
    got = got.numpy() if hasattr(got, "numpy") else np.asarray(got)
    np.testing.assert_allclose(got, reference(x), rtol=1e-6, atol=1e-6)
