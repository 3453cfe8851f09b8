"""Low-precision reductions read low values and add up in fp32 (relay_passes/low_reductions)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import tvm
from tvm import relax

import tvmamp
from tvmamp.relay_passes.low_reductions import LEGALIZE_MAP

REFERENCE = {
    "sum": lambda v: v.sum(-1),
    "mean": lambda v: v.mean(-1),
    "variance": lambda v: v.var(-1),
    "std": lambda v: v.std(-1),
    "prod": lambda v: v.prod(-1),
}


def _reduce(op: str, dtype: str, shape=(3, 2000)) -> tvm.IRModule:
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(shape, dtype))
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(getattr(relax.op, op)(x, axis=-1))
        bb.emit_func_output(out)
    return bb.get()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("op", sorted(REFERENCE))
def test_low_model_reductions_at_o0_match_float64(rng, op, dtype):
    """A bf16 model's x.sum(-1) over 2000 values near 0.8 was off by 0.69 at O0: TVM kept a
    bf16 running total."""
    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float16
    data = np.abs(rng.standard_normal((3, 2000))) + 0.1
    if op == "prod":  # a product of 2000 values that stays in range
        data = 1 + (data - 1.0) * 1e-3
    data = data.astype(np_dtype)
    out = tvmamp.build(_reduce(op, dtype), "O0", "llvm")(data)
    ref = REFERENCE[op](data.astype("float64"))
    tol = 1e-2 if dtype == "bfloat16" else 2e-3  # the inputs and the one rounding of the result
    assert np.abs(np.asarray(out, dtype="float64") - ref).max() / np.abs(ref).max() <= tol


def test_widened_in_the_legalized_kernel_only_for_low_inputs():
    low = relax.transform.LegalizeOps(LEGALIZE_MAP)(_reduce("sum", "bfloat16", (4, 8)))
    fp32 = relax.transform.LegalizeOps(LEGALIZE_MAP)(_reduce("sum", "float32", (4, 8)))
    plain = relax.transform.LegalizeOps()(_reduce("sum", "float32", (4, 8)))
    tvm.ir.assert_structural_equal(fp32, plain)
    kernels = [f.script() for _, f in low.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    assert any('"float32"' in k and "bfloat16" in k for k in kernels)
