"""Grouped and depthwise conv2d on CPU: scheduled (never naive loops) and numerically right.

In bf16 on avx512_bf16 hosts, wide groups become batched GEMMs and depthwise convs window
kernels on NHWC rows (``tvmamp.relay_passes.conv2d_to_gemm``); narrow groups stay direct convs.
"""

from __future__ import annotations

import re
import warnings

import numpy as np
import pytest
import torch
import tvm
from forced_cpus import forced, forced_str, runs_here
from tvm import relax, s_tir, tirx

import tvmamp
from tvmamp.pipeline import run_front_phases
from tvmamp.relay_passes.conv2d_im2col import WINDOW_ATTR
from tvmamp.relay_passes.grouped_conv_gemm import PERMUTE_ATTR
from tvmamp.schedules.cpu import CPUConv2d
from tvmamp.schedules.cpu.conv_common import ConvShape, choose_plan, find_conv
from tvmamp.targets.cpu_features import cpu_level_features
from tvmamp.targets.llvm import _host_flags

KINDS = ("x86-64-v3", "skylake-avx512", "znver4", "sapphirerapids")
LEVEL = {"float32": "O0", "bfloat16": "O2", "float16": "O2"}
# (input NCHW, out channels, kernel, stride, padding, dilation, groups), odd sizes on purpose.
CASES = {
    "groups3": ((2, 9, 11, 10), 15, 3, 1, 1, 1, 3),  # Cg 3, Fg 5
    "groups3_1x1": ((1, 48, 7, 9), 30, 1, 1, 0, 1, 3),  # no padding block, Fg 10
    "groups2_5x5": ((1, 20, 9, 9), 36, 5, 1, 2, 1, 2),
    "groups4_stride2": ((1, 32, 13, 11), 40, 3, 2, 1, 1, 4),
    "depthwise_stride2": ((2, 24, 13, 12), 24, 3, 2, 1, 1, 24),
    "depthwise_x2_dilated": ((1, 20, 11, 11), 40, 3, 1, 2, 2, 20),
    "narrow_groups": ((1, 64, 8, 8), 64, 3, 1, 1, 1, 32),  # ResNeXt-like, Fg 2
    # bf16: batched GEMMs over the groups and window kernels, on NHWC rows
    "groups3_wide_stride2": ((1, 51, 13, 11), 57, 3, 2, 1, 1, 3),  # Cg 17, Fg 19
    "groups3_1x1_wide": ((2, 48, 7, 9), 48, 1, 1, 0, 1, 3),  # Cg 16, Fg 16, batch 2
    "depthwise_5x5_dilated": ((1, 20, 11, 11), 20, 5, 1, 4, 2, 20),
    "depthwise_columns": ((1, 24, 10, 16), 24, 3, 1, 1, 1, 24),  # rows of 16: vectorised
}


def conv_model(case, epilogue: str = "bias_relu") -> tuple[torch.nn.Module, tvm.IRModule]:
    """A seeded torch conv with its epilogue, and the same as a Relax module with constants."""
    shape, f, k, s, p, d, g = case
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(shape[1], f, k, s, p, dilation=d, groups=g)
    bn = torch.nn.BatchNorm2d(f).eval()
    with torch.no_grad():
        bn.running_mean.uniform_(-0.5, 0.5)
        bn.running_var.uniform_(0.5, 2.0)
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-0.5, 0.5)
    if epilogue == "bias_relu":
        model = torch.nn.Sequential(conv, torch.nn.ReLU())
    else:
        model = torch.nn.Sequential(conv, bn, torch.nn.ReLU6())
    model = model.eval()
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(shape, "float32"))

    def const(t: torch.Tensor) -> relax.Constant:
        return relax.const(t.detach().numpy().astype("float32"))

    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(
                relax.op.nn.conv2d(
                    x, const(conv.weight), strides=s, padding=p, dilation=d, groups=g
                )
            )
            y = bb.emit(relax.op.add(y, const(conv.bias.reshape(1, f, 1, 1))))
            if epilogue == "bias_relu":
                y = bb.emit(relax.op.nn.relu(y))
            else:
                stats = [const(t) for t in (bn.weight, bn.bias, bn.running_mean, bn.running_var)]
                y = bb.emit(
                    relax.op.nn.batch_norm(y, *stats, axis=1, epsilon=bn.eps, training=False)[0]
                )
                y = bb.emit(relax.op.clip(y, 0.0, 6.0))
            out = bb.emit_output(y)
        bb.emit_func_output(out)
    return model, bb.get()


def runnable(kind: str) -> bool:
    return runs_here(forced(kind, 2))


def check_close(out: np.ndarray, ref: np.ndarray, dtype: str) -> None:
    """fp32: 1e-4 relative to the output's scale; bf16/fp16: 2e-2 (inputs rounded to low)."""
    tol = 1e-4 if dtype == "float32" else 2e-2
    scale = float(np.abs(ref).max())
    np.testing.assert_allclose(out, ref, rtol=tol, atol=tol * scale)


def build_and_run(mod, x: np.ndarray, dtype: str, target: str) -> np.ndarray:
    low = None if dtype == "float32" else dtype
    exe = tvmamp.build(mod, LEVEL[dtype], target, dtype=low)
    return exe.vm["main"](tvm.runtime.tensor(x, exe.device)).numpy()


def conv_kernels(mod: tvm.IRModule, target: str, dtype: str = "float32") -> list[tirx.PrimFunc]:
    """The fused conv kernels of ``mod`` converted for ``dtype``, legalised and fused."""
    low = None if dtype == "float32" else dtype
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        lowered = run_front_phases(tvmamp.convert(mod, LEVEL[dtype], target, dtype=low))
    return [
        func
        for _, func in lowered.functions_items()
        if isinstance(func, tirx.PrimFunc) and find_conv(s_tir.Schedule(func)) is not None
    ]


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_grouped_conv_matches_torch(rng, name, dtype):
    model, mod = conv_model(CASES[name])
    x = rng.standard_normal(CASES[name][0]).astype("float32")
    with torch.no_grad():
        ref = model(torch.from_numpy(x)).numpy()
    check_close(build_and_run(mod, x, dtype, "llvm -num-cores=2"), ref, dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["depthwise_stride2", "groups3"])
def test_batch_norm_and_relu6_epilogue(rng, name, dtype):
    model, mod = conv_model(CASES[name], epilogue="bn_relu6")
    x = rng.standard_normal(CASES[name][0]).astype("float32")
    with torch.no_grad():
        ref = model(torch.from_numpy(x)).numpy()
    check_close(build_and_run(mod, x, dtype, "llvm -num-cores=1"), ref, dtype)
    target = tvmamp.convert(mod, "O0", "llvm -num-cores=1").target
    for kernel in conv_kernels(mod, "llvm -num-cores=1", dtype):  # with what FuseOps fused
        assert CPUConv2d().apply(kernel, target, False) is not None


@pytest.mark.parametrize("name", sorted(CASES))
def test_rule_schedules_every_group_count(name):
    """The conv rule takes every grouped conv: vectorised, register-tiled, nothing naive."""
    target = tvm.target.Target(
        {"kind": "llvm", "mcpu": "znver4", "mattr": ["-sse4a"], "num-cores": 2}
    )
    (func,) = conv_kernels(conv_model(CASES[name])[1], "llvm -mcpu=znver4 -mattr=-sse4a")
    sch = CPUConv2d().apply(func, target, False)
    assert sch is not None, f"{name}: CPUConv2d left the grouped conv to the naive fallback"
    script = sch.mod["main"].script()
    assert re.search(r"in T\.vectorized\(", script)
    assert re.search(r"in T\.unroll\(", script)
    assert 'scope="local"' in script  # the accumulator tile


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_padding_copies_whole_rows(dtype):
    """The padding copy runs one plane at a time, its interior rows as plain vectors: no
    element-wise gather with an integer division per element (it made a grouped 32 x 28 x 28
    conv 0.081 ms at O2 against 0.040 ms now)."""
    target = tvm.target.Target(
        {"kind": "llvm", "mcpu": "znver4", "mattr": ["-sse4a"], "num-cores": 2}
    )
    case = ((1, 32, 28, 28), 32, 3, 1, 1, 1, 4)
    (func,) = conv_kernels(conv_model(case)[1], "llvm -mcpu=znver4 -mattr=-sse4a", dtype)
    sch = CPUConv2d().apply(func, target, False)
    script = sch.mod["main"].script()
    # The 28 interior columns of the 28 interior rows: one vector each, no bounds check.
    assert re.search(r"for \w+ in T\.vectorized\(T\.int64\(1\), T\.int64\(29\)\)", script)
    assert re.search(r"for \w+ in T\.parallel\(T\.int64\(32\)\)", script)  # the planes


@pytest.mark.parametrize(
    ("shape", "mode", "width"),
    [
        (ConvShape(144, 56, 56, groups=144, fg=1, cg=1), "groups", 16),  # depthwise
        (ConvShape(144, 28, 28, 144, fg=1, cg=1, stride_x=2), "groups", 16),  # strided
        (ConvShape(144, 56, 56, 144, fg=1, cg=1, stride_x=1), "columns", 8),  # 7 x 8 columns
        (ConvShape(32, 112, 112, 32, fg=1, cg=1, stride_x=1), "columns", 16),
        (ConvShape(384, 14, 14, 384, fg=1, cg=1, stride_x=1), "groups", 16),  # narrow rows
        (ConvShape(64, 56, 56, groups=32, fg=2, cg=1), "groups", 16),  # multiplier 2
        (ConvShape(256, 27, 27, groups=2, fg=128, cg=48), "filters", 32),  # AlexNet
        (ConvShape(120, 14, 14, groups=3, fg=40, cg=160), "filters", 40),  # ShuffleNet
        (ConvShape(512, 7, 7, groups=32, fg=16, cg=16), "filters", 16),  # ResNeXt
    ],
)
def test_plan_vectorises_the_wide_axis(shape, mode, width):
    plan = choose_plan(shape, lanes=16, registers=24)
    assert (plan.mode, plan.tile_v) == (mode, width)
    assert plan.tile_y * plan.tile_x > 1  # a register tile of several output pixels


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_forced_cpu_kinds(rng, kind, dtype):
    """Each CPU kind: run where the host can, else check the conv kernels' vector FMAs."""
    name = "narrow_groups"  # vectors of 16 groups: full zmm FMAs with AVX-512
    model, mod = conv_model(CASES[name])
    target = forced_str(kind, 2)
    if runnable(kind):
        x = rng.standard_normal(CASES[name][0]).astype("float32")
        with torch.no_grad():
            ref = model(torch.from_numpy(x)).numpy()
        with warnings.catch_warnings():  # bf16 without avx512_bf16 warns that it is emulated
            warnings.simplefilter("ignore", UserWarning)
            check_close(build_and_run(mod, x, dtype, target), ref, dtype)
        return
    (func,) = conv_kernels(mod, target, dtype)
    tvm_target = tvmamp.convert(mod, "O0", target).target
    sch = CPUConv2d().apply(func, tvm_target, False)
    assert sch is not None
    lib = tvm.tirx.build(
        tvm.IRModule({"conv": sch.mod["main"].with_attr("global_symbol", "conv")}),
        target=tvm_target,
    )
    asm = lib.inspect_source("asm")
    register = "zmm" if "avx512f" in cpu_level_features(kind) else "ymm"
    assert re.search(rf"vfmadd\w+ps\s+%{register}", asm), f"no {register} FMA for -mcpu={kind}"
    if dtype == "float16":
        assert "vcvtph2ps" in asm  # fp16 widened with F16C, once, outside the FMA loop


class _Unit(torch.nn.Module):
    """A ShuffleNet v1 unit: grouped 1x1, channel shuffle, depthwise 3x3, grouped 1x1; a
    residual add (stride 1) or a concat with the 3x3 average pool of the input (stride 2)."""

    def __init__(self, cin: int, cout: int, stride: int, groups: int = 3):
        super().__init__()
        mid, self.stride, self.groups = cout // 2, stride, groups
        branch = cout - cin if stride == 2 else cout
        nn = torch.nn
        self.reduce = nn.Sequential(
            nn.Conv2d(cin, mid, 1, groups=groups, bias=False), nn.BatchNorm2d(mid), nn.ReLU()
        )
        self.dw = nn.Sequential(
            nn.Conv2d(mid, mid, 3, stride, 1, groups=mid, bias=False), nn.BatchNorm2d(mid)
        )
        self.expand = nn.Sequential(
            nn.Conv2d(mid, branch, 1, groups=groups, bias=False), nn.BatchNorm2d(branch)
        )

    def forward(self, x):
        y = self.reduce(x)
        n, c, h, w = y.shape
        y = y.view(n, self.groups, c // self.groups, h, w).transpose(1, 2).reshape(n, c, h, w)
        y = self.expand(self.dw(y))
        if self.stride == 2:
            return torch.relu(torch.cat([torch.nn.functional.avg_pool2d(x, 3, 2, 1), y], 1))
        return torch.relu(x + y)


def _shuffle_net() -> torch.nn.Module:
    """Stem conv + max pool, a stride-2 and a stride-1 unit, global average pool; seeded, with
    batch-norm statistics that are not the identity."""
    torch.manual_seed(0)
    nn = torch.nn
    stem = nn.Sequential(nn.Conv2d(3, 48, 3, 2, 1), nn.ReLU(), nn.MaxPool2d(3, 2, 1))
    body = nn.Sequential(stem, _Unit(48, 96, 2), _Unit(96, 96, 1))
    for module in body.modules():
        if isinstance(module, nn.BatchNorm2d):
            with torch.no_grad():
                module.running_mean.uniform_(-0.2, 0.2)
                module.running_var.uniform_(0.5, 2.0)
                module.weight.uniform_(0.5, 1.5)
    return body.eval()


def _lowered_kernels(mod, params, target: str) -> tvm.IRModule:
    converted = tvmamp.convert(mod, "O2", target, "bfloat16", params=params)
    return run_front_phases(converted)


def test_shufflenet_units_on_rows_match_torch(rng):
    if "avx512_bf16" not in _host_flags():
        pytest.skip("the host CPU lacks avx512_bf16 (the rows rewrite is bf16 on it only)")
    model = _shuffle_net()
    x = rng.standard_normal((1, 3, 61, 53)).astype("float32")  # odd sizes: 31x27 -> 16x14
    mod, params = tvmamp.from_torch(model, (torch.from_numpy(x),))
    target = "llvm -num-cores=2"
    names = [gv.name_hint for gv in _lowered_kernels(mod, params, target).get_global_vars()]
    for kernel in ("grouped_conv_gemm", "depthwise_rows", "channel_permute", "_pool_rows"):
        assert any(kernel in name for name in names), (kernel, names)
    # Rows from the stem on: one transpose in (the stem's input), one out (the result).
    assert sum("transpose" in name for name in names) == 2, names
    exe = tvmamp.build(mod, "O2", target, "bfloat16", params=params)
    out = np.asarray(exe(x), "float64")
    with torch.no_grad():
        ref = model(torch.from_numpy(x)).numpy().astype("float64")
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) <= 2e-2


def test_grouped_gemms_build_for_amx():
    """The batched GEMMs over groups take the AMX kernel where the target has AMX-BF16
    (compiled only: the numerics above run on the host's kernel)."""
    _, mod = conv_model(CASES["groups3_wide_stride2"])
    exe = tvmamp.build(mod, "O2", "llvm -mcpu=sapphirerapids -num-cores=1", "bfloat16")
    assert "tdpbf16ps" in exe.get_source("asm")


@pytest.mark.parametrize("attr", [WINDOW_ATTR, PERMUTE_ATTR])
def test_rows_kernels_are_vectorised_or_unrolled(attr):
    """The depthwise/pool window kernels and the channel shuffle: CPUConv2d schedules them."""
    model = _shuffle_net()
    x = torch.zeros((1, 3, 61, 53))
    mod, params = tvmamp.from_torch(model, (x,))
    target = "llvm -mcpu=znver4 -mattr=-sse4a -num-cores=2"
    lowered = _lowered_kernels(mod, params, target)
    tvm_target = tvmamp.convert(mod, "O0", target).target
    funcs = [
        func
        for _, func in lowered.functions_items()
        if isinstance(func, tirx.PrimFunc) and attr in func.script()
    ]
    assert funcs, f"no kernel with a {attr} block"
    for func in funcs:
        sch = CPUConv2d().apply(func, tvm_target, False)
        assert sch is not None, func.script()
        script = sch.mod["main"].script()
        if attr == WINDOW_ATTR:
            assert re.search(r"in T\.vectorized\(", script) and 'scope="local"' in script
        else:
            assert re.search(r"in T\.unroll\(", script)


def test_a_grouped_conv_copies_each_taps_channels_as_one_vector(rng):
    """wav2vec 2.0's positional conv (conv1d, 24 channels a group): a 32-lane vector of its
    im2col copy crossed from one tap to the next and gathered its lanes (0.6 ms at 4 % of the
    memory speed). Each tap's 24 channels are one vector now, and the result matches torch."""
    if "avx512_bf16" not in _host_flags():
        pytest.skip("the host CPU lacks avx512_bf16 (the grouped GEMM is bf16 on it only)")
    torch.manual_seed(0)
    model = torch.nn.Conv1d(96, 96, 16, padding=8, groups=4).eval()
    x = rng.standard_normal((1, 96, 49)).astype("float32")
    mod, params = tvmamp.from_torch(model, (torch.from_numpy(x),))
    target = "llvm -mcpu=znver4 -mattr=-sse4a -num-cores=1"
    converted = tvmamp.convert(mod, "O2", target, "bfloat16", params=params)
    with converted.target:
        passes = tvmamp.pipeline.schedule_passes(converted.target, converted.entry)
        scheduled = tvm.transform.Sequential(passes)(run_front_phases(converted))
    copies = [
        f.script()
        for gv, f in scheduled.functions_items()
        if "grouped_conv_gemm" in gv.name_hint and gv.name_hint.endswith("weight_prepack")
    ]
    assert copies and all("T.vectorized(T.int64(24))" in text for text in copies), copies
    exe = tvmamp.build(mod, "O2", target, "bfloat16", params=params)
    with torch.no_grad():
        ref = model(torch.from_numpy(x)).numpy().astype("float64")
    out = np.asarray(exe(x), "float64")
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) <= 2e-2
