"""Pooling kernels keep every core busy: strided max pools and global average pools.

A 16-core audit found two serial or starved pooling kernels. ``CPUPooling`` declined windows
that move two columns per output column (the stride-2 max pool of resnet50, vgg16, densenet,
...), so they ran as TVM's default loops on one thread. Its global average pool ran the channel
vectors in parallel only: N x C/16 tasks, 6 for 96 channels, each reducing a whole plane. Now the
strided pool runs its planes (and row chunks) in parallel, keeping TVM's loops inside, and a
global pool with fewer channel vectors than cores reduces row chunks of the plane in parallel.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import tvm
from relax_modules import unary_module
from tvm import relax

from tvmamp.pipeline import legalize_passes
from tvmamp.schedules.cpu import cpu_schedule_passes
from tvmamp.targets.llvm import _host_flags

CORES = 16
TARGET = {"kind": "llvm", "mcpu": "znver4", "mattr": ["-sse4a"], "num-cores": CORES}


def _max_pool_ref(x: np.ndarray, kernel: int, stride: int, pad: int) -> np.ndarray:
    n, c, h, w = x.shape
    padded = np.full((n, c, h + 2 * pad, w + 2 * pad), -np.inf)
    padded[:, :, pad : pad + h, pad : pad + w] = x
    out_h = (h + 2 * pad - kernel) // stride + 1
    out_w = (w + 2 * pad - kernel) // stride + 1
    out = np.full((n, c, out_h, out_w), -np.inf)
    for i in range(kernel):
        for j in range(kernel):
            window = padded[:, :, i : i + stride * out_h : stride, j : j + stride * out_w : stride]
            out = np.maximum(out, window)
    return out


# name -> (relax op, numpy reference in float64, input shape)
CASES = {
    "max_3x3_s2_p1": (
        lambda x: relax.op.nn.max_pool2d(x, (3, 3), (2, 2), (1, 1, 1, 1)),
        lambda x: _max_pool_ref(x, 3, 2, 1),
        (1, 37, 29, 31),
    ),
    "max_2x2_s2": (
        lambda x: relax.op.nn.max_pool2d(x, (2, 2), (2, 2)),
        lambda x: _max_pool_ref(x, 2, 2, 0),
        (2, 7, 95, 79),
    ),
    # 24 channels: vectors of 12, 2 x 2 = 4 channel tasks; 57 rows in chunks beside them
    "global_mean": (
        lambda x: relax.op.mean(x, axis=[2, 3], keepdims=True),
        lambda x: x.mean((2, 3), keepdims=True),
        (2, 24, 57, 45),
    ),
    "global_avg": (
        lambda x: relax.op.nn.adaptive_avg_pool2d(x, (1, 1)),
        lambda x: x.mean((2, 3), keepdims=True),
        (1, 96, 41, 37),
    ),
    # rows of 3 columns: vectors of 10 channels, 4 channel tasks; 97 rows in chunks beside them
    "max_3x3_s1_p1_narrow": (
        lambda x: relax.op.nn.max_pool2d(x, (3, 3), (1, 1), (1, 1, 1, 1)),
        lambda x: _max_pool_ref(x, 3, 1, 1),
        (1, 40, 97, 3),
    ),
}


def _scheduled(name: str) -> tvm.IRModule:
    target = tvm.target.Target(TARGET)
    op, _, shape = CASES[name]
    with target:
        return tvm.transform.Sequential([*legalize_passes(), *cpu_schedule_passes(target)])(
            unary_module(op, shape)
        )


def _pool_script(mod: tvm.IRModule) -> str:
    (func,) = [f for _, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    return func.script()


def _assert_a_task_per_core(name: str, mod: tvm.IRModule) -> None:
    tasks = re.findall(r"T\.parallel\(T\.int64\((\d+)\)", _pool_script(mod))
    assert tasks, f"{name} has no parallel loop"
    assert int(tasks[0]) >= CORES, tasks


@pytest.mark.parametrize("name", list(CASES))
def test_pool_has_a_task_per_core(name):
    """At least one parallel task per core, around the whole pool (no serial kernel)."""
    _assert_a_task_per_core(name, _scheduled(name))


def test_strided_pool_keeps_default_inner_loops():
    """Only the parallel loop is new: no vectors across the stride."""
    script = _pool_script(_scheduled("max_3x3_s2_p1"))
    assert "T.parallel" in script
    assert "T.vectorized" not in script


@pytest.mark.parametrize("name", list(CASES))
def test_parallel_numerics_odd_shapes(rng, name):
    """The parallel schedule, in fp32, against numpy in float64 on random, non-zero inputs."""
    mod = _scheduled(name)
    _assert_a_task_per_core(name, mod)
    if "avx512f" not in _host_flags():
        pytest.skip("the host CPU lacks avx512f")
    _, ref, shape = CASES[name]
    x = rng.uniform(0.5, 4, shape) * rng.choice([-1.0, 1.0], shape)
    x = x.astype("float32")
    target = tvm.target.Target(TARGET)
    vm = relax.VirtualMachine(tvm.compile(mod, target=target), tvm.cpu())
    out = vm["main"](tvm.runtime.tensor(x)).numpy()
    expected = ref(x.astype("float64"))
    assert out.shape == expected.shape
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)
