"""Weight packs of an odd ``K`` or a ragged ``J``: whole tiles through the helper, exact values.

Before, the guard of a padded weight kept the packing intrinsic off every tile, and the pack
ran as a vectorised gather (ViT's ``V`` at 13 % of the memory peak; a 128 x 384 x 50257 GEMM
with ``W`` at run time at 0.47x torch).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import tvm
from tvm import relax

from tvmamp.pipeline import legalize_passes
from tvmamp.schedules.cpu import cpu_schedule_passes
from tvmamp.schedules.cpu.bf16_common import PACK_PAIRS
from tvmamp.targets.llvm import _host_flags

TARGET = tvm.target.Target({"kind": "llvm", "mcpu": "znver4", "mattr": ["-sse4a"], "num-cores": 2})
HELPER = "tvmamp_pack_pairs_2x32"


def _module(a_shape, b_shape, b_dtype: str, constant=None):
    """``a @ b`` with bf16 ``a``; ``b`` bf16, or fp32 cast to bf16 in the graph (the cast
    fuses into the pack); bound as a constant when given."""
    bb = relax.BlockBuilder()
    a = relax.Var("a", relax.TensorType(a_shape, "bfloat16"))
    b = relax.Var("b", relax.TensorType(b_shape, b_dtype))
    with bb.function("main", [a, b]):
        with bb.dataflow():
            w = b if b_dtype == "bfloat16" else bb.emit(relax.op.astype(b, "bfloat16"))
            out = bb.emit_output(relax.op.matmul(a, w, out_dtype="float32"))
        bb.emit_func_output(out)
    mod = bb.get()
    if constant is not None:
        mod["main"] = mod["main"].bind_params({"b": relax.const(constant, b_dtype)})
    return mod


def _schedule(mod):
    with TARGET:
        return tvm.transform.Sequential([*legalize_passes(), *cpu_schedule_passes(TARGET)])(mod)


SHAPES = [
    ((40, 37), (37, 64)),  # odd K: the last pair of rows is half padding
    ((40, 64), (64, 45)),  # ragged J: one whole tile, 13 columns after it
    ((33, 77), (77, 45)),  # both
    ((8, 3), (3, 33)),  # fewer rows than a pair beyond the first
    ((3, 20, 197), (3, 197, 64)),  # attention's probabilities @ V over 197 tokens
    ((1, 3, 20, 197), (1, 3, 197, 64)),  # the same with the batch axis of [1, heads, ...]
    ((1, 3, 20, 64), (1, 3, 64, 197)),  # q @ k^T over 197 tokens: ragged J, K^T made earlier
]


@pytest.mark.parametrize("b_dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize(("a_shape", "b_shape"), SHAPES, ids=str)
def test_run_time_weights_pack_through_the_helper_and_match_numpy(rng, a_shape, b_shape, b_dtype):
    mod = _schedule(_module(a_shape, b_shape, b_dtype))
    packs = [
        f
        for _, f in mod.functions_items()
        if isinstance(f, tvm.tirx.PrimFunc) and HELPER in f.script()
    ]
    assert packs, "no pack calls the pair-interleaving helper"
    assert not any(PACK_PAIRS in f.script() for f in packs)
    if "avx512_bf16" not in _host_flags():
        pytest.skip("the host CPU lacks avx512_bf16")
    a = rng.standard_normal(a_shape).astype(ml_dtypes.bfloat16)
    b = rng.standard_normal(b_shape).astype(b_dtype if b_dtype == "float32" else ml_dtypes.bfloat16)
    vm = relax.VirtualMachine(tvm.compile(mod, target=TARGET), tvm.cpu())
    out = vm["main"](tvm.runtime.tensor(a), tvm.runtime.tensor(b)).numpy()
    b_low = b.astype(ml_dtypes.bfloat16).astype("float64")  # the pack rounds an fp32 b
    ref = a.astype("float64") @ b_low
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


def test_a_constant_ragged_weight_folds_at_compile_time(rng):
    """FoldConstant builds the pack for plain "llvm" (integer rounding, no vcvtneps2bf16)."""
    if "avx512_bf16" not in _host_flags():
        pytest.skip("the host CPU lacks avx512_bf16")
    w = rng.standard_normal((77, 45)).astype("float32")
    mod = _schedule(_module((33, 77), (77, 45), "float32", constant=w))
    a = rng.standard_normal((33, 77)).astype(ml_dtypes.bfloat16)
    vm = relax.VirtualMachine(tvm.compile(mod, target=TARGET), tvm.cpu())
    out = vm["main"](tvm.runtime.tensor(a)).numpy()
    ref = a.astype("float64") @ w.astype(ml_dtypes.bfloat16).astype("float64")
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
