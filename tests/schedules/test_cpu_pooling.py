"""CPUPooling (max/avg/global pooling, NCHW) and CPUElementwise's vector length for bf16."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import tvm
from relax_modules import unary_module
from tolerances import assert_close
from tvm import relax
from tvm.s_tir.dlight.analysis import get_root_block

import tvmamp
from tvmamp.pipeline import legalize_passes, run_front_phases
from tvmamp.schedules.cpu.elementwise import CPUElementwise
from tvmamp.schedules.cpu.pooling import CPUPooling

SHAPE = (2, 5, 23, 29)  # odd channels, odd and unequal height and width


_module = unary_module


# name -> (relax op, torch reference)
CASES = {
    "max_3x3_s2_p1": (
        lambda x: relax.op.nn.max_pool2d(x, (3, 3), (2, 2), (1, 1, 1, 1)),
        lambda x: torch.nn.functional.max_pool2d(x, 3, 2, 1),
    ),
    "max_2x2_s2": (
        lambda x: relax.op.nn.max_pool2d(x, (2, 2), (2, 2)),
        lambda x: torch.nn.functional.max_pool2d(x, 2, 2),
    ),
    "avg_3x3_s1_p1": (
        lambda x: relax.op.nn.avg_pool2d(x, (3, 3), (1, 1), (1, 1, 1, 1), count_include_pad=True),
        lambda x: torch.nn.functional.avg_pool2d(x, 3, 1, 1, count_include_pad=True),
    ),
    "avg_3x3_s2_p1_exclude_pad": (
        lambda x: relax.op.nn.avg_pool2d(x, (3, 3), (2, 2), (1, 1, 1, 1)),
        lambda x: torch.nn.functional.avg_pool2d(x, 3, 2, 1, count_include_pad=False),
    ),
    "global_avg": (
        lambda x: relax.op.nn.adaptive_avg_pool2d(x, (1, 1)),
        lambda x: torch.nn.functional.adaptive_avg_pool2d(x, 1),
    ),
    "global_mean": (
        lambda x: relax.op.mean(x, axis=[2, 3], keepdims=True),
        lambda x: x.mean((2, 3), keepdim=True),
    ),
}


# Strided windows (stride 2 along the width) keep TVM's default inner loops (vectorising across
# the stride was 2.5x slower when measured); only the parallel loop over planes is the rule's.
STRIDED = ("max_3x3_s2_p1", "max_2x2_s2", "avg_3x3_s2_p1_exclude_pad")


def _kernels(mod, target):
    """The kernels with a reduction (a bf16 mean's widening cast is a kernel of its own)."""
    with target:
        lowered = tvm.transform.Sequential(legalize_passes())(mod)
    items = lowered.functions_items()
    return [f for gv, f in items if isinstance(f, tvm.tirx.PrimFunc) and gv.name_hint != "cast"]


@pytest.mark.parametrize("mcpu", ["znver4", "sapphirerapids", "x86-64-v3"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", list(CASES))
def test_rule_vectorises_and_builds(name, dtype, mcpu):
    """The rule takes the kernel, vectorises it, runs planes in parallel on 2 cores, builds."""
    target = tvm.target.Target({"kind": "llvm", "mcpu": mcpu, "num-cores": 2})
    (func,) = _kernels(_module(CASES[name][0], (4, 64, 56, 57), dtype), target)
    with target:
        sch = CPUPooling().apply(func, target, False)
    assert sch is not None, f"CPUPooling declined {name}"
    script = sch.mod.script()
    if name in STRIDED:  # parallel planes around TVM's default loops, no vectors
        assert "T.parallel" in script and "T.vectorized" not in script
        tvm.compile(sch.mod["main"].with_attr("global_symbol", "main"), target=target)
        return
    # bf16 lanes are unrolled for LLVM to vectorise (TVM 0.27 cannot store a bf16 vector max)
    assert "T.vectorized" in script or dtype == "bfloat16"
    assert "T.parallel" in script
    lib = tvm.compile(sch.mod["main"].with_attr("global_symbol", "main"), target=target)
    ir = lib.mod.inspect_source("ll")
    assert " x float>" in ir or " x bfloat>" in ir  # the window update runs on vectors


def test_rule_declines_other_reductions():
    """A softmax, a sum over channels and a matmul are not pooling."""
    target = tvm.target.Target({"kind": "llvm", "mcpu": "znver4", "mattr": ["-sse4a"]})
    ops = [
        lambda x: relax.op.nn.softmax(x, axis=-1),
        lambda x: relax.op.sum(x, axis=[1], keepdims=True),
        lambda x: relax.op.matmul(x, x),
    ]
    for op in ops:
        for func in _kernels(_module(op, (2, 3, 16, 16)), target):
            with target:
                assert CPUPooling().apply(func, target, False) is None


@pytest.mark.parametrize("level, dtype", [("O0", "float32"), ("O3", "bfloat16")])
@pytest.mark.parametrize("name", list(CASES))
def test_numerics_odd_shapes(name, level, dtype):
    """tvmamp.build against torch in float64; fp32 within 1e-5, bf16 within 1e-2."""
    op, ref = CASES[name]
    x = np.random.default_rng(0).uniform(0.5, 4, SHAPE).astype("float32")
    x *= np.random.default_rng(1).choice([-1.0, 1.0], SHAPE).astype("float32")
    exe = tvmamp.build(_module(op, x.shape), level, "llvm", "bfloat16")
    out = exe(x)
    expected = ref(torch.from_numpy(x.astype("float64"))).numpy()
    rtol, atol = (1e-5, 1e-6) if dtype == "float32" else (2e-2, 2e-2)
    assert_close(out, expected, rtol=rtol, atol=atol, what=f"{name} {level}")


def _channel_shuffle(x, groups=3):
    n, c, h, w = (int(d) for d in x.ty.shape)
    y = relax.op.reshape(x, (n, groups, c // groups, h, w))
    y = relax.op.permute_dims(y, [0, 2, 1, 3, 4])
    return relax.op.reshape(y, (n, c, h, w))


def test_bf16_shuffle_keeps_contiguous_vectors():
    """bf16's 32 lanes do not divide a 28 x 28 plane: vectorise 16 over h * w, not the nest.

    Before, the whole nest was fused and split by 32, so every lane recomputed its channel.
    """
    mod = _module(_channel_shuffle, (1, 240, 28, 28), "bfloat16")
    converted = tvmamp.convert(
        mod, "O3", "llvm -mcpu=znver4 -mattr=-sse4a", "bfloat16", keep_io_types=False
    )
    lowered = run_front_phases(converted)
    (func,) = [f for _, f in lowered.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    with converted.target:
        sch = CPUElementwise().apply(func, converted.target, False)
    (block,) = sch.get_child_blocks(get_root_block(sch))
    extents = [int(sch.get(loop).extent) for loop in sch.get_loops(block)]
    assert extents == [240 * 28 * 28 // 16, 16]  # a vector of 16 inside an h * w plane
    assert "T.vectorized" in sch.mod.script()
    x = np.random.default_rng(3).uniform(-2, 2, (1, 240, 28, 28)).astype("float32")
    exe = tvmamp.build(_module(_channel_shuffle, x.shape), "O3", "llvm", "bfloat16")
    ref = x.reshape(1, 3, 80, 28, 28).transpose(0, 2, 1, 3, 4).reshape(x.shape)
    assert_close(exe(x), ref, rtol=1e-2, atol=1e-2, what="channel shuffle O3")


@pytest.mark.parametrize("cores", [1, 2])
@pytest.mark.parametrize("name", list(CASES))
def test_symbolic_image_sizes(name, cores):
    """A model exported with dynamic image sizes: a window moving one column at a time gets
    vectors of channels (PoolFormer's pooling ran as naive loops, 35x its static time), a
    strided one keeps TVM's loops; torch's results at two sizes."""
    op, ref = CASES[name]
    h, w = tvm.tirx.Var("h", "int64"), tvm.tirx.Var("w", "int64")
    mod = _module(op, (2, 20, h, w))
    target = tvm.target.Target(
        {"kind": "llvm", "mcpu": "znver4", "mattr": ["-sse4a"], "num-cores": cores}
    )
    (func,) = _kernels(mod, target)
    with target:
        sch = CPUPooling().apply(func, target, False)
    if name in STRIDED:
        assert sch is None
    else:
        assert sch is not None and "T.vectorized" in sch.mod.script()
    exe = tvmamp.build(mod, "O0", target)
    for shape in [(2, 20, 23, 29), (2, 20, 6, 5)]:
        x = np.random.default_rng(shape[2]).uniform(-4, 4, shape).astype("float32")
        expected = ref(torch.from_numpy(x.astype("float64"))).numpy()
        assert_close(exe(x), expected, rtol=1e-5, atol=1e-6, what=f"{name} {shape}")
