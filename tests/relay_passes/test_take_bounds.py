"""GuardTakeIndices: run-time indices out of range raise IndexError instead of reading past the
table (an out-of-vocabulary token id segfaulted the process)."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

import tvmamp
from tvmamp.relay_passes.take_bounds import GuardTakeIndices

MESSAGE = (
    "tvmamp: an index of a take (an embedding lookup or gather) on a table of shape (100, 16) "
    "is out of range: each index along axis 0 must lie in [0, 100) (torch raises IndexError "
    "for the same input)"
)


@I.ir_module
class Lookups:
    @R.function
    def main(table: R.Tensor((100, 16), "float32"), ids: R.Tensor((2, 8), "int64")):
        with R.dataflow():
            rows = R.take(table, ids, axis=0)  # run-time ids: checked
            fixed = R.take(table, R.const(np.array([3, 5]), "int64"), axis=0)  # constant
            clipped = R.take(table, ids, axis=0, mode="clip")  # cannot read past the table
            R.output(rows, fixed, clipped)
        return (rows, fixed, clipped)


@I.ir_module
class Guarded:
    @T.prim_func(private=True, s_tir=True)
    def check_index(var_ids: T.handle, n: T.int64, var_out: T.handle):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
        m = T.int64()
        ids = T.match_buffer(var_ids, (m,), "int64")
        out = T.match_buffer(var_out, (m,), "int64")
        with T.sblock("root"):
            for i in range(m):
                index = T.Cast("int64", ids[i])
                with T.Assert(T.int64(0) <= index and index < n, [MESSAGE], "IndexError"):
                    out[i] = ids[i]

    @R.function
    def main(table: R.Tensor((100, 16), "float32"), ids: R.Tensor((2, 8), "int64")):
        cls = Guarded
        with R.dataflow():
            flat = R.reshape(ids, R.shape([16]))
            checked = R.call_tir(
                cls.check_index, (flat, R.prim_value(T.int64(100))), R.Tensor((16,), "int64")
            )
            restored = R.reshape(checked, R.shape([2, 8]))
            rows = R.take(table, restored, axis=0)
            fixed = R.take(table, R.const(np.array([3, 5]), "int64"), axis=0)
            clipped = R.take(table, ids, axis=0, mode="clip")
            R.output(rows, fixed, clipped)
        return (rows, fixed, clipped)


def test_run_time_indices_are_read_through_a_range_check():
    # the constant and the clip-mode takes are as they were
    tvm.ir.assert_structural_equal(GuardTakeIndices()(Lookups), Guarded)


def _embedding(vocab: int = 100, dim: int = 16):
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(vocab, dim), torch.nn.Linear(dim, 4)).eval()


@pytest.mark.parametrize("level", ["O0", "O2"])
def test_an_out_of_vocabulary_token_raises_index_error_like_torch(level, rng):
    import torch

    model = _embedding()
    ids = rng.integers(0, 100, size=(2, 8)).astype("int64")
    mod, params = tvmamp.from_torch(model, (torch.from_numpy(ids),))
    exe = tvmamp.build(mod, level, "llvm", dtype="bfloat16", params=params)
    with torch.inference_mode():
        ref = model(torch.from_numpy(ids)).numpy()
    tol = 1e-5 if level == "O0" else 3e-2
    np.testing.assert_allclose(np.asarray(exe(ids)), ref, rtol=tol, atol=tol)
    for bad in (100, 10**8, -1):
        wrong = ids.copy()
        wrong[1, 3] = bad
        with pytest.raises(IndexError):
            model(torch.from_numpy(wrong))
        with pytest.raises(IndexError, match=r"must lie in \[0, 100\)"):
            exe(wrong)
    # the executable is still usable after the error
    np.testing.assert_allclose(np.asarray(exe(ids)), ref, rtol=tol, atol=tol)


@I.ir_module
class DynamicLookup:
    @R.function
    def main(table: R.Tensor(("v", 8), "float32"), ids: R.Tensor(("b", "s"), "int32")):
        with R.dataflow():
            rows = R.take(table, ids, axis=0)
            R.output(rows)
        return rows


def test_symbolic_extents_and_int32_indices_are_checked_at_run_time(rng):
    """The vocabulary and the index shape are symbolic: the extent is passed in at run time."""
    exe = tvmamp.build(DynamicLookup, "O0", "llvm")
    table = rng.standard_normal((37, 8)).astype("float32")
    ids = rng.integers(0, 37, size=(3, 5)).astype("int32")
    np.testing.assert_array_equal(np.asarray(exe(table, ids)), table[ids])
    ids[2, 4] = 37
    with pytest.raises(IndexError, match=r"must lie in \[0, v\)"):
        exe(table, ids)
    with pytest.raises(IndexError):
        exe(table[:30], np.full((1, 2), 30, dtype="int32"))  # in range of 37, not of 30
