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


def _calls(func):
    found = []
    tvm.relax.analysis.post_order_visit(
        func, lambda e: found.append(e) if isinstance(e, tvm.relax.Call) else None
    )
    return [c for c in found if isinstance(c.op, tvm.ir.Op)]
