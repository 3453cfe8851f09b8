"""Few, long rows: row reductions and strided transposes give every core a task.

``CPURowReduction`` ran one task a row: a GroupNorm of 4-8 groups of 65,536 elements (rewritten
as an instance norm) kept 4-8 of 16 cores busy, each summing and normalising its whole row.
Long rows are now cut into chunks: the partial sums run in parallel over (row, chunk), a
serial loop combines them, and the normalisation is its own parallel loop over (row, chunk).
The strided transposing copy (``transpose_intrin._strided_impl``) ran its row tiles in
parallel and all its column tiles inside: a ``[16384, 32] -> [32, 16384]`` copy had 2 tasks.
Its column tiles are now cut into chunks beside the row tiles. These tests check the parallel
extent at 16 cores and the numbers at odd shapes.
"""

from __future__ import annotations

import re

import ml_dtypes
import numpy as np
import pytest
import tvm
from tvm import relax

from tvmamp.pipeline import legalize_passes
from tvmamp.schedules.cpu import cpu_schedule_passes
from tvmamp.targets.llvm import _host_flags

LEGALIZE = legalize_passes()
CORES = 16
NUMPY = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}


def _target(cores: int = CORES) -> tvm.target.Target:
    return tvm.target.Target(
        {"kind": "llvm", "mcpu": "znver4", "mattr": ["-sse4a"], "num-cores": cores}
    )


def _build(func: relax.Function, params: list[relax.Var], cores: int = CORES):
    bb = relax.BlockBuilder()
    with bb.function("main", params):
        with bb.dataflow():
            out = bb.emit_output(func)
        bb.emit_func_output(out)
    target = _target(cores)
    with target:
        mod = tvm.transform.Sequential([*LEGALIZE, *cpu_schedule_passes(target)])(bb.get())
    return mod, target


def _tasks(mod: tvm.IRModule, name: str) -> list[int]:
    """The extents of the parallel loops of the kernel whose name holds ``name``."""
    scripts = [
        f.script()
        for gv, f in mod.functions_items()
        if isinstance(f, tvm.tirx.PrimFunc) and name in gv.name_hint
    ]
    assert len(scripts) == 1, [gv.name_hint for gv in mod.get_global_vars()]
    return [int(n) for n in re.findall(r"T\.parallel\(T\.int64\((\d+)\)", scripts[0])]


def _run(mod, target, *arrays) -> np.ndarray:
    vm = relax.VirtualMachine(tvm.compile(mod, target=target), tvm.cpu())
    return vm["main"](*(tvm.runtime.tensor(a) for a in arrays)).numpy()


def _skip_without(dtype: str) -> None:
    if dtype == "bfloat16" and "avx512_bf16" not in _host_flags():
        pytest.skip("the host CPU lacks avx512_bf16")


def _group_norm(shape, groups: int, dtype: str, cores: int = CORES):
    """A group norm of ``dtype`` tensors; bf16 ones are cast to fp32 and back, as AMP runs a
    norm (Relax's group norm takes no bf16), the casts fused into the kernel."""
    x = relax.Var("x", relax.TensorType(shape, dtype))
    gamma = relax.Var("g", relax.TensorType((shape[1],), dtype))
    beta = relax.Var("b", relax.TensorType((shape[1],), dtype))
    args = [x, gamma, beta]
    if dtype != "float32":
        args = [relax.op.astype(a, "float32") for a in args]
    out = relax.op.nn.group_norm(*args, groups, 1, list(range(2, len(shape))))
    if dtype != "float32":
        out = relax.op.astype(out, dtype)
    return _build(out, [x, gamma, beta], cores)


def _group_norm_ref(x, gamma, beta, groups: int) -> np.ndarray:
    x64 = x.astype("float64")
    rows = x64.reshape(x.shape[0], groups, -1)
    mean = rows.mean(axis=-1, keepdims=True)
    var = rows.var(axis=-1, keepdims=True)
    norm = ((rows - mean) / np.sqrt(var + 1e-5)).reshape(x.shape)
    scale = (1, -1) + (1,) * (x.ndim - 2)
    return norm * gamma.astype("float64").reshape(scale) + beta.astype("float64").reshape(scale)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_group_norm_of_few_long_rows_has_a_task_per_core(dtype):
    # 4 groups of 2 x 96 x 96 = 18,432 elements: one task a group kept 4 of 16 cores busy.
    mod, _ = _group_norm((1, 8, 96, 96), 4, dtype)
    tasks = _tasks(mod, "group_norm")
    assert tasks and min(tasks) >= CORES, tasks
    # at 2 cores the 4 groups are tasks enough: one a group, as before; at 1 nothing parallel
    assert _tasks(_group_norm((1, 8, 96, 96), 4, dtype, 2)[0], "group_norm") == [4]
    assert _tasks(_group_norm((1, 8, 96, 96), 4, dtype, 1)[0], "group_norm") == []


@pytest.mark.parametrize(
    ("dtype", "shape", "groups"),
    [
        pytest.param("float32", (1, 8, 96, 96), 4, id="fp32-4x18432"),
        pytest.param("float32", (1, 3, 125, 128), 3, id="fp32-3x16000"),  # 15 tasks of 3,200
        pytest.param("float32", (2, 6, 48, 80), 3, id="fp32-6x7680"),
        pytest.param("bfloat16", (1, 6, 100, 80), 3, id="bf16-3x16000"),
    ],
)
def test_group_norm_of_long_rows_matches_numpy(rng, dtype, shape, groups):
    mod, target = _group_norm(shape, groups, dtype)
    assert max(_tasks(mod, "group_norm")) > shape[0] * groups  # rows cut into chunks
    _skip_without(dtype)
    # a mean far from 0 checks the one-pass variance's partial sums are combined right
    x = (rng.standard_normal(shape) * 2 + 3).astype(NUMPY[dtype])
    gamma = (rng.standard_normal(shape[1]) + 1.5).astype(NUMPY[dtype])
    beta = rng.standard_normal(shape[1]).astype(NUMPY[dtype])
    out = _run(mod, target, x, gamma, beta).astype("float64")
    ref = _group_norm_ref(x, gamma, beta, groups)
    tolerance = 1e-4 if dtype == "float32" else 3e-2
    assert np.abs(out - ref).max() / np.abs(ref).max() <= tolerance


def _rows_to_planes(pixels: int, channels: int, height: int, dtype: str, cores: int = CORES):
    """``[pixels, channels]`` rows to ``[1, channels, height, pixels // height]`` planes: a
    reshape and a transpose, one strided transposing copy."""
    x = relax.Var("x", relax.TensorType((pixels, channels), dtype))
    grid = relax.op.reshape(x, (1, height, pixels // height, channels))
    return _build(relax.op.permute_dims(grid, [0, 3, 1, 2]), [x], cores)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_strided_transpose_of_two_row_tiles_has_a_task_per_core(dtype):
    # [8192, 32] -> [32, 8192]: 2 tiles of 16 channels, 512 tiles of 16 pixels.
    mod, _ = _rows_to_planes(8192, 32, 64, dtype)
    tasks = _tasks(mod, "transpose")
    assert tasks and min(tasks) >= CORES, tasks
    # at 2 cores the 2 row tiles are tasks enough, as before; at 1 nothing is parallel
    assert _tasks(_rows_to_planes(8192, 32, 64, dtype, 2)[0], "transpose") == [2]
    assert _tasks(_rows_to_planes(8192, 32, 64, dtype, 1)[0], "transpose") == []


@pytest.mark.parametrize(
    ("dtype", "pixels", "channels", "height"),
    [
        pytest.param("float32", 8192, 32, 64, id="fp32-8192x32"),
        pytest.param("float32", 12345, 40, 5, id="fp32-12345x40"),  # ragged both ways
        pytest.param("bfloat16", 9000, 24, 90, id="bf16-9000x24"),
    ],
)
def test_strided_transpose_matches_numpy(rng, dtype, pixels, channels, height):
    mod, target = _rows_to_planes(pixels, channels, height, dtype)
    assert max(_tasks(mod, "transpose")) >= CORES
    _skip_without(dtype)
    x = (rng.standard_normal((pixels, channels)) + 0.5).astype(NUMPY[dtype])
    x[x == 0] = 1
    out = _run(mod, target, x)
    ref = x.reshape(1, height, pixels // height, channels).transpose(0, 3, 1, 2)
    np.testing.assert_array_equal(out.view(np.uint8), np.ascontiguousarray(ref).view(np.uint8))
