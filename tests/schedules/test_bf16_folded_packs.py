"""Weight packs that FoldConstant evaluates at compile time round fp32 without avx512_bf16.

TVM's FoldConstant builds each function it folds for a plain "llvm" target. A pack that rounds
an fp32 weight with ``vcvtneps2bf16`` becomes a ``__truncsfbf2`` call there, which TVM's JIT
cannot resolve: the build crashed with a segfault. A Linear whose weight is a slice of a
parameter (``nn.MultiheadAttention``'s cross-attention, ``w.chunk(3)``) took that path.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import tvm
from tvm import relax, te

import tvmamp
from tvmamp.schedules.cpu.bf16_passes import _folded_functions
from tvmamp.targets.llvm import _host_flags

# Build for an avx512_bf16 CPU whatever the host (the crash was at build time); run on one.
TARGET = "llvm -mcpu=znver4 -mattr=-sse4a -num-cores=1"


class ChunkedLinear(torch.nn.Module):
    """``F.linear`` with one third of a packed weight, as MultiheadAttention projects q."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(96, 32))

    def forward(self, x):
        wq, _, _ = self.w.chunk(3)
        return torch.nn.functional.linear(x, wq)


class CrossAttention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = torch.nn.MultiheadAttention(32, 4, batch_first=True)

    def forward(self, q, kv):
        return self.attn(q, kv, kv, need_weights=False)[0]


@pytest.mark.parametrize("level", ["O1", "O2"])
@pytest.mark.parametrize("name", ["chunked_linear", "cross_attention"])
def test_sliced_weights_build_and_match_torch(level, name):
    torch.manual_seed(0)
    if name == "chunked_linear":
        model, inputs = ChunkedLinear().eval(), (torch.randn(12, 32),)
    else:
        model, inputs = CrossAttention().eval(), (torch.randn(2, 5, 32), torch.randn(2, 7, 32))
    mod, params = tvmamp.from_torch(model, inputs)
    exe = tvmamp.build(mod, level, TARGET, params=params)
    if "avx512_bf16" not in _host_flags():
        pytest.skip("built; the host CPU lacks avx512_bf16 to run it")
    with torch.no_grad():
        ref = model(*inputs).numpy()
    out = exe(*(i.numpy() for i in inputs))
    np.testing.assert_allclose(out, ref, rtol=3e-2, atol=3e-2 * float(np.abs(ref).max()))


def _chain() -> tvm.IRModule:
    """``double(const) -> negate -> add(x, .)``, each a ``call_tir``."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((4,), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            ones = relax.const(np.ones(4, "float32"))
            w = bb.emit(
                bb.call_te(
                    lambda a: te.compute((4,), lambda i: a[i] * 2),
                    ones,
                    primfunc_name_hint="double",
                )
            )
            v = bb.emit(
                bb.call_te(
                    lambda a: te.compute((4,), lambda i: -a[i]), w, primfunc_name_hint="negate"
                )
            )
            y = bb.emit(
                bb.call_te(
                    lambda a, b: te.compute((4,), lambda i: a[i] + b[i]),
                    x,
                    v,
                    primfunc_name_hint="add",
                )
            )
            out = bb.emit_output(y)
        bb.emit_func_output(out)
    return bb.get()


def test_folded_functions_follow_folded_results():
    """``double`` has constant arguments, ``negate`` reads its result (folded next), and
    ``add`` reads the input: only the first two are built by FoldConstant."""
    mod = _chain()
    assert {gvar.name_hint for gvar in _folded_functions(mod)} == {"double", "negate"}
    folded = relax.transform.FoldConstant()(mod)  # what the analysis predicts
    calls = []
    relax.analysis.post_order_visit(
        folded["main"], lambda e: calls.append(e) if isinstance(e, relax.Call) else None
    )
    assert [c.args[0].name_hint for c in calls if c.op == tvm.ir.Op.get("relax.call_tir")] == [
        "add"
    ]
