"""Instance and layer norms on CPUs: sums split in whole SIMD vectors, and a variance that
does not cancel on rows far from zero."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import tvm
from tvm import relax, s_tir

import tvmamp
from tvmamp.relay_passes.row_norms import LEGALIZE_MAP
from tvmamp.schedules.cpu.bf16_common import root_blocks
from tvmamp.targets.registry import REGISTRY

LLVM = tvm.target.Target({"kind": "llvm", "mcpu": "znver4", "mattr": ["-sse4a"], "num-cores": 1})


def _norm(kind: str, shape, dtype: str = "float32") -> tvm.IRModule:
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(shape, dtype))
    size = shape[1] if kind == "instance" else shape[-1]
    g = relax.Var("g", relax.TensorType((size,), dtype))
    b = relax.Var("b", relax.TensorType((size,), dtype))
    with bb.function("main", [x, g, b]):
        with bb.dataflow():
            if kind == "instance":
                axes = list(range(2, len(shape)))
                y = relax.op.nn.instance_norm(x, g, b, channel_axis=1, axes=axes, epsilon=1e-5)
            else:
                y = relax.op.nn.layer_norm(x, g, b, axes=[-1], epsilon=1e-5)
            out = bb.emit_output(y)
        bb.emit_func_output(out)
    return bb.get()


def _reference(kind, x, g, b) -> np.ndarray:
    x = x.astype("float64")
    axes = tuple(range(2, x.ndim)) if kind == "instance" else (-1,)
    mean = x.mean(axes, keepdims=True)
    var = ((x - mean) ** 2).mean(axes, keepdims=True)
    shape = (1, -1) + (1,) * (x.ndim - 2) if kind == "instance" else (-1,)
    g, b = (p.astype("float64").reshape(shape) for p in (g, b))
    return (x - mean) / np.sqrt(var + 1e-5) * g + b


def _reduce_extents(mod: tvm.IRModule) -> list[int]:
    """The extents of every reduction axis in the legalized kernels of ``mod``."""
    with LLVM:
        lowered = relax.transform.LegalizeOps(LEGALIZE_MAP)(mod)
    extents = []
    for _, func in lowered.functions_items():
        if isinstance(func, tvm.tirx.PrimFunc):
            sch = s_tir.Schedule(func)
            for block in root_blocks(sch):
                for iv in sch.get(block).iter_vars:
                    if iv.iter_type == tvm.tirx.IterVar.CommReduce:
                        extents.append(int(iv.dom.extent))
    return sorted(extents)


@pytest.mark.parametrize(
    ("kind", "shape", "extents"),
    [
        ("instance", (2, 5, 37), [5, 5, 32, 32]),  # wav2vec 2.0's group norm, shorter
        ("instance", (1, 3, 7, 7), [1, 1, 48, 48]),  # a 7 x 7 plane: 49 values a row
        ("layer", (3, 100), [4, 4, 96, 96]),
    ],
)
def test_ragged_rows_reduce_in_whole_vectors_and_a_tail(kind, shape, extents):
    assert _reduce_extents(_norm(kind, shape)) == extents


def _layer_norm_over(shape, axes):
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(shape, "float32"))
    size = [shape[a] for a in axes]
    g = relax.Var("g", relax.TensorType(size, "float32"))
    b = relax.Var("b", relax.TensorType(size, "float32"))
    with bb.function("main", [x, g, b]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.nn.layer_norm(x, g, b, axes=axes, epsilon=1e-5))
        bb.emit_func_output(out)
    return bb.get()


@pytest.mark.parametrize(
    "shape, axes",
    [((8, 3, 20), [0]), ((tvm.tirx.Var("n", "int64"), 64), [-1])],  # leading axis; symbolic
)
def test_leading_axes_and_symbolic_shapes_keep_tvms_rule(shape, axes):
    mod = _layer_norm_over(shape, axes)
    with LLVM:
        ours = relax.transform.LegalizeOps(LEGALIZE_MAP)(mod)
    with LLVM:
        theirs = relax.transform.LegalizeOps()(mod)
    tvm.ir.assert_structural_equal(ours, theirs)


def test_the_llvm_entry_gives_the_rules_to_its_legalization():
    """The LLVM target entry adds them (``legalize_rules``); other entries keep TVM's rules."""
    assert set(REGISTRY["llvm"].legalize_rules(LLVM)) == set(LEGALIZE_MAP)
    assert REGISTRY["cuda"].legalize_rules(tvm.target.Target("cuda")) == {}


@pytest.mark.parametrize(
    ("kind", "shape", "dtype"),
    [
        ("instance", (2, 5, 3199), "float32"),
        ("instance", (1, 3, 7, 7), "float32"),
        ("layer", (3, 1000), "float32"),
        ("layer", (4, 100), "bfloat16"),
        ("layer", (3, 128), "float32"),
        ("layer", (2, 20), "float32"),
    ],
)
def test_norms_match_float64(rng, kind, shape, dtype):
    """Random, offset inputs (a mean far from 0 tests the two-pass variance)."""
    size = shape[1] if kind == "instance" else shape[-1]
    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype
    x = (rng.standard_normal(shape) * 2 + 30).astype(np_dtype)
    g, b = (rng.standard_normal(size).astype(np_dtype) for _ in range(2))
    exe = tvmamp.build(_norm(kind, shape, dtype), "O0", LLVM)
    out = np.asarray(exe(x, g, b), dtype="float64")
    ref = _reference(kind, x, g, b)
    tol = 3e-2 if dtype == "bfloat16" else 2e-5
    np.testing.assert_allclose(out, ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("kind, shape", [("layer", (64, 512)), ("instance", (2, 3, 16, 16))])
def test_rows_far_from_zero_do_not_cancel(rng, kind, shape):
    """Values 0.01 apart around 1000: TVM's mean(x^2) - mean^2 over sums of x had a relative
    error of 2.4e-2 on the layer norm (torch: 1.8e-2)."""
    size = shape[1] if kind == "instance" else shape[-1]
    x = (rng.random(shape) * 0.01 + 1000).astype("float32")
    g, b = (rng.standard_normal(size).astype("float32") for _ in range(2))
    out = np.asarray(tvmamp.build(_norm(kind, shape), "O0", LLVM)(x, g, b), dtype="float64")
    ref = _reference(kind, x, g, b)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


def _statistic(kind: str, shape, axes, keepdims=False) -> tvm.IRModule:
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(shape, "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            op = getattr(relax.op, kind)
            out = bb.emit_output(op(x, axis=axes, keepdims=keepdims))
        bb.emit_func_output(out)
    return bb.get()


@pytest.mark.parametrize(
    ("kind", "extents"), [("sum", [5, 32]), ("mean", [5, 32]), ("variance", [5, 5, 32, 32])]
)
def test_row_statistics_reduce_in_whole_vectors_and_a_tail(kind, extents):
    """wav2vec 2.0's exported group norm is a ``mean`` and a ``variance`` over 3199 frames:
    TVM's one reduction a row stayed scalar (1.36 of 3.36 ms at O2, one thread); split into
    whole vectors and a tail, they take 0.06 ms."""
    assert _reduce_extents(_statistic(kind, (2, 5, 37), [-1])) == extents


@pytest.mark.parametrize("kind", ["sum", "mean", "variance"])
@pytest.mark.parametrize(
    ("shape", "axes", "keepdims"),
    [
        ((2, 5, 3199), [-1], True),
        ((3, 4, 7, 9), [2, 3], False),  # two trailing axes: one row of 63
        (("n", 6, 37), [2], False),  # a symbolic batch
        ((2, "w"), [1], True),  # a symbolic row length
    ],
    ids=["3199", "two axes", "symbolic batch", "symbolic row"],
)
def test_row_statistics_match_float64(rng, kind, shape, axes, keepdims):
    names = {d: tvm.tirx.Var(d, "int64") for d in shape if isinstance(d, str)}
    mod = _statistic(kind, [names.get(d, d) for d in shape], axes, keepdims)
    exe = tvmamp.build(mod, "O0", LLVM)
    for size in (1, 2) if names else (0,):
        concrete = [d if isinstance(d, int) else (3 if d == "n" else 16 + 15 * size) for d in shape]
        x = rng.uniform(-2, 2, concrete).astype("float32") + 5
        ref = getattr(np, "var" if kind == "variance" else kind)(
            x.astype("float64"), axis=tuple(axes), keepdims=keepdims
        )
        np.testing.assert_allclose(exe(x), ref, rtol=2e-6, atol=1e-6 * np.abs(ref).max())


@pytest.mark.parametrize(("axes", "dtype"), [([0], "float32"), (None, "float32"), ([1], "int32")])
def test_other_statistics_keep_the_rule_beneath(axes, dtype):
    """A leading axis, a full reduction (the full-reduction rule's) and integers: TVM's rule."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((4, 40), dtype))
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.mean(x, axis=axes))
        bb.emit_func_output(out)
    mod = bb.get()
    with LLVM:
        ours = relax.transform.LegalizeOps(LEGALIZE_MAP)(mod)
        theirs = relax.transform.LegalizeOps()(mod)
    tvm.ir.assert_structural_equal(ours, theirs)
