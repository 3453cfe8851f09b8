"""Row rearrangements moved across matmuls with a matrix weight (torch MHA's transposes)."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tolerances import assert_close
from tvm import relax

import tvmamp
from tvmamp.pipeline import run_front_phases
from tvmamp.relay_passes.row_layout import SinkRowLayoutBelowMatmul

ZNVER4 = "llvm -mcpu=znver4 -mattr=-sse4a -num-cores=1"


def _tensor(name, shape, dtype="float32"):
    return relax.Var(name, relax.TensorType(shape, dtype))


def _module(params, body):
    """A function of ``params`` whose dataflow block ``body(bb, *params)`` emits, its value the
    output."""
    bb = relax.BlockBuilder()
    with bb.function("main", params):
        with bb.dataflow():
            out = bb.emit_output(body(bb, *params))
        bb.emit_func_output(out)
    return bb.get()


def test_input_rearrangement_sinks_below_the_matmul_into_the_copies_after_it():
    """``permute(reshape(astype(matmul(permute(x), w))))``: the transpose moves into the copy
    after the matmul (the head split), so the matmul reads ``x`` as it is."""

    def params():
        return [_tensor("x", (2, 3, 16)), _tensor("w", (16, 8))]

    def before(bb, x, w):
        m = bb.emit(relax.op.matmul(bb.emit(relax.op.permute_dims(x, [1, 0, 2])), w))
        heads = bb.emit(relax.op.reshape(bb.emit(relax.op.astype(m, "float16")), (3, 2, 2, 4)))
        return relax.op.permute_dims(heads, [1, 2, 0, 3])

    def after(bb, x, w):
        m = bb.emit(relax.op.astype(bb.emit(relax.op.matmul(x, w)), "float16"))
        heads = bb.emit(
            relax.op.reshape(bb.emit(relax.op.permute_dims(m, [1, 0, 2])), (3, 2, 2, 4))
        )
        return relax.op.permute_dims(heads, [1, 2, 0, 3])

    got = SinkRowLayoutBelowMatmul()(_module(params(), before))
    tvm.ir.assert_structural_equal(got, _module(params(), after))


@pytest.mark.parametrize(
    "case",
    [
        "reader-not-a-copy",
        "reader-only-a-view",
        "input-already-a-copy",
        "output-side",
        "per-element-operand",
        "batched-weight",
    ],
)
def test_moves_that_would_cost_a_copy_or_change_values_are_left(case):
    x, w, b = _tensor("x", (2, 3, 16)), _tensor("w", (16, 8)), _tensor("b", (3, 2, 8))
    w3 = _tensor("w3", (3, 16, 8))

    def body(bb, x, w, b, w3):
        if case == "reader-not-a-copy":  # sinking would add a transposing copy before exp
            m = bb.emit(relax.op.matmul(bb.emit(relax.op.permute_dims(x, [1, 0, 2])), w))
            return relax.op.exp(m)
        if case == "reader-only-a-view":  # the reshape is free; sinking would make it a copy
            m = bb.emit(relax.op.matmul(bb.emit(relax.op.permute_dims(x, [1, 0, 2])), w))
            return relax.op.reshape(m, (3, 2, 2, 4))
        if case == "input-already-a-copy":  # the transpose joins x's copy where it is
            t = bb.emit(relax.op.permute_dims(bb.emit(relax.op.reshape(x, (3, 2, 16))), [1, 0, 2]))
            return relax.op.reshape(bb.emit(relax.op.matmul(t, w)), (6, 8))
        if case == "output-side":  # moving it above the matmul was measured slower
            m = bb.emit(relax.op.matmul(bb.emit(relax.op.exp(x)), w))
            return relax.op.permute_dims(m, [1, 0, 2])
        if case == "per-element-operand":  # b holds a value per row: rows may not move
            m = bb.emit(relax.op.matmul(bb.emit(relax.op.permute_dims(x, [1, 0, 2])), w))
            return relax.op.reshape(bb.emit(relax.op.add(m, b)), (6, 8))
        m = bb.emit(relax.op.matmul(bb.emit(relax.op.permute_dims(x, [1, 0, 2])), w3))
        return relax.op.reshape(m, (6, 8))

    mod = _module([x, w, b, w3], body)
    tvm.ir.assert_structural_equal(SinkRowLayoutBelowMatmul()(mod), mod)


@pytest.mark.parametrize("batch_first", [True, False])
def test_torch_attention_layer_gives_the_same_values(rng, batch_first):
    """A TransformerEncoderLayer with both moves (fp32 O0 against torch, bf16 O2 within its
    rounding), 3 x 20 tokens."""
    import torch

    torch.manual_seed(int(rng.integers(1 << 30)))
    layer = torch.nn.TransformerEncoderLayer(64, 4, 128, batch_first=batch_first).eval()
    shape = (3, 20, 64) if batch_first else (20, 3, 64)
    x = torch.from_numpy(rng.standard_normal(shape).astype("float32"))
    with torch.inference_mode():
        ref = layer(x).numpy()
    mod, params = tvmamp.from_torch(layer, (x,))
    converted = tvmamp.convert(mod, "O2", ZNVER4, dtype="bfloat16", params=params)
    kernels = [g.name_hint for g in run_front_phases(converted).get_global_vars()]
    # batch first: the input is cast in place, no longer cast and transposed by one kernel
    assert not any("cast_transpose" in k for k in kernels), kernels
    out = np.asarray(tvmamp.build(mod, "O0", "llvm", params=params)(x.numpy()))
    assert_close(out, ref, rtol=1e-4, atol=1e-4)
    low = np.asarray(tvmamp.build(mod, "O2", "llvm", dtype="bfloat16", params=params)(x.numpy()))
    assert_close(low.astype("float32"), ref, rtol=5e-2, atol=5e-2)
