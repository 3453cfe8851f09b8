"""SpecializeDecodeStep: a decoder's one-query step as a function of its own, chosen at run
time, whose attention reads the key-value cache in place."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import tvm
from tvm import relax, tirx

import tvmamp
from tvmamp.relay_passes.decode_step import SpecializeDecodeStep, query_length


def _decoder(self_attention: bool = False, queries=None) -> tvm.IRModule:
    """``present = concat(past, x)``; attention of ``x`` over ``present`` with a bias;
    returns the attention and ``present`` (onnxruntime's GPT-2 form, one head group).
    ``self_attention``: ``x`` over itself (an encoder). ``queries``: a static query count."""
    s = tirx.Var("s", "int64") if queries is None else queries
    p = tirx.Var("p", "int64")
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, s, 4, 32), "float32"))
    past = relax.Var("past", relax.TensorType((1, p, 4, 32), "float32"))
    with bb.function("main", [x, past]):
        with bb.dataflow():
            if self_attention:
                out = bb.emit_output(relax.op.nn.attention(x, x, x))
                present = bb.emit_output(relax.op.concat([past, x], axis=1))
            else:
                present = bb.emit_output(relax.op.concat([past, x], axis=1))
                out = bb.emit_output(relax.op.nn.attention(x, present, present))
            result = bb.emit_output(relax.Tuple([out, present]))
        bb.emit_func_output(result)
    return bb.get()


def test_a_symbolic_query_length_is_found():
    func = _decoder()["main"]
    (s,) = [v for v in func.params[0].ty.shape.values if isinstance(v, tirx.Var)]
    assert query_length(func).same_as(s)
    assert query_length(_decoder(self_attention=True)["main"]) is None  # keys: the same length
    assert query_length(_decoder(queries=1)["main"]) is None  # static


def test_the_function_dispatches_to_a_one_query_copy():
    mod = SpecializeDecodeStep()(_decoder())
    names = sorted(gv.name_hint for gv in mod.get_global_vars())
    assert names == ["main", "main_any", "main_step"]
    assert "global_symbol" not in mod["main_step"].attrs  # private: only main is exported
    step_x = mod["main_step"].params[0].ty.shape.values
    assert isinstance(step_x[1], tirx.IntImm) and step_x[1].value == 1
    (binding, _) = mod["main"].body.blocks[0].bindings
    assert isinstance(binding.value, relax.If)


@pytest.mark.parametrize("mod", [_decoder(self_attention=True), _decoder(queries=3)])
def test_other_functions_are_left_alone(mod):
    tvm.ir.assert_structural_equal(SpecializeDecodeStep()(mod), mod)


def _reference(x, past):
    present = np.concatenate([past, x], axis=1).astype("float64")
    q, k = (np.transpose(a, (0, 2, 1, 3)) for a in (x.astype("float64"), present))
    scores = q @ np.transpose(k, (0, 1, 3, 2)) / np.sqrt(x.shape[-1])
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return np.transpose(probs @ k, (0, 2, 1, 3)), present


@pytest.mark.parametrize(("level", "tol"), [("O0", 1e-5), ("O2", 3e-2)])
def test_one_query_and_several_match_numpy(level, tol, rng):
    """Built once, run with one query (the step function) and with three (the general one),
    over odd cache lengths. At O2 the returned cache is the caller's fp32 values exactly
    (``relay_passes/auto_mixed_precision.py``, reason ``fp32_cache``)."""
    exe = tvmamp.build(_decoder(), level, "llvm -num-cores=1", "bfloat16")
    for queries, cached in ((1, 37), (3, 37), (1, 130)):
        x = rng.standard_normal((1, queries, 4, 32)).astype("float32")
        past = rng.standard_normal((1, cached, 4, 32)).astype("float32")
        out, present = exe(x, past)
        want, want_present = _reference(x, past)
        np.testing.assert_allclose(out, want, rtol=tol, atol=tol, err_msg=f"{queries} queries")
        if level == "O0":
            np.testing.assert_allclose(present, want_present, rtol=1e-6)
        else:  # the new keys are the GEMM-free input here, rounded only where attention reads
            np.testing.assert_array_equal(present[:, :cached], past)
            rounded = x.astype(ml_dtypes.bfloat16).astype("float32")
            np.testing.assert_array_equal(np.isin(present[:, cached:], (x, rounded)), True)


def _written_out_decoder(cross: bool = False) -> tuple[tvm.IRModule, list]:
    """A decoder whose attention is written out (optimum's and torch.export's form):
    ``x[b, s, 8] @ w`` as 2 heads of queries, keys and values, the keys and values appended to
    ``past_k`` and ``past_v`` ``[b, 2, p, 4]``, ``softmax(q @ k^T) @ v``; returns the output
    and the new caches. ``cross``: the keys are ``past_k`` alone (another sequence's, as in
    cross-attention), not extended by the queries. Returns the module and the weights."""
    b, s, p = (tirx.Var(n, "int64") for n in ("b", "s", "p"))
    rng = np.random.default_rng(3)
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((b, s, 8), "float32"))
    past_k = relax.Var("past_k", relax.TensorType((b, 2, p, 4), "float32"))
    past_v = relax.Var("past_v", relax.TensorType((b, 2, p, 4), "float32"))
    with bb.function("main", [x, past_k, past_v]):
        with bb.dataflow():
            heads, weights = [], []
            for _ in range(3):
                weights.append(rng.standard_normal((8, 8)).astype("float32") * 0.3)
                y = relax.op.matmul(x, relax.const(weights[-1]))
                y = bb.emit(relax.op.reshape(y, (b, s, 2, 4)))
                heads.append(bb.emit(relax.op.permute_dims(y, [0, 2, 1, 3])))
            q, k_new, v_new = heads
            k = past_k if cross else bb.emit(relax.op.concat([past_k, k_new], axis=2))
            v = past_v if cross else bb.emit(relax.op.concat([past_v, v_new], axis=2))
            scores = bb.emit(relax.op.matmul(q, relax.op.permute_dims(k, [0, 1, 3, 2])))
            probs = bb.emit(relax.op.nn.softmax(scores, axis=-1))
            out = bb.emit(relax.op.permute_dims(relax.op.matmul(probs, v), [0, 2, 1, 3]))
            out = bb.emit_output(relax.op.reshape(out, (b, s, 8)))
            result = bb.emit_output(relax.Tuple([out, k, v]))
        bb.emit_func_output(result)
    return bb.get(), weights


def test_written_out_attention_dispatches_one_sequence_too():
    """The scores ``q @ k^T`` over a cache that the queries extend give the query length; axis
    0 of ``x[b, s, 8]`` is a batch, so a third copy binds it to 1 as well, chosen first."""
    mod, _ = _written_out_decoder()
    s = mod["main"].params[0].ty.shape.values[1]
    assert query_length(mod["main"]).same_as(s)
    assert query_length(_written_out_decoder(cross=True)[0]["main"]) is None
    mod = SpecializeDecodeStep()(mod)
    names = sorted(gv.name_hint for gv in mod.get_global_vars())
    assert names == ["main", "main_any", "main_step", "main_step_one"]
    one = mod["main_step_one"].params[0].ty.shape.values
    assert [int(d) for d in one] == [1, 1, 8]
    step = mod["main_step"].params[0].ty.shape.values
    assert isinstance(step[0], tirx.Var) and int(step[1]) == 1
    (binding, _) = mod["main"].body.blocks[0].bindings
    assert isinstance(binding.value, relax.If)  # b == 1 and s == 1 ?
    inner = binding.value.false_branch.blocks[0].bindings[0].value
    assert isinstance(inner, relax.If)  # s == 1 ?


def _written_out_reference(weights, x, past_k, past_v):
    """numpy float64 of :func:`_written_out_decoder` with its ``weights``."""
    batch, queries, _ = x.shape
    q, k, v = (
        np.transpose((x.astype("float64") @ w).reshape(batch, queries, 2, 4), (0, 2, 1, 3))
        for w in weights
    )
    k = np.concatenate([past_k, k], axis=2)
    v = np.concatenate([past_v, v], axis=2)
    scores = q @ np.transpose(k, (0, 1, 3, 2))
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return np.transpose(probs @ v, (0, 2, 1, 3)).reshape(batch, queries, 8), k, v


@pytest.mark.parametrize(("level", "tol"), [("O0", 1e-5), ("O2", 3e-2)])
def test_written_out_decoder_matches_numpy_on_every_copy(level, tol, rng):
    """Each copy runs: one query of one sequence, one query of two, three queries."""
    mod, weights = _written_out_decoder()
    exe = tvmamp.build(mod, level, "llvm -num-cores=1", "bfloat16")
    for batch, queries, cached in ((1, 1, 37), (2, 1, 37), (1, 3, 20), (1, 1, 130)):
        x = rng.standard_normal((batch, queries, 8)).astype("float32")
        past_k, past_v = (
            rng.standard_normal((batch, 2, cached, 4)).astype("float32") for _ in "kv"
        )
        got = exe(x, past_k, past_v)
        want = _written_out_reference(weights, x, past_k, past_v)
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(g, w, rtol=tol, atol=tol, err_msg=f"{batch}x{queries}")


def test_the_dispatch_is_not_outlined():
    """The dispatcher's branches only call the copies: OutlineBranches leaves them in ``main``
    (each outlined level was one more VM function that matched every input's shape again)."""
    from tvmamp.relay_passes.branches import OutlineBranches

    mod = SpecializeDecodeStep()(_written_out_decoder()[0])
    names = sorted(gv.name_hint for gv in OutlineBranches()(mod).get_global_vars())
    assert names == ["main", "main_any", "main_step", "main_step_one"]
