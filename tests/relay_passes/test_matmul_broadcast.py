"""SimplifyMatmulBroadcast: the importers' broadcast_to around matmul operands is dropped."""

from __future__ import annotations

import pytest
import tvm
from tolerances import assert_close, tolerance
from tvm.script import relax as R

import tvmamp
from tvmamp.relay_passes.matmul_broadcast import SimplifyMatmulBroadcast


@tvm.script.ir_module
class Imported:
    """What from_torch makes of ``x[4, 8, 16] @ W[16, 24]`` (torch's expand + bmm)."""

    @R.function
    def main(x: R.Tensor((4, 8, 16), "float32"), w: R.Tensor((16, 24), "float32")):
        with R.dataflow():
            a = R.broadcast_to(x, R.shape([4, 8, 16]))
            b = R.broadcast_to(w, R.shape([4, 16, 24]))
            y = R.matmul(a, b, out_dtype="float32")
            R.output(y)
        return y


@tvm.script.ir_module
class Simplified:
    @R.function
    def main(x: R.Tensor((4, 8, 16), "float32"), w: R.Tensor((16, 24), "float32")):
        with R.dataflow():
            y = R.matmul(x, w, out_dtype="float32")
            R.output(y)
        return y


@tvm.script.ir_module
class OtherBatch:
    """The broadcast batch (4) is not the left operand's (1): the broadcast changes the result."""

    @R.function
    def main(x: R.Tensor((1, 8, 16), "float32"), w: R.Tensor((16, 24), "float32")):
        with R.dataflow():
            b = R.broadcast_to(w, R.shape([4, 16, 24]))
            y = R.matmul(x, b, out_dtype="float32")
            R.output(y)
        return y


def test_broadcasts_of_both_operands_are_dropped():
    tvm.ir.assert_structural_equal(SimplifyMatmulBroadcast()(Imported), Simplified)


def test_a_broadcast_that_changes_the_result_shape_stays():
    tvm.ir.assert_structural_equal(SimplifyMatmulBroadcast()(OtherBatch), OtherBatch)


def test_same_value_after_the_rewrite(rng):
    x = rng.standard_normal((4, 8, 16)).astype("float32")
    w = rng.standard_normal((16, 24)).astype("float32")
    out = tvmamp.build(Imported, level="O0", target="llvm -num-cores=1")(x, w)
    assert_close(out, x @ w, **tolerance("float32"))


def test_torch_linear_on_3d_input_keeps_one_copy_of_its_weight():
    """A Linear applied to [seq, batch, features] (torch's MultiheadAttention in-proj).

    Before, FoldConstant turned ``broadcast_to(W.T, [seq, ...])`` into ``seq`` copies of the
    weight, which the bf16 GEMM then packed one by one.
    """
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    linear = torch.nn.Linear(32, 48).eval()
    x = torch.randn(16, 4, 32)
    mod, params = tvmamp.from_torch(linear, (x,))
    converted = tvmamp.convert(mod, "O0", "llvm -num-cores=1", params=params)
    ops = {c.op.name for c in _calls(converted.mod["main"])}
    assert "relax.broadcast_to" not in ops and "relax.matmul" in ops
    exe = tvmamp.build(mod, level="O0", target="llvm -num-cores=1", params=params)
    with torch.inference_mode():
        ref = linear(x).numpy()
    assert_close(exe(x.numpy()), ref, **tolerance("float32"))


def _op(value):
    return value.op.name if isinstance(value, tvm.relax.Call) else None


def _calls(func):
    found = []
    tvm.relax.analysis.post_order_visit(
        func, lambda e: found.append(e) if isinstance(e, tvm.relax.Call) else None
    )
    return [c for c in found if isinstance(c.op, tvm.ir.Op)]


@tvm.script.ir_module
class Flattened:
    """What torch.export makes of attention scores and a Linear on a 3-D input: matmuls between
    reshapes that flatten the leading dimensions, with elementwise ops on either side of the
    reshape back."""

    @R.function
    def main(
        q: R.Tensor((1, 6, 10, 8), "float32"),
        kt: R.Tensor((1, 6, 8, 10), "float32"),
        x: R.Tensor((2, 5, 8), "float32"),
        w: R.Tensor((8, 16), "float32"),
        bias: R.Tensor((16,), "float32"),
        res: R.Tensor((2, 5, 16), "float32"),
    ):
        with R.dataflow():
            qf = R.reshape(q, R.shape([6, 10, 8]))
            kf = R.reshape(kt, R.shape([6, 8, 10]))
            s = R.matmul(qf, kf, out_dtype="float32")
            s4 = R.reshape(s, R.shape([1, 6, 10, 10]))
            scaled = R.multiply(s4, R.const(0.125, "float32"))
            xf = R.reshape(x, R.shape([10, 8]))
            h = R.matmul(xf, w, out_dtype="float32")
            hb = R.add(bias, h)
            hg = R.nn.gelu(hb)
            h3 = R.reshape(hg, R.shape([2, 5, 16]))
            out = R.add(h3, res)
            R.output(scaled, out)
        return (scaled, out)


@tvm.script.ir_module
class Unflattened:
    @R.function
    def main(
        q: R.Tensor((1, 6, 10, 8), "float32"),
        kt: R.Tensor((1, 6, 8, 10), "float32"),
        x: R.Tensor((2, 5, 8), "float32"),
        w: R.Tensor((8, 16), "float32"),
        bias: R.Tensor((16,), "float32"),
        res: R.Tensor((2, 5, 16), "float32"),
    ):
        with R.dataflow():
            s = R.matmul(q, kt, out_dtype="float32")
            scaled = R.multiply(s, R.const(0.125, "float32"))
            h = R.matmul(x, w, out_dtype="float32")
            hb = R.add(bias, h)
            hg = R.nn.gelu(hb)
            out = R.add(hg, res)
            R.output(scaled, out)
        return (scaled, out)


def test_flattened_matmuls_and_their_epilogues_are_unflattened():
    """FuseOps stops a matmul's epilogue at a reshape: the scale and the residual add ran as
    kernels of their own (ViT-S/16: 0.72 ms of 13 per call, one thread)."""
    tvm.ir.assert_structural_equal(SimplifyMatmulBroadcast()(Flattened), Unflattened)


@tvm.script.ir_module
class NotAFlattening:
    """Left alone: the flat product is read twice; an epilogue operand of the full shape (it
    would need the reshape too); a batched reshape that moves rows between batches; a reshape
    back to another shape than ``matmul(a, b)``'s. (A reshape that keeps the last dimension is
    always a flattening of rows: a matmul with one matrix is row by row.)"""

    @R.function
    def main(
        x: R.Tensor((2, 5, 8), "float32"),
        w: R.Tensor((8, 16), "float32"),
        full: R.Tensor((10, 16), "float32"),
        y: R.Tensor((4, 6, 8), "float32"),
        v: R.Tensor((6, 8, 3), "float32"),
    ):
        with R.dataflow():
            xf = R.reshape(x, R.shape([10, 8]))
            h = R.matmul(xf, w, out_dtype="float32")
            h3 = R.reshape(h, R.shape([2, 5, 16]))
            twice = R.add(h, h)
            g = R.matmul(xf, w, out_dtype="float32")
            gf = R.add(g, full)
            g3 = R.reshape(gf, R.shape([2, 5, 16]))
            yf = R.reshape(y, R.shape([6, 4, 8]))
            vf = R.reshape(v, R.shape([6, 8, 3]))
            k = R.matmul(yf, vf, out_dtype="float32")
            k4 = R.reshape(k, R.shape([4, 6, 3]))
            m = R.matmul(xf, w, out_dtype="float32")
            m2 = R.reshape(m, R.shape([5, 32]))
            R.output(h3, twice, g3, k4, m2)
        return (h3, twice, g3, k4, m2)


def test_reshapes_that_are_not_a_flattening_stay():
    tvm.ir.assert_structural_equal(SimplifyMatmulBroadcast()(NotAFlattening), NotAFlattening)


@pytest.mark.parametrize("level", ["O0", "O2"])
def test_torch_attention_block_after_the_rewrite(level, rng):
    """Scores, scale, additive mask, softmax, values and a residual Linear, as torch exports
    them; against torch fp32, and no reshape left between a matmul and its epilogue."""
    torch = pytest.importorskip("torch")
    F = torch.nn.functional

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = torch.nn.Linear(32, 96)
            self.proj = torch.nn.Linear(32, 32)

        def forward(self, x, mask):
            b, t, _ = x.shape
            q, k, v = self.qkv(x).reshape(b, t, 3, 4, 8).permute(2, 0, 3, 1, 4)
            att = (q @ k.transpose(-2, -1)) * 8**-0.5 + mask
            y = (att.softmax(-1) @ v).transpose(1, 2).reshape(b, t, 32)
            # the same through sdpa, which scales q and k by sqrt(scale) before their matmul
            y = y + F.scaled_dot_product_attention(q, k, v, mask).transpose(1, 2).reshape(b, t, 32)
            return x + self.proj(y)

    torch.manual_seed(0)
    block = Block().eval()
    x = torch.from_numpy(rng.standard_normal((2, 11, 32)).astype("float32"))
    mask = torch.from_numpy(rng.uniform(-1, 0, (1, 1, 11, 11)).astype("float32"))
    mod, params = tvmamp.from_torch(block, (x, mask))
    converted = tvmamp.convert(mod, level, "llvm -num-cores=1", params=params)
    func = converted.mod["main"]
    matmuls = {c for c in _calls(func) if c.op.name == "relax.matmul"}
    reshaped = [c for c in _calls(func) if c.op.name == "relax.reshape"]
    values = {b.var: b.value for block in func.body.blocks for b in block.bindings}
    assert not [c for c in reshaped if values.get(c.args[0]) in matmuls]
    scaled = [a for c in matmuls for a in c.args if _op(values.get(a)) == "relax.multiply"]
    assert not scaled  # sdpa's sqrt(scale) on q and k moved to the scores
    exe = tvmamp.build(mod, level=level, target="llvm -num-cores=1", params=params)
    with torch.inference_mode():
        ref = block(x, mask).numpy()
    tol = tolerance("float32") if level == "O0" else tolerance("bfloat16")
    assert_close(exe(x.numpy(), mask.numpy()), ref, **tol)


@tvm.script.ir_module
class Scaled:
    """torch's sdpa scales both operands by sqrt(scale); the scale of a matmul operand that only
    the matmul reads moves to its result, where it fuses into the epilogue (and the operands'
    transposing copies become pure copies, the fast ones)."""

    @R.function
    def main(q: R.Tensor((2, 4, 8), "float32"), kt: R.Tensor((2, 8, 4), "float32")):
        with R.dataflow():
            qs = R.multiply(q, R.const(0.5, "float32"))
            ks = R.multiply(R.const(0.25, "float32"), kt)
            s = R.matmul(qs, ks, out_dtype="float32")
            kept = R.multiply(q, R.const(0.5, "float32"))  # read twice: stays
            t = R.matmul(kept, kt, out_dtype="float32")
            u = R.add(kept, R.const(1.0, "float32"))
            R.output(s, t, u)
        return (s, t, u)


@tvm.script.ir_module
class ScaleAfter:
    @R.function
    def main(q: R.Tensor((2, 4, 8), "float32"), kt: R.Tensor((2, 8, 4), "float32")):
        with R.dataflow():
            s1 = R.matmul(q, kt, out_dtype="float32")
            s = R.multiply(s1, R.const(0.125, "float32"))
            kept = R.multiply(q, R.const(0.5, "float32"))
            t = R.matmul(kept, kt, out_dtype="float32")
            u = R.add(kept, R.const(1.0, "float32"))
            R.output(s, t, u)
        return (s, t, u)


def test_scalar_scales_of_matmul_operands_move_to_the_result():
    after = SimplifyMatmulBroadcast()(Scaled)
    tvm.ir.assert_structural_equal(after, ScaleAfter)
