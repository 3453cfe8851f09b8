"""Transposing copies over symbolic sizes by 16 x 16 register transposes.

``schedules/cpu/elementwise.py`` (``_symbolic_transpose``) with
``transpose_intrin.symbolic_copy_function``: a pure copy or fp32 -> bf16 cast whose extents
or strides depend on symbolic sizes (the keys of a key-value cache, ``[past + 1, heads, dim]
-> [heads, dim, past + 1]``; a dynamic batch) copies its tiles with the register transposes
where both transposed extents are at least 16 at run time, the last tile of a ragged extent
overlapping the one before it, and with its own loops below that. Exact against numpy at sizes
on both sides of 16; bf16 rounded to nearest even.
"""

from __future__ import annotations

import functools

import ml_dtypes
import numpy as np
import pytest
import tvm
from copies import TRANSPOSE_CALL, bits, numpy_dtype, target
from tvm import s_tir, te

from tvmamp.schedules.cpu import transpose_intrin as transpose
from tvmamp.schedules.cpu.elementwise import CPUElementwise

COPIES = [("float32", "float32"), ("bfloat16", "bfloat16"), ("float32", "bfloat16")]


def size(name: str) -> tvm.tirx.Var:
    return tvm.tirx.Var(name, "int64")


def i64(*extents) -> tuple:
    """Static extents as int64, beside int64 symbolic sizes (as Relax legalizes them)."""
    return tuple(tvm.tirx.IntImm("int64", e) if isinstance(e, int) else e for e in extents)


def scheduled(tensors: list[te.Tensor], cores: int = 2) -> s_tir.Schedule:
    sch = CPUElementwise().apply(te.create_prim_func(tensors), target(cores), False)
    assert sch is not None
    return sch


@functools.cache
def keys_transpose(src: str, dst: str, cores: int):
    """``[n, 12, 64] -> [12, 64, n]`` (cast to ``dst``), ``n`` symbolic: schedule and library."""
    n = size("n")
    a = te.placeholder(i64(n, 12, 64), src, name="a")
    b = te.compute(i64(12, 64, n), lambda h, d, t: a[t, h, d].astype(dst), name="b")
    sch = scheduled([a, b], cores)
    return sch, tvm.compile(sch.mod, target=target(cores))


def run(lib, x: np.ndarray, shape, dtype: str) -> np.ndarray:
    out = tvm.runtime.tensor(np.zeros(shape, numpy_dtype(dtype)))
    lib(tvm.runtime.tensor(x), out)
    return out.numpy()


@pytest.mark.parametrize(("src", "dst"), COPIES)
@pytest.mark.parametrize("cores", [1, 2])
def test_keys_of_a_cache_of_any_length(src, dst, cores, rng):
    """Lengths below 16 take the kernel's own loops, from 16 the register transposes (whole
    tiles at 16 and 512, an overlapping last tile at 17 and 513); exact at each."""
    sch, lib = keys_transpose(src, dst, cores)
    assert TRANSPOSE_CALL in sch.mod.script()
    for n in (1, 5, 15, 16, 17, 100, 512, 513):
        x = (rng.standard_normal((n, 12, 64)) * 10).astype(numpy_dtype(src))
        out = run(lib, x, (12, 64, n), dst)
        expected = x.transpose(1, 2, 0).astype(numpy_dtype(dst))
        np.testing.assert_array_equal(bits(out), bits(expected), err_msg=f"length {n}")


def test_the_analysis_reads_symbolic_strides():
    """The keys' copy is one 2-D transpose ``[n, 768] -> [768, n]``: heads and dims coalesce
    into one axis of 768 rows whose destination stride is ``n``."""
    n = size("n")
    a = te.placeholder(i64(n, 12, 64), "bfloat16", name="a")
    b = te.compute(i64(12, 64, n), lambda h, d, t: a[t, h, d], name="b")
    sch = s_tir.Schedule(te.create_prim_func([a, b]))
    copy = transpose.strided_copy(sch.get(sch.get_sblock("b")), symbolic=True)
    assert copy is not None and not copy.static
    assert copy.rows[0] == 768 and copy.cols[1] == 768 and copy.outer == ()
    assert str(copy.rows[1]) == "n" and str(copy.cols[0]) == "n"
    # static shapes only, unless asked
    assert transpose.strided_copy(sch.get(sch.get_sblock("b"))) is None


@pytest.mark.parametrize("batch", [1, 3])
def test_a_dynamic_batch_of_ragged_planes(batch, rng):
    """``[b, 196, 384] -> [b, 384, 196]`` (ViT's tokens to channel planes), ``b`` symbolic:
    196 is no whole number of tiles, which the vector squares of the dynamic-batch path gathered
    element by element."""
    b = size("b")
    a = te.placeholder(i64(b, 196, 384), "float32", name="a")
    out = te.compute(i64(b, 384, 196), lambda n, c, p: a[n, p, c], name="out")
    sch = scheduled([a, out])
    assert TRANSPOSE_CALL in sch.mod.script()
    lib = tvm.compile(sch.mod, target=target(2))
    x = rng.standard_normal((batch, 196, 384)).astype("float32")
    np.testing.assert_array_equal(run(lib, x, (batch, 384, 196), "float32"), x.transpose(0, 2, 1))


def test_both_transposed_extents_symbolic(rng):
    """``[n, m] -> [m, n]``: the register transposes only where both are at least 16."""
    n, m = size("n"), size("m")
    a = te.placeholder((n, m), "bfloat16", name="a")
    b = te.compute((m, n), lambda i, j: a[j, i], name="b")
    sch = scheduled([a, b])
    assert TRANSPOSE_CALL in sch.mod.script()
    lib = tvm.compile(sch.mod, target=target(2))
    for rows, cols in [(1, 40), (40, 1), (15, 17), (17, 15), (16, 16), (33, 100)]:
        x = (rng.standard_normal((rows, cols)) * 10).astype(ml_dtypes.bfloat16)
        out = run(lib, x, (cols, rows), "bfloat16")
        np.testing.assert_array_equal(bits(out), bits(x.T), err_msg=f"{rows} x {cols}")


@pytest.mark.parametrize(
    "body",
    [
        lambda a, n: lambda i, j: a[j, i] * 2.0,  # arithmetic
        lambda a, n: lambda i, j: a[(j * 2) % n, i],  # an offset not affine in the iterators
    ],
    ids=["arithmetic", "not affine"],
)
def test_only_pure_affine_copies_take_overlapping_tiles(body, rng):
    """Overlapping tiles write some elements twice, and the offsets must be affine."""
    n = size("n")
    a = te.placeholder(i64(n, 40), "float32", name="a")
    b = te.compute(i64(40, n), body(a, n), name="b")
    unscheduled = s_tir.Schedule(te.create_prim_func([a, b]))
    assert transpose.strided_copy(unscheduled.get(unscheduled.get_sblock("b")), True) is None
    sch = scheduled([a, b])
    assert TRANSPOSE_CALL not in sch.mod.script()
    lib = tvm.compile(sch.mod, target=target(2))
    ref = tvm.compile(te.create_prim_func([a, b]), target=target(2))
    for rows in (3, 37):
        x = rng.standard_normal((rows, 40)).astype("float32")
        expected = run(ref, x, (40, rows), "float32")
        np.testing.assert_array_equal(run(lib, x, (40, rows), "float32"), expected)
