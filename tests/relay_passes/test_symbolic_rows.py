"""PadSymbolicRows: a bf16 matmul over rows known only at run time is padded to whole row
tiles, so that the bf16 GEMM kernel reads them in place (unscheduled, it was 100x slower)."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax, tirx

import tvmamp
from tvmamp.relay_passes.symbolic_rows import PadSymbolicRows, needs_padding


def _mod(rows, dtype="bfloat16", batch=()):
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([*batch, rows, 64], dtype))
    w = relax.Var("w", relax.TensorType([64, 32], dtype))
    with bb.function("main", [x, w]):
        with bb.dataflow():
            y = bb.emit_output(relax.op.matmul(x, w, out_dtype="float32"))
        bb.emit_func_output(y)
    return bb.get()


def test_pads_symbolic_rows_and_slices_them_off():
    m = tirx.Var("m", "int64")
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([m, 64], "bfloat16"))
    w = relax.Var("w", relax.TensorType([64, 32], "bfloat16"))
    with bb.function("main", [x, w]):
        with bb.dataflow():
            extra = relax.ShapeExpr([(m + 8 - 1) // 8 * 8 - m, 64])
            zeros = bb.emit(relax.op.zeros(extra, "bfloat16"))
            padded = bb.emit(relax.op.concat([x, zeros], axis=0))
            full = bb.emit(relax.op.matmul(padded, w, out_dtype="float32"))
            y = bb.emit_output(relax.op.strided_slice(full, [0], [0], [m], assume_inbound=True))
        bb.emit_func_output(y)
    before = _mod(m)
    after = PadSymbolicRows(8)(before)
    tvm.ir.assert_structural_equal(after, bb.get(), map_free_vars=True)


@pytest.mark.parametrize("static_rows", [False, True], ids=["m rows", "65 rows"])
def test_a_batched_left_operand_is_padded_as_one_matrix_of_all_its_rows(static_rows):
    """``x[b, m, k] @ w[k, n]`` pads and slices ``b * m`` rows of one 2-D GEMM. Padding only
    the ``m`` axis left a GEMM over a symbolic batch whose row slice, fused in as its
    epilogue, could not be inlined: the kernel stayed a scalar loop. With 65 static rows (ViT
    under a dynamic batch) the matmul was left alone, and ran on the fp32 FMAs at half the
    bf16 GEMM's speed: the bf16 kernel would pad its rows with a copy of ``x``."""
    b = tirx.Var("b", "int64")
    m = tirx.IntImm("int64", 65) if static_rows else tirx.Var("m", "int64")
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([b, m, 64], "bfloat16"))
    w = relax.Var("w", relax.TensorType([64, 32], "bfloat16"))
    with bb.function("main", [x, w]):
        with bb.dataflow():
            rows = b * m
            flat = bb.emit(relax.op.reshape(x, relax.ShapeExpr([rows, 64])))
            extra = relax.ShapeExpr([(rows + 8 - 1) // 8 * 8 - rows, 64])
            zeros = bb.emit(relax.op.zeros(extra, "bfloat16"))
            padded = bb.emit(relax.op.concat([flat, zeros], axis=0))
            full = bb.emit(relax.op.matmul(padded, w, out_dtype="float32"))
            sliced = bb.emit(relax.op.strided_slice(full, [0], [0], [rows], assume_inbound=True))
            y = bb.emit_output(relax.op.reshape(sliced, relax.ShapeExpr([b, m, 32])))
        bb.emit_func_output(y)
    after = PadSymbolicRows(8)(_mod(m, batch=(b,)))
    tvm.ir.assert_structural_equal(after, bb.get(), map_free_vars=True)


@pytest.mark.parametrize("static_rows", [None, 29, 50, 12], ids=lambda r: f"{r or 'm'} rows")
def test_a_linear_over_symbolic_batch_and_rows_runs_on_the_bf16_gemm(caplog, static_rows):
    """An ONNX export with symbolic batch and length: its Linear layers run on the bf16 GEMM
    kernel (an MPT ran 200x slower with them left scalar), and the padded rows stay out; and
    with a symbolic batch only, over rows of no whole tiles. With 50 or 12 rows (a factor
    shared with the tile) TVM cannot prove that the padded rows cover the slice, which stopped
    the GEMM rule (torch's MultiheadAttention under a dynamic batch ran 23x slower)."""
    import logging

    rows_of = (lambda m: static_rows) if static_rows else None
    mod, weight = _symbolic_linear(batch=(tirx.Var("b", "int64"),), rows_of=rows_of)
    with caplog.at_level(logging.INFO, logger="tvmamp.schedules"):
        exe = tvmamp.build(
            mod, "O2", "llvm -mcpu=znver4 -mattr=-sse4a -num-cores=1", dtype="bfloat16"
        )
    refused = [r.getMessage() for r in caplog.records if "CPUMatmulBF16 left" in r.getMessage()]
    assert not refused, refused
    for batch, rows in ((2, static_rows or 29), (3, static_rows or 8)):
        x = np.random.default_rng(rows).standard_normal((batch, rows, 96)).astype("float32")
        out = np.asarray(exe(x))
        ref = x.astype("float64") @ weight.astype("float64")
        assert out.shape == (batch, rows, 80)
        np.testing.assert_allclose(out, ref, rtol=0, atol=2e-2 * np.abs(ref).max())


@pytest.mark.parametrize(
    "rows_of",
    [
        lambda m: 29,  # static: the kernel pads it itself
        lambda m: m * 8,  # provably whole tiles
    ],
)
def test_leaves_rows_the_kernel_reads_in_place(rows_of):
    before = _mod(rows_of(tirx.Var("m", "int64")))
    tvm.ir.assert_structural_equal(PadSymbolicRows(8)(before), before)


def test_leaves_fp32_matmuls():
    before = _mod(tirx.Var("m", "int64"), dtype="float32")
    tvm.ir.assert_structural_equal(PadSymbolicRows(8)(before), before)


def test_needs_padding():
    m = tirx.Var("m", "int64")
    assert needs_padding(m, 8) and needs_padding(m * 4, 8) and needs_padding(m + 8, 8)
    assert not needs_padding(m * 16, 8) and not needs_padding(tirx.IntImm("int64", 30), 8)


def _symbolic_linear(batch=(), rows_of=None):
    """``x @ w`` with ``m`` symbolic rows (or ``rows_of(m)``), built at O2 bf16 (the fp32
    weight a constant)."""
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((96, 80)).astype("float32") * 0.1
    m = tirx.Var("m", "int64")
    m = m if rows_of is None else rows_of(m)
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([*batch, m, 96], "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit_output(relax.op.matmul(x, relax.const(weight)))
        bb.emit_func_output(y)
    return bb.get(), weight


@pytest.mark.parametrize("rows", [1, 7, 8, 29, 64])
def test_symbolic_rows_numerics(rows):
    """Against float64 at odd row counts (padded rows must not leak into the result)."""
    mod, weight = _symbolic_linear()
    exe = tvmamp.build(mod, "O2", "llvm", dtype="bfloat16")
    x = np.random.default_rng(rows).standard_normal((rows, 96)).astype("float32")
    out = np.asarray(exe(x))
    ref = x.astype("float64") @ weight.astype("float64")
    assert out.shape == (rows, 80)
    np.testing.assert_allclose(out, ref, rtol=0, atol=2e-2 * np.abs(ref).max())
