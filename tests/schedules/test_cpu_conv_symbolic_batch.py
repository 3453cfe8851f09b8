"""CPUConv2d over a symbolic batch: a CNN exported with a dynamic batch axis.

The conv-to-GEMM rewrite and, before, the direct conv took static shapes only: with a symbolic
batch every conv2d was TVM's unscheduled loops, and a small CNN ran 300 times slower than its
static build (194 ms against 0.6 ms, one thread, Zen5).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import tvm
from relax_modules import scheduled_kernels
from tolerances import assert_close, tolerance
from tvm import relax

import tvmamp

TARGET = tvm.target.Target({"kind": "llvm", "mcpu": "znver4", "mattr": ["-sse4a"], "num-cores": 2})
# (channels, height, width, filters, kernel, stride, padding, groups)
CASES = {
    "dense 3x3": (8, 13, 11, 24, 3, 1, 1, 1),
    "pointwise stride 2": (16, 9, 10, 32, 1, 2, 0, 1),
    "grouped": (12, 9, 9, 18, 3, 1, 1, 3),
    "depthwise": (16, 12, 9, 16, 3, 2, 1, 16),
}


def _conv_module(case):
    channels, height, width, filters, kernel, stride, padding, groups = CASES[case]
    rng = np.random.default_rng(len(case))
    weight = rng.standard_normal((filters, channels // groups, kernel, kernel)).astype("float32")
    bias = rng.standard_normal((1, filters, 1, 1)).astype("float32")
    bb = relax.BlockBuilder()
    batch = tvm.tirx.Var("batch", "int64")
    x = relax.Var("x", relax.TensorType((batch, channels, height, width), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            conv = bb.emit(
                relax.op.nn.conv2d(x, relax.const(weight), stride, padding, groups=groups)
            )
            out = bb.emit_output(relax.op.nn.relu(relax.op.add(conv, relax.const(bias))))
        bb.emit_func_output(out)
    return bb.get(), weight, bias


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("level", ["O0", "O2"])
def test_conv_over_a_symbolic_batch(case, level):
    """Each conv kernel gets the direct conv's register tiles (accumulators in a ``local``
    tile, vectorised), and the result matches torch in float64 at batches 1 and 3. Dense bf16
    convs (O2) go to GEMMs on rows instead (tests/relay_passes/test_conv_rows_symbolic_batch)."""
    mod, weight, bias = _conv_module(case)
    kernels = scheduled_kernels(mod, level, TARGET)
    convs = {name: f for name, f in kernels.items() if "conv2d" in name}
    if level == "O2" and CASES[case][-1] == 1:
        assert not convs and any("matmul" in name for name in kernels), list(kernels)
    else:
        assert convs, list(kernels)
    for name, func in convs.items():  # the direct conv's register tiles, vectorised
        text = func.script()
        assert 'scope="local"' in text and "T.vectorized" in text, name
    exe = tvmamp.build(mod, level, TARGET)
    channels, height, width, _, _, stride, padding, groups = CASES[case]
    for batch in (1, 3):
        x = np.random.default_rng(batch).standard_normal((batch, channels, height, width))
        x = x.astype("float32")
        conv = torch.nn.functional.conv2d(
            *(torch.from_numpy(a).double() for a in (x, weight)), None, stride, padding, 1, groups
        )
        ref = torch.relu(conv + torch.from_numpy(bias).double()).numpy()
        dtype = "float32" if level == "O0" else "bfloat16"
        tol = tolerance(dtype, np.abs(ref).max())
        assert_close(exe(x), ref, **tol, what=f"{case} {level} batch {batch}")
