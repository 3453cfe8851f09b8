"""TakeToSlice: ``take`` of one constant index is a slice (not an embedding lookup)."""

from __future__ import annotations

import pytest
import tvm
from tolerances import assert_close, tolerance
from tvm.script import ir as I
from tvm.script import relax as R

import tvmamp
from tvmamp.relay_passes.take_to_slice import TakeToSlice


@I.ir_module
class Selects:
    @R.function
    def main(x: R.Tensor((3, 4, 8), "float32"), ids: R.Tensor((5,), "int64")):
        with R.dataflow():
            q = R.take(x, R.const(0, "int64"), axis=0)
            v = R.take(x, R.const(-1, "int64"), axis=-2)  # the last row of axis 1
            far = R.take(x, R.const(3, "int64"), axis=0)  # out of range: left to take
            rows = R.take(x, ids, axis=2)  # run-time ids: a gather
            R.output(q, v, far, rows)
        return (q, v, far, rows)


@I.ir_module
class Sliced:
    @R.function
    def main(x: R.Tensor((3, 4, 8), "float32"), ids: R.Tensor((5,), "int64")):
        with R.dataflow():
            s = R.strided_slice(x, axes=[0], begin=[0], end=[1])
            q = R.squeeze(s, axis=[0])
            t = R.strided_slice(x, axes=[1], begin=[3], end=[4])
            v = R.squeeze(t, axis=[1])
            far = R.take(x, R.const(3, "int64"), axis=0)
            rows = R.take(x, ids, axis=2)
            R.output(q, v, far, rows)
        return (q, v, far, rows)


def test_a_constant_index_becomes_a_slice_and_a_squeeze():
    tvm.ir.assert_structural_equal(TakeToSlice()(Selects), Sliced)


@pytest.mark.parametrize("level", ["O0", "O2"])
def test_multihead_attention_runs_its_qkv_split_low_and_matches_torch(level, rng):
    """``nn.MultiheadAttention`` selects q, k and v from its in-projection with ``x[i]``: at O2
    the selects run in bf16 (they ran fp32 as lookup_table, and the GEMM wrote fp32)."""
    import torch

    torch.manual_seed(0)
    attention = torch.nn.MultiheadAttention(32, 4, batch_first=True).eval()

    class SelfAttention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attention = attention

        def forward(self, x):
            return self.attention(x, x, x, need_weights=False)[0]

    x = torch.from_numpy(rng.standard_normal((2, 6, 32)).astype("float32"))
    mod, params = tvmamp.from_torch(SelfAttention().eval(), (x,))
    converted = tvmamp.convert(mod, level, "llvm", "bfloat16", params=params)
    assert "R.take" not in converted.mod.script()
    if level == "O2":
        assert dict(converted.report.ops["relax.strided_slice"]) == {"bfloat16": 3}
    exe = tvmamp.build(mod, level, "llvm", "bfloat16", params=params)
    with torch.no_grad():
        ref = SelfAttention()(x).numpy()
    tol = tolerance("float32") if level == "O0" else tolerance("bfloat16")
    assert_close(exe(x.numpy()), ref, **tol)
