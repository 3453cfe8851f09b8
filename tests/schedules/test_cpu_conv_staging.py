"""Depthwise convs staged to and from channels-innermost by 16 x 16 register transposes.

``schedules/cpu/conv_staging.py``: the ``groups`` tiling with 16 channels a vector pads its
input planes flat and transposes them into rows of 16 channels, and transposes its output rows
back into NCHW planes, the last tile of a plane overlapping the one before it.
"""

from __future__ import annotations

import re
import warnings

import numpy as np
import pytest
import torch
import tvm
from relax_modules import depthwise_model
from tvm import s_tir, tirx

import tvmamp
from tvmamp.pipeline import run_front_phases
from tvmamp.schedules.cpu import CPUConv2d
from tvmamp.schedules.cpu import transpose_intrin as transpose
from tvmamp.schedules.cpu.conv_common import find_conv
from tvmamp.targets.cpu_features import cpu_level_features

LEVEL = {"float32": "O0", "bfloat16": "O2", "float16": "O2"}
# (input NCHW, kernel, stride, padding, dilation). Strided and of odd widths, so that the
# low-precision builds take the direct conv (DepthwisePlanes runs stride-1 convs, and stride-2
# convs of an even width, on flat planes).
STAGED = {
    "c48_7x7_batch2": ((2, 48, 7, 7), 3, 2, 1, 1),  # 81 padded pixels: 5 tiles and a ragged one
    "c32_14x13": ((1, 32, 14, 13), 3, 2, 1, 1),  # the last padded row is never read
    "c64_5x5_dilated": ((1, 64, 13, 11), 5, 2, 2, 2),
    "c16_5x5": ((1, 16, 5, 9), 3, 1, 0, 1),  # 45 pixels in, 21 out: every tile overlaps
}
# Channels that do not fill vectors of 16 groups, or less than a tile of output: the
# gathering copies, as before.
GATHERED = {
    "c40": ((1, 40, 9, 9), 3, 2, 1, 1),
    "c19": ((1, 19, 7, 7), 3, 2, 1, 1),
    "c16_tiny": ((1, 16, 3, 3), 3, 2, 0, 1),  # 9 pixels in, 1 out
}
# The copies' transposes: ``T.call_extern`` of transpose_intrin's functions.
TRANSPOSE_CALL = '"tvmamp_transpose_16x16_i'


def transposes(sch: s_tir.Schedule) -> int:
    return sch.mod["main"].script().count(TRANSPOSE_CALL)


CASES = {**STAGED, **GATHERED}


def never_zero(rng, shape) -> np.ndarray:
    x = rng.uniform(0.1, 1.0, shape).astype("float32")
    return x * rng.choice([-1.0, 1.0], shape).astype("float32")


def scheduled_conv(name: str, target: str, dtype: str) -> tuple[s_tir.Schedule, tvm.target.Target]:
    """The case's conv kernel, converted for ``dtype``, scheduled by ``CPUConv2d``."""
    _, mod = depthwise_model(CASES[name])
    low = None if dtype == "float32" else dtype
    with warnings.catch_warnings():  # bf16 without avx512_bf16 warns that it is emulated
        warnings.simplefilter("ignore", UserWarning)
        converted = tvmamp.convert(mod, LEVEL[dtype], target, dtype=low)
    lowered = run_front_phases(converted)
    (func,) = [
        f
        for _, f in lowered.functions_items()
        if isinstance(f, tirx.PrimFunc) and find_conv(s_tir.Schedule(f)) is not None
    ]
    sch = CPUConv2d().apply(func, converted.target, False)
    assert sch is not None, f"{name}: CPUConv2d left the depthwise conv to the naive fallback"
    return sch, converted.target


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_depthwise_matches_torch(rng, name, dtype):
    model, mod = depthwise_model(CASES[name])
    x = never_zero(rng, CASES[name][0])
    with torch.no_grad():
        ref = model(torch.from_numpy(x)).numpy()
    low = None if dtype == "float32" else dtype
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        exe = tvmamp.build(mod, LEVEL[dtype], "llvm -num-cores=2", dtype=low)
    out = exe.vm["main"](tvm.runtime.tensor(x, exe.device)).numpy()
    tol = 1e-4 if dtype == "float32" else 2e-2
    np.testing.assert_allclose(out, ref, rtol=tol, atol=tol * float(np.abs(ref).max()))


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_staged_exactly_when_channels_fill_vectors(name, dtype):
    """With AVX-512, 16 channels a vector: both copies are transposes; otherwise gathers."""
    sch, _ = scheduled_conv(name, "llvm -mcpu=znver4 -mattr=-sse4a -num-cores=2", dtype)
    # Whole tiles, and an overlapping last one where the pixels are not a multiple of 16.
    count = transposes(sch)
    assert count >= 2 if name in STAGED else count == 0


@pytest.mark.parametrize("kind", ["znver4", "sapphirerapids", "x86-64-v3"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_forced_cpu_kinds_build(kind, dtype):
    """Build only: AVX-512 kinds transpose with two-register shuffles; AVX2 (8 lanes) keeps the
    gathering copies. Vector FMAs of the kind's width either way."""
    sch, target = scheduled_conv("c48_7x7_batch2", f"llvm -mcpu={kind} -num-cores=2", dtype)
    lib = tvm.tirx.build(
        tvm.IRModule({"conv": sch.mod["main"].with_attr("global_symbol", "conv")}), target=target
    )
    asm = lib.inspect_source("asm")
    avx512 = "avx512f" in cpu_level_features(kind)
    register = "zmm" if avx512 else "ymm"
    assert re.search(rf"vfmadd\w+ps\s+[^\n]*%{register}", asm), f"no {register} FMA for {kind}"
    assert bool(re.search(r"vpermt2[wdq]", asm)) is avx512
    assert (transposes(sch) > 0) is avx512


@pytest.mark.parametrize(
    ("src", "dst", "found"),
    [
        ("float32", "float32", True),
        ("float16", "float16", True),
        ("float32", "bfloat16", True),  # rounded as TVM rounds a bf16 store
        ("float16", "bfloat16", False),
        ("float64", "float64", False),
        ("int8", "int8", False),
    ],
)
def test_planes_intrinsic_dtypes(src, dst, found):
    assert (transpose.planes_intrin(src, dst, 7, 7) is not None) is found
    if src == dst:
        assert (transpose.rows_intrin(src, 81) is not None) is found
