"""schedules/cpu/bounds.py: the bounds checks of marked blocks become ``likely`` (TVM's
LoopPartition then splits the whole tiles of a symbolic loop off the last one), and the copy
stays exact on both sides of the tiles."""

from __future__ import annotations

import numpy as np
import tvm
from tvm import s_tir, te

from tvmamp.schedules.cpu import bounds


def _padded_copy(marked: bool) -> tvm.IRModule:
    """``out[i] = x[i] if i < n else 0`` over ``ceil(n / 16) * 16`` elements, in vectors of 16,
    ``i`` split into tiles and lanes; the block marked or not."""
    n = tvm.tirx.Var("n", "int64")
    x = te.placeholder((n,), "float32", name="x")
    padded = (n + 15) // 16 * 16
    out = te.compute((padded,), lambda i: tvm.tirx.if_then_else(i < n, x[i], 0.0), name="out")
    sch = s_tir.Schedule(te.create_prim_func([x, out]))
    block = sch.get_sblock("out")
    (loop,) = sch.get_loops(block)
    _, lanes = sch.split(loop, [None, 16])
    sch.vectorize(lanes)
    if marked:
        bounds.mark(sch, block)
    return sch.mod


def test_only_marked_checks_become_likely():
    marked = bounds.inject_likely(_padded_copy(True))["main"].script()
    assert marked.count("T.likely(") == 1
    assert "T.likely(" not in bounds.inject_likely(_padded_copy(False))["main"].script()


def test_the_partitioned_copy_is_exact():
    for marked in (True, False):
        lib = tvm.compile(_padded_copy(marked), target="llvm")
        for n in (1, 15, 16, 17, 40):
            x = np.arange(1, n + 1, dtype="float32")
            out = tvm.runtime.tensor(np.full((n + 15) // 16 * 16, -1.0, "float32"))
            lib(tvm.runtime.tensor(x), out)
            expected = np.concatenate([x, np.zeros(out.shape[0] - n, "float32")])
            np.testing.assert_array_equal(out.numpy(), expected)
