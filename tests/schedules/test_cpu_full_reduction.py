"""Full reductions (a whole tensor to one value): vector partial results, numerics against numpy."""

from __future__ import annotations

import re

import numpy as np
import pytest
import tvm
from tolerances import assert_close, tolerance
from tvm import relax

import tvmamp
from tvmamp.schedules.cpu.full_reduction import CPUFullReduction
from tvmamp.training.step import all_finite

TARGET = "llvm -mcpu=x86-64-v3 -num-cores={cores}"
REDUCE = {"sum": relax.op.sum, "mean": relax.op.mean, "max": relax.op.max, "min": relax.op.min}
NUMPY = {"sum": np.sum, "mean": np.mean, "max": np.max, "min": np.min}


def _reduce(shape, dtype: str, op: str) -> tvm.IRModule:
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(shape, dtype))
    with bb.function("main", [x]):
        with bb.dataflow():
            wide = bb.emit(relax.op.astype(x, "float32"))
            out = bb.emit_output(REDUCE[op](wide))
        bb.emit_func_output(out)
    return bb.get()


def _all_finite(shapes) -> tvm.IRModule:
    bb = relax.BlockBuilder()
    xs = [relax.Var(f"x{i}", relax.TensorType(s, "float32")) for i, s in enumerate(shapes)]
    with bb.function("main", xs):
        with bb.dataflow():
            out = bb.emit_output(all_finite(bb, xs))
        bb.emit_func_output(out)
    return bb.get()


def _kernels(mod: tvm.IRModule) -> list[tvm.tirx.PrimFunc]:
    passes = [relax.transform.LegalizeOps(), relax.transform.AnnotateTIROpPattern()]
    passes += [relax.transform.FuseOps(), relax.transform.FuseTIR()]
    lowered = tvm.transform.Sequential(passes)(mod)
    return [f for _, f in lowered.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]


@pytest.mark.parametrize("cores", [1, 2])
@pytest.mark.parametrize("op", sorted(REDUCE))
@pytest.mark.parametrize("shape", [(512, 512), (37, 81), (3000,), (5, 7)])
def test_full_reductions_match_numpy(shape, op, cores, rng):
    """Exact multiples of the vector, ragged totals (37 x 81, 3000) and ones too short to split."""
    x = rng.standard_normal(shape).astype("float32") + 0.25
    exe = tvmamp.build(_reduce(shape, "float32", op), "O0", TARGET.format(cores=cores))
    ref = NUMPY[op](x.astype("float64"))
    assert_close(exe(x), ref, **tolerance("float32", scale=x.size**0.5))


def test_a_bf16_input_is_widened_inside_the_reduction(rng):
    x = rng.standard_normal((96, 40)).astype("float32")
    exe = tvmamp.build(_reduce((96, 40), "bfloat16", "sum"), "O0", TARGET.format(cores=1))
    low = tvmamp.tensors.np_dtype("bfloat16")
    rounded = x.astype(low).astype("float64")
    assert_close(exe(x.astype(low)), rounded.sum(), **tolerance("float32", scale=60))


def test_the_rule_splits_the_loop_into_vector_partials():
    """One ``rfactor`` block of ``4 x 8`` partials (AVX2), the lanes vectorised."""
    target = tvm.target.Target({"kind": "llvm", "mcpu": "x86-64-v3"})
    (func,) = _kernels(_reduce((256, 64), "float32", "sum"))
    sch = CPUFullReduction().apply(func, target, False)
    assert sch is not None
    script = sch.mod.script()
    assert re.search(r"T\.vectorized\((T\.int64\()?8\)", script)
    assert re.search(r"T\.unroll\((T\.int64\()?4\)", script)
    assert re.search(r"sblock_alloc_buffer\(\((T\.int64\()?32\)?,\)", script)


def test_a_reduction_that_keeps_an_axis_is_not_taken():
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((64, 128), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.sum(x, axis=[1]))
        bb.emit_func_output(out)
    (func,) = _kernels(bb.get())
    target = tvm.target.Target({"kind": "llvm", "mcpu": "x86-64-v3"})
    assert CPUFullReduction().apply(func, target, False) is None


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf, None])
def test_all_finite_finds_one_bad_value_anywhere(bad, rng):
    """The training step's overflow check: one NaN or +-inf at a random place in any tensor.

    The largest finite float32 and subnormals count as finite.
    """
    shapes = [(512, 512), (512,), (37, 81)]
    exe = tvmamp.build(_all_finite(shapes), "O0", TARGET.format(cores=1))
    xs = [rng.standard_normal(s).astype("float32") for s in shapes]
    xs[0][0, 0], xs[2][-1, -1] = np.finfo(np.float32).max, np.finfo(np.float32).smallest_subnormal
    xs[1][3] = -np.finfo(np.float32).max
    for which in range(len(xs)) if bad is not None else [None]:
        inputs = [x.copy() for x in xs]
        if which is not None:
            flat = inputs[which].reshape(-1)
            flat[rng.integers(flat.size)] = bad
        expected = all(np.isfinite(x).all() for x in inputs)
        assert bool(exe(*inputs)) == expected, (bad, which)
