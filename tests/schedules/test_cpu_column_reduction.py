"""Column reductions (bias gradients): vectorised along the kept axis, numerics against numpy."""

from __future__ import annotations

import re

import pytest
import tvm
from tolerances import assert_close, tolerance
from tvm import relax

import tvmamp
from tvmamp.schedules.cpu.column_reduction import CPUColumnReduction

TARGET = "llvm -mcpu=x86-64-v3 -num-cores={cores}"


def _collapse_sum(rows: int, cols: int, dtype: str) -> tvm.IRModule:
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((rows, cols), dtype))
    with bb.function("main", [x]):
        with bb.dataflow():
            wide = bb.emit(relax.op.astype(x, "float32"))
            out = bb.emit_output(relax.op.collapse_sum_to(wide, (cols,)))
        bb.emit_func_output(out)
    return bb.get()


def _kernel(mod: tvm.IRModule) -> tvm.tirx.PrimFunc:
    passes = [relax.transform.LegalizeOps(), relax.transform.AnnotateTIROpPattern()]
    passes += [relax.transform.FuseOps(), relax.transform.FuseTIR()]
    lowered = tvm.transform.Sequential(passes)(mod)
    (func,) = [f for _, f in lowered.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    return func


@pytest.mark.parametrize("cores", [1, 2])
@pytest.mark.parametrize(("rows", "cols"), [(128, 512), (37, 200), (5, 24)])
def test_bias_gradient_matches_numpy(rows, cols, cores, rng):
    x = rng.standard_normal((rows, cols)).astype("float32")
    exe = tvmamp.build(_collapse_sum(rows, cols, "float32"), "O0", TARGET.format(cores=cores))
    assert_close(exe(x), x.astype("float64").sum(0), **tolerance("float32", scale=rows**0.5))


def test_the_rule_vectorises_the_kept_axis():
    """Scheduled (parallel over column strips) and, in the assembly, vector adds of 8 floats."""
    target = tvm.target.Target({"kind": "llvm", "mcpu": "x86-64-v3", "num-cores": 2})
    mod = _collapse_sum(256, 512, "bfloat16")
    sch = CPUColumnReduction().apply(_kernel(mod), target, False)
    assert sch is not None and "T.parallel" in sch.mod.script()
    asm = tvmamp.build(mod, "O0", target).get_source("asm")
    assert re.search(r"vaddps\s+[^\n]*%ymm", asm)


def test_a_row_reduction_is_not_taken():
    """``sum over the last axis`` keeps the leading axis: not a column reduction."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((64, 128), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.sum(x, axis=[1]))
        bb.emit_func_output(out)
    target = tvm.target.Target({"kind": "llvm", "mcpu": "x86-64-v3"})
    assert CPUColumnReduction().apply(_kernel(bb.get()), target, False) is None


def test_a_bf16_column_sum_builds_and_matches(rng):
    """O3 training keeps collapse_sum in bf16; TVM rejects a bf16 vector store of the zero init."""
    import ml_dtypes

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((64, 96), "bfloat16"))
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.collapse_sum_to(x, (96,)))
        bb.emit_func_output(out)
    data = rng.standard_normal((64, 96)).astype(ml_dtypes.bfloat16)
    exe = tvmamp.build(bb.get(), "O0", "llvm -mcpu=znver4 -mattr=-sse4a -num-cores=2")
    out = exe(data).astype("float32")
    assert_close(out, data.astype("float64").sum(0), **tolerance("bfloat16", scale=8.0))


@pytest.mark.parametrize("batch", [2, "n"])
def test_a_mean_over_pixels_is_a_column_reduction(batch, rng):
    """A squeeze-and-excite block's mean over the pixels of NHWC rows ``[N, H*W, C]``: its
    division could not be inlined into the sum, so the rule declined, and a dynamic batch was
    refused; the row rule read each channel 144 floats apart (EfficientNet-B0: 11 % of the
    model, static and with a dynamic batch)."""
    rows = tvm.tirx.Var("n", "int64") if batch == "n" else batch
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((rows, 64, 48), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.mean(x, axis=[1]))
        bb.emit_func_output(out)
    target = tvm.target.Target({"kind": "llvm", "mcpu": "x86-64-v3", "num-cores": 1})
    assert CPUColumnReduction().apply(_kernel(bb.get()), target, False) is not None
    exe = tvmamp.build(bb.get(), "O0", target)
    for n in (2, 3) if batch == "n" else (2,):
        data = rng.standard_normal((n, 64, 48)).astype("float32")
        assert_close(exe(data), data.astype("float64").mean(1), **tolerance("float32", scale=8))
