"""PadAttentionKeys: attention over a ragged number of keys padded to whole vectors of keys
(``-inf`` scores, zero rows of ``v``), so that its scores and softmax run as one kernel."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

import tvmamp
from tvmamp import debugging
from tvmamp.pipeline import run_front_phases
from tvmamp.relay_passes import attention_keys
from tvmamp.relay_passes.attention_keys import PadAttentionKeys
from tvmamp.schedules.cpu import bf16_softmax
from tvmamp.targets.llvm import _host_flags


def _inputs(queries: int, keys: int, mask_rows: int | None = None) -> list[relax.Var]:
    mask_rows = queries if mask_rows is None else mask_rows
    return [
        relax.Var("q", relax.TensorType((1, 2, queries, 16), "bfloat16")),
        relax.Var("k_t", relax.TensorType((1, 2, 16, keys), "bfloat16")),
        relax.Var("v", relax.TensorType((1, 2, keys, 16), "bfloat16")),
        relax.Var("mask", relax.TensorType((1, 1, mask_rows, keys), "float32")),
    ]


def _attention(keys: int, queries: int = 8, divide: bool = False, mask_rows=None):
    """softmax(q @ k_t * 0.25 + mask) @ v over ``keys`` keys (2 heads of ``queries`` queries,
    16 wide); with ``divide``, the scores divide a constant instead of being scaled."""
    bb = relax.BlockBuilder()
    q, k_t, v, mask = _inputs(queries, keys, mask_rows)
    with bb.function("main", [q, k_t, v, mask]):
        with bb.dataflow():
            s = bb.emit(relax.op.matmul(q, k_t, out_dtype="float32"))
            if divide:
                x = bb.emit(relax.op.divide(relax.const(1.0, "float32"), s))
            else:
                x = bb.emit(relax.op.multiply(s, relax.const(0.25, "float32")))
            x = bb.emit(relax.op.add(x, mask))
            p = bb.emit(relax.op.nn.softmax(x, axis=-1))
            p = bb.emit(relax.op.astype(p, "bfloat16"))
            out = bb.emit_output(relax.op.matmul(p, v, out_dtype="float32"))
        bb.emit_func_output(out)
    return bb.get()


def _padded_attention(keys: int, padded: int, queries: int = 8, rows: int = 8):
    """:func:`_attention` over ``padded`` keys and ``rows`` queries, sliced to ``queries``."""
    extra, more = padded - keys, rows - queries
    bb = relax.BlockBuilder()
    q, k_t, v, mask = _inputs(queries, keys)
    bias = np.concatenate([np.zeros(keys), np.full(extra, -np.inf)]).astype("float32")
    with bb.function("main", [q, k_t, v, mask]):
        with bb.dataflow():
            if more:
                q = bb.emit(relax.op.nn.pad(q, [0, 0, 0, 0, 0, more, 0, 0]))
            k_pad = bb.emit(relax.op.nn.pad(k_t, [0, 0, 0, 0, 0, 0, 0, extra]))
            s = bb.emit(relax.op.matmul(q, k_pad, out_dtype="float32"))
            x = bb.emit(relax.op.multiply(s, relax.const(0.25, "float32")))
            m_pad = bb.emit(relax.op.nn.pad(mask, [0, 0, 0, 0, 0, more, 0, extra]))
            x = bb.emit(relax.op.add(x, m_pad))
            x = bb.emit(relax.op.add(x, relax.const(bias)))
            p = bb.emit(relax.op.nn.softmax(x, axis=-1))
            p = bb.emit(relax.op.astype(p, "bfloat16"))
            v_pad = bb.emit(relax.op.nn.pad(v, [0, 0, 0, 0, 0, extra, 0, 0]))
            out = relax.op.matmul(p, v_pad, out_dtype="float32")
            if more:
                out = relax.op.strided_slice(bb.emit(out), [2], [0], [queries])
            out = bb.emit_output(out)
        bb.emit_func_output(out)
    return bb.get()


@pytest.fixture
def any_size(monkeypatch):
    """Pad however small the scores (the tests' attentions are tiny)."""
    monkeypatch.setattr(attention_keys, "MIN_SCORES_BYTES", 0)


def test_ragged_keys_are_padded_with_minus_infinity_and_zero_rows(any_size):
    padded = PadAttentionKeys(lambda extents: True)(_attention(60))
    tvm.ir.assert_structural_equal(padded, _padded_attention(60, 64))


def test_ragged_queries_are_padded_to_whole_tiles_and_sliced_off(any_size):
    """60 queries: 64 rows, so that neither GEMM copies its left operand to pad its rows; the
    mask's query axis is padded too, and the result is sliced back to 60 rows."""
    padded = PadAttentionKeys(lambda extents: True)(_attention(60, queries=60))
    tvm.ir.assert_structural_equal(padded, _padded_attention(60, 64, queries=60, rows=64))


def test_the_merged_kernels_extents_are_asked(any_size):
    asked = []
    PadAttentionKeys(lambda extents: asked.append(extents) or False)(_attention(60))
    assert asked == [[2, 8, 64, 16]]


@pytest.mark.parametrize(
    ("module", "why"),
    [
        (_attention(64), "whole vectors already"),
        (_attention(20), "12 padded keys of 20: more than MAX_KEY_PADDING"),
        (_attention(60, divide=True), "the scores as a divisor"),
    ],
)
def test_left_alone(any_size, module, why):
    tvm.ir.assert_structural_equal(PadAttentionKeys(lambda extents: True)(module), module), why


def test_scores_small_enough_for_the_cache_are_left_alone():
    module = _attention(60)
    tvm.ir.assert_structural_equal(PadAttentionKeys(lambda extents: True)(module), module)


@I.ir_module
class ScoresReadTwice:
    @R.function
    def main(
        q: R.Tensor((1, 2, 8, 16), "bfloat16"),
        k_t: R.Tensor((1, 2, 16, 60), "bfloat16"),
        v: R.Tensor((1, 2, 60, 16), "bfloat16"),
    ):
        with R.dataflow():
            s = R.matmul(q, k_t, out_dtype="float32")
            p = R.nn.softmax(s, axis=-1)
            c = R.astype(p, "bfloat16")
            o = R.matmul(c, v, out_dtype="float32")
            R.output(o, s)
        return (o, s)


def test_scores_with_another_reader_are_left_alone(any_size):
    result = PadAttentionKeys(lambda extents: True)(ScoresReadTwice)
    tvm.ir.assert_structural_equal(result, ScoresReadTwice)


def _reference(q, k_t, v, mask) -> np.ndarray:
    q, k_t, v = (np.asarray(a, dtype="float64") for a in (q, k_t, v))
    x = q @ k_t * 0.25 + mask
    p = np.exp(x - x.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v


@pytest.mark.parametrize("cores", [1, 2])
def test_padded_attention_runs_as_one_kernel_and_matches_float64(any_size, rng, cores):
    """60 keys and 61 queries, a mask with -inf entries: the merged kernel over 64 keys and
    64 queries gives the attention of the 60 keys for the 61 queries (bf16 probabilities, so
    a bf16 tolerance)."""
    if "avx512_bf16" not in _host_flags():
        pytest.skip("the merged scores-and-softmax kernel needs avx512_bf16")
    target = {"kind": "llvm", "mcpu": "znver4", "mattr": ["-sse4a"], "num-cores": cores}
    exe = tvmamp.build(_attention(60, queries=61), "O0", target)
    q, k_t, v = (
        rng.standard_normal(shape).astype(ml_dtypes.bfloat16)
        for shape in ((1, 2, 61, 16), (1, 2, 16, 60), (1, 2, 60, 16))
    )
    mask = rng.standard_normal((1, 1, 61, 60)).astype("float32")
    mask[..., 7] = -np.inf  # a masked key stays masked
    out = np.asarray(exe(q, k_t, v, mask))
    ref = _reference(q, k_t, v, mask)
    assert np.abs(out - ref).max() <= 2e-2 * np.abs(ref).max()
    tensors = [tvm.runtime.tensor(np.ascontiguousarray(a)) for a in (q, k_t, v, mask)]
    kernels = [r.name for r in debugging.profile(exe, tensors).records]
    assert any("matmul" in k and "softmax" in k for k in kernels), kernels


@pytest.mark.parametrize("mcpu", ["znver4", "sapphirerapids"])
def test_the_padded_attention_merges_on_both_bf16_paths(any_size, mcpu):
    """Compiled only (AMX may be absent here): the merged kernel is formed over the padded
    keys on the vdpbf16ps path and on AMX (61 queries padded to 64 rows, AMX's tile rows)."""
    target = {"kind": "llvm", "mcpu": mcpu, "num-cores": 2}
    converted = tvmamp.convert(_attention(60, queries=61), "O0", target)
    lowered = run_front_phases(converted)
    merged = [
        f
        for gv, f in lowered.functions_items()
        if isinstance(f, tvm.tirx.PrimFunc)
        and "matmul" in gv.name_hint
        and "softmax" in gv.name_hint
    ]
    assert len(merged) == 1
    rule = bf16_softmax.CPUGemmSoftmaxBF16()
    with converted.target:
        assert rule.apply(merged[0], converted.target, False) is not None


def test_torchs_safe_softmax_is_padded_too(any_size, rng):
    """``F.scaled_dot_product_attention`` (Hugging Face's default attention) imports with
    torch's safe softmax, ``where(all(x == -inf), 0, softmax(x))``: it is rebuilt over the
    padded scores, merged into one kernel, and matches torch (a query whose keys are all
    masked gives zeros, as torch's does)."""
    if "avx512_bf16" not in _host_flags():
        pytest.skip("the merged scores-and-softmax kernel needs avx512_bf16")
    import torch

    class Attention(torch.nn.Module):
        def forward(self, q, k, v, mask):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    q, k, v = (
        torch.from_numpy(rng.standard_normal((1, 2, n, 16)).astype("float32")) for n in (61, 60, 60)
    )
    mask = torch.from_numpy(rng.standard_normal((1, 1, 61, 60)).astype("float32"))
    mask[..., 3, :] = -torch.inf  # query 3 sees no key
    mod, params = tvmamp.from_torch(Attention().eval(), (q, k, v, mask))
    target = {"kind": "llvm", "mcpu": "znver4", "mattr": ["-sse4a"], "num-cores": 1}
    converted = tvmamp.convert(mod, "O2", target, dtype="bfloat16", params=params)
    kernels = [gv.name_hint for gv, _ in run_front_phases(converted).functions_items()]
    assert any("matmul" in k and "softmax" in k for k in kernels), kernels
    exe = tvmamp.build(mod, "O2", target, dtype="bfloat16", params=params)
    out = np.asarray(exe(*(t.numpy() for t in (q, k, v, mask))))
    with torch.inference_mode():
        ref = Attention()(q, k, v, mask).numpy()
    assert np.isnan(ref[0, :, 3]).all() or np.abs(ref[0, :, 3]).max() == 0  # torch's own choice
    np.testing.assert_array_equal(out[0, :, 3], np.nan_to_num(ref[0, :, 3], nan=0.0))
    keep = np.ones(61, dtype=bool)
    keep[3] = False
    err = np.abs(out[..., keep, :] - ref[..., keep, :]).max() / np.abs(ref[..., keep, :]).max()
    assert err <= 2e-2
