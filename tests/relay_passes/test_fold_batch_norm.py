"""FoldBatchNorm: inference batch norms fold into the conv before them, and only those."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tolerances import assert_close, tolerance
from tvm import relax

import tvmamp
from tvmamp.relay_passes.fold_batch_norm import FoldBatchNorm


def _conv_bn(rng, *, training=False, layout="NCHW", groups=1, bias=True, reuse=False):
    """x -> conv2d(W) [+ b] -> batch_norm -> [0], everything but x a constant."""
    c, f = 6, 12
    w = rng.standard_normal((f, c // groups, 3, 3)).astype("float32")
    stats = [
        rng.uniform(0.5, 1.5, f),
        rng.uniform(-1, 1, f),
        rng.uniform(-1, 1, f),
        rng.uniform(0.5, 2, f),
    ]
    shape = (2, c, 7, 7) if layout == "NCHW" else (2, 7, 7, c)
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(shape, "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            kernel = relax.const(w if layout == "NCHW" else w.transpose(0, 2, 3, 1))
            y = bb.emit(
                relax.op.nn.conv2d(
                    x,
                    kernel,
                    padding=1,
                    groups=groups,
                    data_layout=layout,
                    kernel_layout="OIHW" if layout == "NCHW" else "OHWI",
                )
            )
            if bias:
                b = relax.const(rng.uniform(-1, 1, (1, f, 1, 1)).astype("float32"))
                y = bb.emit(relax.op.add(y, b)) if layout == "NCHW" else y
            axis = 1 if layout == "NCHW" else 3
            consts = [relax.const(s.astype("float32")) for s in stats]
            bn = bb.emit(relax.op.nn.batch_norm(y, *consts, axis=axis, training=training))
            out = bb.emit(relax.TupleGetItem(bn, 0))
            if reuse:
                out = bb.emit(relax.op.add(out, y))
            out = bb.emit_output(out)
        bb.emit_func_output(out)
    return bb.get(), shape


def _has_batch_norm(mod) -> bool:
    return "R.nn.batch_norm(" in mod["main"].script()


@pytest.mark.parametrize(("groups", "bias"), [(1, True), (3, True), (6, False)])
def test_folded_conv_computes_the_same(rng, groups, bias):
    mod, shape = _conv_bn(rng, groups=groups, bias=bias)
    folded = FoldBatchNorm()(mod)
    assert not _has_batch_norm(folded) and _has_batch_norm(mod)
    x = rng.standard_normal(shape).astype("float32")
    ref = tvm.compile(relax.transform.LegalizeOps()(mod), "llvm")
    vm = relax.VirtualMachine(ref, tvm.cpu())
    expected = vm["main"](tvm.runtime.tensor(x)).numpy()
    out = tvmamp.build(mod, "O0", "llvm -num-cores=1")(x)
    assert_close(out, expected, **tolerance("float32", scale=float(np.abs(expected).max())))


@pytest.mark.parametrize(
    "case",
    [dict(training=True), dict(layout="NHWC"), dict(reuse=True)],
    ids=["training", "nhwc", "conv-output-reused"],
)
def test_batch_norms_that_must_stay(rng, case):
    mod, _ = _conv_bn(rng, **case)
    assert _has_batch_norm(FoldBatchNorm()(mod))
