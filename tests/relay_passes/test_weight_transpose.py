"""FuseWeightTranspose: ``x @ W.T`` on a run-time bf16 weight reads ``W[N, K]`` in place."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import tvm
from tvm import relax

import tvmamp
from tvmamp.relay_passes.weight_transpose import FuseWeightTranspose, nt_matmul

TARGET = (
    "llvm -mcpu=znver4 -mattr=-sse4a"  # avx512_bf16: the pass runs and the transposing pack is used
)


def _linear(n: int, k: int, rows: int = 24, weight=None, dtype="bfloat16") -> tvm.IRModule:
    """``x @ astype(W).T`` with ``W`` fp32: a parameter, or the constant ``weight``."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((rows, k), dtype))
    params = [x]
    if weight is None:
        w = relax.Var("w", relax.TensorType((n, k), "float32"))
        params.append(w)
    else:
        w = relax.const(weight)
    with bb.function("main", params):
        with bb.dataflow():
            wl = bb.emit(relax.op.astype(w, dtype))
            wt = bb.emit(relax.op.permute_dims(wl))
            y = bb.emit_output(relax.op.matmul(x, wt, out_dtype="float32"))
        bb.emit_func_output(y)
    return bb.get()


def test_a_run_time_weight_is_read_in_place():
    """IR before/after: the cast and the transpose are gone; one NT matmul reads the fp32
    weight (and rounds it to bf16 in a block of its own, which the GEMM's pack absorbs)."""
    after = FuseWeightTranspose()(_linear(64, 64))
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((24, 64), "bfloat16"))
    w = relax.Var("w", relax.TensorType((64, 64), "float32"))
    with bb.function("main", [x, w]):
        with bb.dataflow():
            nt = bb.call_te(nt_matmul, x, w, "float32", primfunc_name_hint="matmul")
            y = bb.emit_output(nt)
        bb.emit_func_output(y)
    tvm.ir.assert_structural_equal(after, bb.get())


def _backward(n: int, k: int) -> tvm.IRModule:
    """``dy @ astype(W)``: the input gradient of a Linear layer (``W[n, k]``, ``dy[.., n]``)."""
    bb = relax.BlockBuilder()
    dy = relax.Var("dy", relax.TensorType((24, n), "bfloat16"))
    w = relax.Var("w", relax.TensorType((n, k), "float32"))
    with bb.function("main", [dy, w]):
        with bb.dataflow():
            wl = bb.emit(relax.op.astype(w, "bfloat16"))
            y = bb.emit_output(relax.op.matmul(dy, wl, out_dtype="float32"))
        bb.emit_func_output(y)
    return bb.get()


def test_the_input_gradient_rounds_the_fp32_weight_in_its_pack(rng):
    """``dy @ astype(W)``: no cast kernel; exact against numpy on the bf16-rounded weight."""
    after = FuseWeightTranspose()(_backward(64, 96))
    assert "R.astype" not in after.script() and "T_weight_cast" in after.script()
    dy = rng.standard_normal((24, 64)).astype(ml_dtypes.bfloat16)
    w = rng.standard_normal((64, 96)).astype("float32")
    exe = tvmamp.build(_backward(64, 96), "O0", TARGET)
    ref = dy.astype("float64") @ w.astype(ml_dtypes.bfloat16).astype("float64")
    np.testing.assert_allclose(exe(dy, w), ref, rtol=1e-5, atol=1e-4 * 8)


@pytest.mark.parametrize(
    "case",
    [
        {"n": 48, "k": 64},  # N not a multiple of 32: the GEMM would pad the packed weight
        {"n": 64, "k": 48},  # K not a multiple of 32
        {"n": 64, "k": 64, "dtype": "float32"},  # not bf16
        {"n": 64, "k": 64, "weight": np.ones((64, 64), "float32")},  # constant: folded
    ],
)
def test_other_matmuls_are_left_alone(case):
    mod = _linear(**case)
    tvm.ir.assert_structural_equal(FuseWeightTranspose()(mod), mod)


@pytest.mark.parametrize(("rows", "n", "k"), [(24, 64, 64), (7, 32, 96), (128, 512, 512)])
def test_the_nt_matmul_and_its_transposing_pack_match_numpy(rows, n, k, rng):
    """Built end to end (the pack is the 16 x 16 register transpose of bf16 pairs)."""
    x = rng.standard_normal((rows, k)).astype(ml_dtypes.bfloat16)
    w = rng.standard_normal((n, k)).astype("float32")
    exe = tvmamp.build(_linear(n, k, rows), "O0", TARGET)
    ref = x.astype("float64") @ w.astype(ml_dtypes.bfloat16).astype("float64").T
    np.testing.assert_allclose(exe(x, w), ref, rtol=1e-5, atol=1e-4 * k**0.5)


def test_the_pack_is_tensorized_and_no_transpose_kernel_is_left():
    """After scheduling: a split-out pack calls the 32-bit register transpose for ``W``."""
    from tvmamp.pipeline import front_phases, schedule_passes

    converted = tvmamp.convert(_linear(64, 96), "O0", TARGET)
    with converted.target:
        phases = front_phases(converted.target, converted.entry, converted.policy)
        phases += schedule_passes(converted.target, converted.entry)
        mod = tvm.transform.Sequential(phases)(converted.mod)
    scripts = {
        g.name_hint: f.script() for g, f in mod.functions_items() if not g.name_hint == "main"
    }
    packs = [name for name, text in scripts.items() if "tvmamp_transpose_16x16_i32" in text]
    assert len(packs) == 1 and "prepack" in packs[0], list(scripts)
    assert not [name for name in scripts if "transpose" in name], list(scripts)
