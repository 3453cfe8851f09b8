"""DepthwisePlanes: low-precision NCHW depthwise convs read their fp32 input in one kernel."""

from __future__ import annotations

import re
import warnings

import numpy as np
import pytest
import torch
import tvm
from relax_modules import depthwise_model
from tvm import relax, s_tir, tirx

import tvmamp
from tvmamp.pipeline import run_front_phases
from tvmamp.relay_passes.conv2d_im2col import Geometry
from tvmamp.relay_passes.depthwise_planes import (
    PLANES_ATTR,
    DepthwisePlanes,
    plane_interior,
    uses_planes,
)
from tvmamp.schedules.cpu.depthwise_planes import CPUDepthwisePlanes
from tvmamp.targets.cpu_features import cpu_level_features

# (input NCHW, kernel, stride, padding, dilation), odd sizes on purpose.
CASES = {
    "planes_odd": ((2, 13, 9, 11), 3, 1, 1, 1),  # 13 channels, rows of 11, batch 2
    "planes_5x5_dilated": ((1, 21, 10, 7), 5, 1, 4, 2),
    "planes_asymmetric": ((1, 19, 12, 14), 3, 1, 0, 1),  # no padding
    "direct_stride2": ((1, 13, 13, 11), 3, 2, 1, 1),  # odd width: no pairs of columns
    "polyphase": ((2, 13, 14, 10), 3, 2, 1, 1),  # stride 2: four phase planes
    "polyphase_5x5": ((1, 19, 13, 12), 5, 2, 2, 1),  # odd height, padding 2
    "polyphase_unpadded": ((1, 7, 12, 8), 3, 2, 0, 1),
    "polyphase_4x4": ((1, 5, 10, 12), 4, 2, 1, 1),  # even kernel
    "planes_parallel": ((1, 64, 14, 13), 3, 1, 1, 1),  # enough work for a parallel loop
    "polyphase_parallel": ((1, 64, 28, 28), 3, 2, 1, 1),
    "direct_columns": ((1, 9, 8, 16), 3, 1, 1, 1),  # rows of 16: the columns tiling
}
LEVEL = {"float32": "O0", "bfloat16": "O2", "float16": "O2"}


def geometry(shape, k=3, s=1, p=1) -> Geometry:
    return Geometry.make(shape, (k, k), (s, s), (1, 1), (p, p, p, p), shape[1])


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_depthwise_matches_torch(rng, name, dtype):
    model, mod = depthwise_model(CASES[name])
    x = rng.uniform(0.1, 1.0, CASES[name][0]).astype("float32")
    x *= rng.choice([-1.0, 1.0], x.shape).astype("float32")  # never zero
    with torch.no_grad():
        ref = model(torch.from_numpy(x)).numpy()
    low = None if dtype == "float32" else dtype
    with warnings.catch_warnings():  # bf16 without avx512_bf16 warns that it is emulated
        warnings.simplefilter("ignore", UserWarning)
        exe = tvmamp.build(mod, LEVEL[dtype], "llvm -num-cores=2", dtype=low)
    out = exe.vm["main"](tvm.runtime.tensor(x, exe.device)).numpy()
    tol = 1e-4 if dtype == "float32" else 2e-2
    np.testing.assert_allclose(out, ref, rtol=tol, atol=tol * float(np.abs(ref).max()))


@pytest.mark.parametrize(
    "g, planes",
    [
        (geometry((1, 384, 14, 14)), True),  # rows of 14: neither whole vectors nor tiny
        (geometry((1, 960, 7, 7)), False),  # tiny planes: channels vectorised
        (geometry((1, 144, 56, 56)), False),  # rows of 56 = 7 x 8: the columns tiling
        (geometry((1, 144, 56, 56), s=2), True),  # stride 2: polyphase planes
        (geometry((1, 144, 55, 55), s=2), False),  # odd width: no pairs of columns
    ],
)
def test_kernel_choice(g, planes):
    assert uses_planes(g) is planes


def test_strided_planes_need_an_fp32_input():
    g = geometry((1, 144, 56, 56), s=2)
    assert uses_planes(g, "float32") and not uses_planes(g, "bfloat16")


@pytest.mark.parametrize(
    "g, interior",
    [
        (geometry((1, 8, 14, 10)), (1, 14, 1, 10)),
        (geometry((1, 8, 14, 10), s=2), (1, 6, 1, 4)),  # rows 1-6 of 8, columns 1-4 of 6
        (geometry((1, 8, 12, 8), s=2, p=0), (0, 6, 0, 4)),
    ],
)
def test_plane_interior(g, interior):
    """The rows and columns of every phase plane that hold input in all phases."""
    assert plane_interior(g) == interior


def _main_calls(mod: tvm.IRModule) -> list[relax.Call]:
    calls = []
    relax.analysis.post_order_visit(
        mod["main"], lambda e: calls.append(e) if isinstance(e, relax.Call) else None
    )
    return calls


@pytest.mark.parametrize("name", ["planes_odd", "direct_stride2"])
def test_cast_is_absorbed(name):
    """The conv kernel reads the fp32 input: no ``astype`` of it is left."""
    _, mod = depthwise_model(CASES[name])
    converted = tvmamp.convert(mod, "O2", "llvm", dtype="bfloat16").mod
    rewritten = DepthwisePlanes()(converted)
    x = rewritten["main"].params[0]
    casts = [
        c
        for c in _main_calls(rewritten)
        if c.op == tvm.ir.Op.get("relax.astype") and c.args[0].same_as(x)
    ]
    assert not casts
    (kernel,) = [c for c in _main_calls(rewritten) if c.op == tvm.ir.Op.get("relax.call_tir")]
    assert str(kernel.args[1].fields[0].ty.dtype) == "float32"


def test_polyphase_reads_pairs_of_columns():
    """A stride-2 conv's kernel reads the fp32 input as a uint64 view: no cast, no copy."""
    _, mod = depthwise_model(CASES["polyphase"])
    converted = tvmamp.convert(mod, "O2", "llvm", dtype="bfloat16").mod
    rewritten = DepthwisePlanes()(converted)
    x = rewritten["main"].params[0]
    (view,) = [c for c in _main_calls(rewritten) if c.op == tvm.ir.Op.get("relax.memory.view")]
    assert view.args[0].same_as(x)
    assert [int(d) for d in view.ty.shape] == [2, 13, 14, 5] and str(view.ty.dtype) == "uint64"
    astype = tvm.ir.Op.get("relax.astype")
    assert not [c for c in _main_calls(rewritten) if c.op == astype and c.args[0].same_as(x)]


def test_fp32_and_grouped_convs_are_left_alone():
    _, mod = depthwise_model(CASES["planes_odd"])
    tvm.ir.assert_structural_equal(DepthwisePlanes()(mod), mod)


def test_bad_dtype():
    with pytest.raises(ValueError, match="int8"):
        DepthwisePlanes(dtypes=("int8",))


def _has_planes_block(func: tirx.PrimFunc) -> bool:
    sch = s_tir.Schedule(func)
    blocks = sch.get_child_blocks(sch.get_sblock("root"))
    return any(PLANES_ATTR in sch.get(b).annotations for b in blocks)


def _planes_kernel(name: str, target: str) -> tuple[tirx.PrimFunc, tvm.target.Target]:
    _, mod = depthwise_model(CASES[name])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        converted = tvmamp.convert(mod, "O2", target, dtype="bfloat16")
    lowered = run_front_phases(converted)
    funcs = [
        f
        for _, f in lowered.functions_items()
        if isinstance(f, tirx.PrimFunc) and _has_planes_block(f)
    ]
    (func,) = funcs
    return func, converted.target


@pytest.mark.parametrize("name", ["planes_parallel", "polyphase_parallel"])
def test_planes_run_in_parallel(name):
    """With two cores the planes loop is parallel (the rule once failed there and fell back)."""
    func, target = _planes_kernel(name, "llvm -mcpu=znver4 -mattr=-sse4a -num-cores=2")
    sch = CPUDepthwisePlanes().apply(func, target, False)
    assert sch is not None and "T.parallel" in sch.mod["main"].script()


@pytest.mark.parametrize("name", ["planes_odd", "polyphase"])
@pytest.mark.parametrize("kind", ["x86-64-v3", "znver4", "sapphirerapids"])
def test_forced_cpu_kinds_build_vector_fmas(kind, name):
    """Build only: the planes kernel for each CPU kind has vector FMAs of its width."""
    func, target = _planes_kernel(name, f"llvm -mcpu={kind} -num-cores=2")
    sch = CPUDepthwisePlanes().apply(func, target, False)
    assert sch is not None
    lib = tvm.tirx.build(
        tvm.IRModule({"conv": sch.mod["main"].with_attr("global_symbol", "conv")}), target=target
    )
    register = "zmm" if "avx512f" in cpu_level_features(kind) else "ymm"
    asm = lib.inspect_source("asm")
    assert re.search(rf"vfmadd\w+ps\s+[^\n]*%{register}", asm), f"no {register} FMA for {kind}"


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("constant", [True, False], ids=["const_w", "runtime_w"])
@pytest.mark.parametrize("groups", [16, 2, 1], ids=["depthwise", "grouped", "dense"])
@pytest.mark.parametrize("stride", [1, 2])
def test_low_precision_conv_without_out_dtype_at_o0(rng, groups, constant, dtype, stride):
    """A low model's conv2d has no out_dtype (``None``); str(None) is the truthy "None", and
    the depthwise rewrite failed with "unknown dtype `None`" (an fp16 ONNX MobileNet at O0).
    With the weight an input, it failed in call_te ("not supported type in emit_te"). Its
    kernel then accumulated in the low dtype: in bf16 the results were wrong (error above 1,
    NaN for some shapes); it accumulates in fp32 and rounds once."""
    import ml_dtypes

    np_low = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float16
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 16, 9, 11), dtype))
    w = relax.Var("w", relax.TensorType((16, 16 // groups, 3, 3), dtype))
    with bb.function("main", [x, w]):
        with bb.dataflow():
            conv = relax.op.nn.conv2d(x, w, strides=stride, padding=1, groups=groups)
            out = bb.emit_output(conv)
        bb.emit_func_output(out)
    data = rng.standard_normal((1, 16, 9, 11)).astype(np_low)
    weight = rng.standard_normal((16, 16 // groups, 3, 3)).astype(np_low)
    mod = bb.get()
    if constant:
        mod["main"] = mod["main"].bind_params({"w": relax.const(weight, dtype)})
    exe = tvmamp.build(mod, "O0", "llvm")
    out = exe(data) if constant else exe(data, weight)
    ref = torch.nn.functional.conv2d(
        torch.from_numpy(data.astype("float64")),
        torch.from_numpy(weight.astype("float64")),
        None,
        stride,
        1,
        1,
        groups,
    ).numpy()
    err = np.abs(np.asarray(out, dtype="float64") - ref).max() / np.abs(ref).max()
    assert err <= (5e-3 if dtype == "float16" else 1e-2)
