"""DecomposeAttention: relax.nn.attention as its GEMMs and softmax (onnxruntime's fused
Attention ran as one TVM kernel at 2 % of peak, 3x onnxruntime's time)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

import tvmamp
from tvmamp.relay_passes.attention_ops import DecomposeAttention


@I.ir_module
class Fused:
    @R.function
    def main(
        q: R.Tensor((2, 6, 4, 8), "bfloat16"),
        k: R.Tensor((2, 9, 4, 8), "bfloat16"),
        v: R.Tensor((2, 9, 4, 8), "bfloat16"),
        b: R.Tensor((2, 4, 6, 9), "float32"),
    ):
        with R.dataflow():
            o = R.nn.attention(q, k, v, b, scale=0.5)
            R.output(o)
        return o


@I.ir_module
class Written:
    @R.function
    def main(
        q: R.Tensor((2, 6, 4, 8), "bfloat16"),
        k: R.Tensor((2, 9, 4, 8), "bfloat16"),
        v: R.Tensor((2, 9, 4, 8), "bfloat16"),
        b: R.Tensor((2, 4, 6, 9), "float32"),
    ):
        with R.dataflow():
            qt = R.permute_dims(q, [0, 2, 1, 3])
            kt = R.permute_dims(k, [0, 2, 3, 1])
            s = R.matmul(qt, kt, out_dtype="float32")
            s1 = R.multiply(s, R.const(0.5, "float32"))
            s2 = R.add(s1, b)
            p = R.nn.softmax(s2, axis=-1)
            p1 = R.astype(p, "bfloat16")
            vt = R.permute_dims(v, [0, 2, 1, 3])
            o = R.matmul(p1, vt, out_dtype="float32")
            o1 = R.astype(o, "bfloat16")
            o2 = R.permute_dims(o1, [0, 2, 1, 3])
            R.output(o2)
        return o2


def test_attention_becomes_its_gemms_and_softmax():
    tvm.ir.assert_structural_equal(
        relax.transform.Normalize()(DecomposeAttention()(Fused)), Written
    )


@I.ir_module
class FromCache:
    """Keys and values read from a cache laid out ``(batch, heads, total, dim)``, permuted to
    attention's ``(batch, total, heads, dim)`` (tvmamp's ONNX ``Attention`` with ``past``)."""

    @R.function
    def main(
        q: R.Tensor((2, 6, 4, 8), "float32"),
        kc: R.Tensor((2, 4, 9, 8), "float32"),
        vc: R.Tensor((2, 4, 9, 8), "float32"),
    ):
        with R.dataflow():
            k = R.permute_dims(kc, [0, 2, 1, 3])
            v = R.permute_dims(vc, [0, 2, 1, 3])
            o = R.nn.attention(q, k, v, scale=0.5)
            R.output(o)
        return o


@I.ir_module
class FromCacheWritten:
    @R.function
    def main(
        q: R.Tensor((2, 6, 4, 8), "float32"),
        kc: R.Tensor((2, 4, 9, 8), "float32"),
        vc: R.Tensor((2, 4, 9, 8), "float32"),
    ):
        with R.dataflow():
            qt = R.permute_dims(q, [0, 2, 1, 3])
            kt = R.permute_dims(kc, [0, 1, 3, 2])
            s = R.matmul(qt, kt, out_dtype="float32")
            s1 = R.multiply(s, R.const(0.5, "float32"))
            p = R.nn.softmax(s1, axis=-1)
            o = R.matmul(p, vc, out_dtype="float32")
            o2 = R.permute_dims(o, [0, 2, 1, 3])
            R.output(o2)
        return o2


def test_a_cache_read_permuted_takes_one_permutation():
    """The cache's own permutation composes with the decomposition's: the keys are transposed
    once (``[0, 1, 3, 2]``), the values not at all (two permutations that cancel were two
    copies of them)."""
    written = relax.transform.DeadCodeElimination()(DecomposeAttention()(FromCache))
    tvm.ir.assert_structural_equal(relax.transform.Normalize()(written), FromCacheWritten)


@I.ir_module
class OneQuery:
    """A decoder's step: one query against a symbolic number of cached keys, the cache cast to
    bf16 between its permutation and the attention (AMP's low copy of an fp32 cache)."""

    @R.function
    def main(
        q: R.Tensor((1, 1, 4, 8), "bfloat16"),
        kc: R.Tensor((1, 4, "n", 8), "float32"),
        vc: R.Tensor((1, 4, "n", 8), "float32"),
    ):
        with R.dataflow():
            k = R.permute_dims(kc, [0, 2, 1, 3])
            k1 = R.astype(k, "bfloat16")
            v = R.permute_dims(vc, [0, 2, 1, 3])
            v1 = R.astype(v, "bfloat16")
            o = R.nn.attention(q, k1, v1, scale=0.5)
            R.output(o)
        return o


@I.ir_module
class OneQueryWritten:
    @R.function
    def main(
        q: R.Tensor((1, 1, 4, 8), "bfloat16"),
        kc: R.Tensor((1, 4, "n", 8), "float32"),
        vc: R.Tensor((1, 4, "n", 8), "float32"),
    ):
        with R.dataflow():
            qt = R.permute_dims(q, [0, 2, 1, 3])
            q32 = R.astype(qt, "float32")
            k16 = R.astype(kc, "bfloat16")
            k32 = R.astype(k16, "float32")
            s = R.sum(R.multiply(q32, k32), axis=[3])
            s1 = R.expand_dims(s, 2)
            s2 = R.multiply(s1, R.const(0.5, "float32"))
            p = R.nn.softmax(s2, axis=-1)
            p1 = R.astype(p, "bfloat16")
            w = R.permute_dims(p1, [0, 1, 3, 2])
            w32 = R.astype(w, "float32")
            v16 = R.astype(vc, "bfloat16")
            v32 = R.astype(v16, "float32")
            o = R.sum(R.multiply(w32, v32), axis=[2])
            o1 = R.expand_dims(o, 2)
            o2 = R.astype(o1, "bfloat16")
            o3 = R.permute_dims(o2, [0, 2, 1, 3])
            R.output(o3)
        return o3


def test_one_query_is_dot_products_that_read_the_cache():
    """One query: the scores and the weighed values are products summed in fp32, which FuseOps
    fuses with the cache's slices and casts (a matmul's operands were kernels of their own);
    the cast between the cache's permutation and the attention's moves after the composed
    permutation, which cancels: no copy of the keys or values is left."""
    written = relax.transform.DeadCodeElimination()(DecomposeAttention()(OneQuery))
    tvm.ir.assert_structural_equal(relax.transform.Normalize()(written), OneQueryWritten)


@I.ir_module
class OneQueryMatmuls:
    """One query's attention written out (optimum's GPT-2 at O2): the transposed key cache
    scaled and cast for the scores' matmul, the values cast for the second."""

    @R.function
    def main(
        q: R.Tensor((1, 4, 1, 8), "bfloat16"),
        kc: R.Tensor((1, 4, "n", 8), "float32"),
        vc: R.Tensor((1, 4, "n", 8), "float32"),
    ):
        with R.dataflow():
            kt = R.permute_dims(kc, [0, 1, 3, 2])
            kt1 = R.astype(kt, "bfloat16")
            kt2 = R.multiply(kt1, R.const(0.5, "bfloat16"))
            s = R.matmul(q, kt2, out_dtype="float32")
            p = R.nn.softmax(s, axis=-1)
            p1 = R.astype(p, "bfloat16")
            v1 = R.astype(vc, "bfloat16")
            o = R.matmul(p1, v1, out_dtype="float32")
            R.output(o)
        return o


@I.ir_module
class OneQueryMatmulsWritten:
    @R.function
    def main(
        q: R.Tensor((1, 4, 1, 8), "bfloat16"),
        kc: R.Tensor((1, 4, "n", 8), "float32"),
        vc: R.Tensor((1, 4, "n", 8), "float32"),
    ):
        with R.dataflow():
            q32 = R.astype(q, "float32")
            s = R.sum(R.multiply(q32, kc), axis=[3])
            s1 = R.multiply(s, R.astype(R.const(0.5, "bfloat16"), "float32"))
            s2 = R.expand_dims(s1, 2)
            p = R.nn.softmax(s2, axis=-1)
            p1 = R.astype(p, "bfloat16")
            w = R.permute_dims(p1, [0, 1, 3, 2])
            w32 = R.astype(w, "float32")
            o = R.sum(R.multiply(w32, vc), axis=[2])
            o1 = R.expand_dims(o, 2)
            R.output(o1)
        return o1


def test_one_query_matmuls_are_dot_products_that_read_the_cache():
    """Written out, one query's scores over the transposed, scaled, cast key cache and its
    weighed values over the cast value cache become products summed in fp32 over the caches
    themselves: the transpose, the scale and the casts were kernels that wrote every cached
    key or value again on every step."""
    written = relax.transform.DeadCodeElimination()(DecomposeAttention()(OneQueryMatmuls))
    tvm.ir.assert_structural_equal(relax.transform.Normalize()(written), OneQueryMatmulsWritten)


def test_other_matmuls_are_left_alone():
    """Two queries, or keys that are a product (not a transposed tensor times a scalar), keep
    their matmul."""
    n = tvm.tirx.Var("n", "int64")
    for queries, transposed in ((2, True), (1, False)):
        bb = relax.BlockBuilder()
        q = relax.Var("q", relax.TensorType((1, 4, queries, 8), "float32"))
        k = relax.Var("k", relax.TensorType((1, 4, n, 8), "float32"))
        with bb.function("main", [q, k]):
            with bb.dataflow():
                kt = relax.op.permute_dims(k, [0, 1, 3, 2])
                kt = bb.emit(kt if transposed else relax.op.multiply(kt, kt))
                out = bb.emit_output(relax.op.matmul(q, kt))
            bb.emit_func_output(out)
        mod = bb.get()
        tvm.ir.assert_structural_equal(DecomposeAttention()(mod), mod)


def _reference(q, k, v, bias, scale, causal):
    q, k, v = (np.transpose(x.astype("float64"), (0, 2, 1, 3)) for x in (q, k, v))
    s = q @ np.transpose(k, (0, 1, 3, 2)) * scale + bias
    if causal:
        s = np.where(np.tril(np.ones(s.shape[-2:], bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.transpose(p @ v, (0, 2, 1, 3))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("causal", [None, "TopLeft"])
def test_a_built_attention_matches_numpy(dtype, causal, rng):
    shapes = [(2, 7, 4, 16), (2, 7, 4, 16), (2, 7, 4, 16)]
    bb = relax.BlockBuilder()
    q, k, v = (relax.Var(n, relax.TensorType(s, dtype)) for n, s in zip("qkv", shapes))
    bias = relax.Var("b", relax.TensorType((2, 4, 7, 7), "float32"))
    with bb.function("main", [q, k, v, bias]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.nn.attention(q, k, v, bias, causal_mask=causal))
        bb.emit_func_output(out)
    numpy_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype
    inputs = [rng.standard_normal(s).astype(numpy_dtype) for s in shapes]
    inputs.append(rng.standard_normal((2, 4, 7, 7)).astype("float32"))
    exe = tvmamp.build(bb.get(), "O0", "llvm -num-cores=1")
    assert "attention" not in exe.get_source("ll")  # TVM's kernel: "__tvm_ffi_attention"
    got = exe(*inputs).astype("float32")
    want = _reference(*inputs, 0.25, causal)
    tol = 2e-2 if dtype == "bfloat16" else 1e-5
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("causal", [None, "BottomRight"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_one_query_over_symbolic_keys_matches_numpy(dtype, causal, rng):
    """The dot-product form, built (its keys' kernel takes the matmul rule's dot schedule,
    ``schedules/cpu/matmul.py``), against numpy at two odd key counts."""
    n = tvm.tirx.Var("n", "int64")
    bb = relax.BlockBuilder()
    q = relax.Var("q", relax.TensorType((2, 1, 4, 32), dtype))
    k, v = (relax.Var(name, relax.TensorType((2, n, 4, 32), dtype)) for name in "kv")
    bias = relax.Var("b", relax.TensorType((2, 4, 1, n), "float32"))
    with bb.function("main", [q, k, v, bias]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.nn.attention(q, k, v, bias, causal_mask=causal))
        bb.emit_func_output(out)
    mod = bb.get()
    # a bottom-right causal mask lets the one query see every key: no mask, no TVM kernel
    assert not DecomposeAttention()(mod)["main"].script().count("R.nn.attention")
    exe = tvmamp.build(mod, "O0", "llvm -num-cores=1")
    numpy_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype
    for keys in (37, 130):
        inputs = [rng.standard_normal((2, s, 4, 32)).astype(numpy_dtype) for s in (1, keys, keys)]
        inputs.append(rng.standard_normal((2, 4, 1, keys)).astype("float32"))
        got = exe(*inputs).astype("float32")
        want = _reference(*inputs, 32**-0.5, None)
        tol = 2e-2 if dtype == "bfloat16" else 1e-5
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol, err_msg=f"{keys} keys")
