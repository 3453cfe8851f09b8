"""bf16 matmul kernels on the CPU: vdpbf16ps / AMX code, numerics, packing, epilogues, gating."""

from __future__ import annotations

import math
import re

import ml_dtypes
import numpy as np
import pytest
import tvm
from tvm import relax, tirx
from tvm.s_tir import TensorIntrin
from tvm.target import Target

from tvmamp.pipeline import legalize_passes
from tvmamp.schedules.cpu import (
    CPUMatmulBF16,
    bf16_matmul,
    common,
    cpu_schedule_passes,
    default_cpu_rules,
)
from tvmamp.schedules.cpu.bf16_matmul import make_plan
from tvmamp.schedules.cpu.common import row_block_tiles
from tvmamp.schedules.x86 import bf16_intrin
from tvmamp.targets.llvm import _host_flags

# znver4 has avx512_bf16 but no AMX (vdpbf16ps kernels); sapphirerapids adds AMX-BF16.
VDPBF16PS = tvm.target.Target(
    {"kind": "llvm", "mcpu": "znver4", "mattr": ["-sse4a"], "num-cores": 1}
)
AMX = tvm.target.Target({"kind": "llvm", "mcpu": "sapphirerapids", "num-cores": 2})
NO_BF16 = tvm.target.Target({"kind": "llvm", "mcpu": "skylake-avx512", "num-cores": 1})
# Intel avx512_bf16 without AMX: vdpbf16ps at half the FLOPs of the fp32 FMAs
COOPERLAKE = tvm.target.Target({"kind": "llvm", "mcpu": "cooperlake", "num-cores": 1})
KERNELS = [
    pytest.param(VDPBF16PS, "vdpbf16ps", "avx512_bf16", id="vdpbf16ps"),
    pytest.param(AMX, "tdpbf16ps", "amx_bf16", id="amx"),
]
LEGALIZE = legalize_passes()


def _needs_host(flag: str) -> None:
    if flag not in _host_flags():
        pytest.skip(f"the host CPU lacks {flag}")


def _gemm(m: int, k: int, n: int, weight: np.ndarray | None = None, epilogue=None):
    """``x[m, k] @ w[k, n]`` (bf16 in, fp32 out), ``w`` a constant when given."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((m, k), "bfloat16"))
    w = relax.Var("w", relax.TensorType((k, n), "bfloat16"))
    with bb.function("main", [x, w]):
        with bb.dataflow():
            out = bb.emit(relax.op.matmul(x, w, out_dtype="float32"))
            out = bb.emit_output(epilogue(bb, out) if epilogue else out)
        bb.emit_func_output(out)
    mod = bb.get()
    if weight is not None:
        mod["main"] = mod["main"].bind_params({"w": relax.const(weight, "bfloat16")})
    return mod


def _compile(mod: tvm.IRModule, target: tvm.target.Target):
    with target:
        mod = tvm.transform.Sequential([*LEGALIZE, *cpu_schedule_passes(target)])(mod)
    return mod, tvm.compile(mod, target=target)


def _asm(exe) -> str:
    mods = [exe.mod, *exe.mod.imports]
    return "\n".join(m.inspect_source("asm") for m in mods if m.kind == "llvm")


def _bf16(rng, shape) -> np.ndarray:
    return rng.standard_normal(shape).astype(ml_dtypes.bfloat16)


def _rel_err(out, ref) -> float:
    return float(np.abs(out - ref).max() / np.abs(ref).max())


@pytest.mark.parametrize(("target", "instruction", "flag"), KERNELS)
@pytest.mark.parametrize(("m", "k", "n"), [(1000, 37, 999), (1, 256, 200), (257, 96, 64)])
def test_ragged_shapes_and_batch_one(rng, target, instruction, flag, m, k, n):
    _needs_host(flag)
    a, b = _bf16(rng, (m, k)), _bf16(rng, (k, n))
    _, exe = _compile(_gemm(m, k, n), target)
    small = m < CPUMatmulBF16.Config().amx_min_rows  # batch 1 streams weights with vdpbf16ps
    assert ("vdpbf16ps" if small else instruction) in _asm(exe)
    vm = relax.VirtualMachine(exe, tvm.cpu())
    out = vm["main"](tvm.runtime.tensor(a), tvm.runtime.tensor(b)).numpy()
    assert _rel_err(out, a.astype("float64") @ b.astype("float64")) <= 1e-2


@pytest.mark.parametrize(
    ("extents", "tile"),
    [
        ([1, 257, 1024, 4096], (6, 64)),  # 8 x 2 pads 7 rows, 7 x 2 two, 6 x 4 one
        ([1, 197, 1152, 384], (6, 64)),
        ([1, 49, 512, 2048], (7, 32)),  # 7 divides: A read in place
        ([1, 128, 3072, 768], (8, 32)),  # 8 divides
        ([1, 197, 197, 64], (8, 32)),  # 64-column tiles would pad 256 columns, not 224
        ([1, 3, 1024, 1024], (3, 64)),  # GEMV tile
    ],
)
def test_a_wide_tile_where_the_configured_one_pads_rows(extents, tile):
    plan = make_plan(extents, CPUMatmulBF16.Config())
    assert (plan.tile_i, plan.tile_j) == tile
    plain = make_plan(extents, CPUMatmulBF16.Config(wide_tile=None))
    assert plain.tile_j == 32 or extents[1] <= CPUMatmulBF16.Config().gemv_rows
    # on 16 cores the column tiles are the parallel tasks: 16 of 64 columns for 1024 columns
    # are enough, 2 for 128 are not
    if tile == (6, 64):
        assert make_plan(extents, CPUMatmulBF16.Config(), cores=16).tile_j == 64
        narrow = make_plan([1, extents[1], 128, extents[3]], CPUMatmulBF16.Config(), cores=16)
        assert narrow.tile_j == 32


@pytest.mark.parametrize("constant", [True, False], ids=["const_w", "runtime_w"])
def test_wide_tile_matches_float64(rng, constant):
    """17 rows: three 6 x 64 tiles (one padded row) with a bias-and-GELU epilogue on its 24
    accumulators, the weight packed at compile time or per call."""
    _needs_host("avx512_bf16")
    a, b = _bf16(rng, (17, 96)), _bf16(rng, (96, 192))
    bias = rng.standard_normal(192).astype("float32")

    def epilogue(bb, out):
        return relax.op.nn.gelu(relax.op.add(out, relax.const(bias)))

    assert make_plan([1, 17, 192, 96], CPUMatmulBF16.Config()).tile_i == 6
    _, exe = _compile(_gemm(17, 96, 192, b if constant else None, epilogue), VDPBF16PS)
    vm = relax.VirtualMachine(exe, tvm.cpu())
    args = [tvm.runtime.tensor(a)] + ([] if constant else [tvm.runtime.tensor(b)])
    out = vm["main"](*args).numpy()
    pre = a.astype("float64") @ b.astype("float64") + bias
    ref = 0.5 * pre * (1 + np.vectorize(math.erf)(pre / math.sqrt(2)))
    assert _rel_err(out, ref) <= 1e-2


@pytest.mark.parametrize(
    ("extents", "tiles"),
    [
        ([1, 4096, 4096, 4096], 128),  # 32 MiB of A: blocks of 128 row tiles (8 MiB)
        ([1, 2048, 4096, 4096], 128),
        ([1, 1024, 4096, 4096], None),  # 8 MiB: fits
        ([1, 4112, 4096, 4096], None),  # 514 row tiles: only blocks of 2 would fit
    ],
)
def test_a_larger_than_the_cache_is_cut_into_blocks_of_row_tiles(extents, tiles):
    plan = make_plan(extents, CPUMatmulBF16.Config())
    assert row_block_tiles(plan.extents, plan.tile_i, 2) == tiles


@pytest.mark.parametrize("cores", [1, 2])
@pytest.mark.parametrize("constant", [True, False], ids=["const_w", "runtime_w"])
def test_blocks_of_row_tiles_match_float64(rng, monkeypatch, cores, constant):
    """33 row tiles of 96 values, blocks of 3 (a 4.6 KB limit): each block walks every strip."""
    _needs_host("avx512_bf16")
    monkeypatch.setattr(common, "A_BLOCK_BYTES", 8 * 96 * 2 * 3)
    target = tvm.target.Target(
        {"kind": "llvm", "mcpu": "znver4", "mattr": ["-sse4a"], "num-cores": cores}
    )
    a, b = _bf16(rng, (264, 96)), _bf16(rng, (96, 64))
    mod, exe = _compile(_gemm(264, 96, 64, b if constant else None), target)
    gemm = next(f for gv, f in mod.functions_items() if gv.name_hint.endswith("prepacked"))
    assert re.search(r"for \w+ in range\(T\.int64\(11\)\)", gemm.script()), gemm.script()
    vm = relax.VirtualMachine(exe, tvm.cpu())
    args = [tvm.runtime.tensor(a)] + ([] if constant else [tvm.runtime.tensor(b)])
    assert _rel_err(vm["main"](*args).numpy(), a.astype("float64") @ b.astype("float64")) <= 1e-2


@pytest.mark.parametrize(
    ("m", "k", "n", "rows_outside"),
    [
        (512, 128, 512, True),  # training's weight-gradient GEMM: a 128 KiB packed weight
        (1000, 37, 999, True),
        (512, 256, 1024, True),  # a 512 KiB weight: the most that fits
        (512, 258, 1024, False),
        (256, 1024, 1024, False),  # 2 MiB: each weight strip walks all row tiles
        (128, 128, 512, False),  # a 256 KiB output: it stays in cache
        (4, 128, 512, False),  # a GEMV
    ],
)
def test_row_tiles_walk_a_small_weight_for_an_output_sized_epilogue_operand(m, k, n, rows_outside):
    config = CPUMatmulBF16.Config()
    assert make_plan([1, m, n, k], config, output_operand=True).rows_outside == rows_outside
    assert not make_plan([1, m, n, k], config).rows_outside  # no such operand: strips


def _update_gemm(m: int, k: int, n: int, weight: np.ndarray | None) -> tvm.IRModule:
    """``p - 0.5 * (x[m, k] @ w[k, n])``, an fp32 ``p`` read by the epilogue (an SGD update)."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((m, k), "bfloat16"))
    w = relax.Var("w", relax.TensorType((k, n), "bfloat16"))
    p = relax.Var("p", relax.TensorType((m, n), "float32"))
    with bb.function("main", [x, w, p]):
        with bb.dataflow():
            grad = bb.emit(relax.op.matmul(x, w, out_dtype="float32"))
            step = relax.op.multiply(grad, relax.const(0.5, "float32"))
            out = bb.emit_output(relax.op.subtract(p, step))
        bb.emit_func_output(out)
    mod = bb.get()
    if weight is not None:
        mod["main"] = mod["main"].bind_params({"w": relax.const(weight, "bfloat16")})
    return mod


@pytest.mark.parametrize("cores", [1, 2])
@pytest.mark.parametrize("constant", [True, False], ids=["const_w", "runtime_w"])
def test_row_tiles_outside_with_an_epilogue_operand_match_float64(
    rng, monkeypatch, cores, constant
):
    """3003 rows (429 row tiles of 7) walk a 70 x 45 weight, fused with an fp32 update."""
    _needs_host("avx512_bf16")
    target = tvm.target.Target(
        {"kind": "llvm", "mcpu": "znver4", "mattr": ["-sse4a"], "num-cores": cores}
    )
    plans = []
    monkeypatch.setattr(
        bf16_matmul, "make_plan", lambda *a: plans.append(make_plan(*a)) or plans[-1]
    )
    a, b = _bf16(rng, (3003, 70)), _bf16(rng, (70, 45))
    p = rng.standard_normal((3003, 45)).astype("float32")
    _, exe = _compile(_update_gemm(3003, 70, 45, b if constant else None), target)
    assert [plan.rows_outside for plan in plans] == [True]
    vm = relax.VirtualMachine(exe, tvm.cpu())
    args = [tvm.runtime.tensor(a), *([] if constant else [tvm.runtime.tensor(b)])]
    out = vm["main"](*args, tvm.runtime.tensor(p)).numpy()
    ref = p - 0.5 * (a.astype("float64") @ b.astype("float64"))
    assert _rel_err(out, ref) <= 1e-6


@pytest.mark.parametrize(("k", "loops"), [(96, [6, 2, 8]), (40, [2, 20]), (16, [2, 8])])
def test_a_run_time_weight_is_packed_16_rows_at_a_time_across_its_columns(k, loops):
    """K in whole blocks of 16 rows: the blocks outermost, then the 32-column blocks and the
    pairs of each (else one column block down all of K); the pair helper packs every tile."""
    mod, _ = _compile(_gemm(64, k, 64), VDPBF16PS)
    pack = next(f for gv, f in mod.functions_items() if gv.name_hint.endswith("weight_prepack"))
    text = pack.script()
    extents = [
        int(e)
        for line in text.split("T.call_extern")[0].splitlines()
        if " for " in line
        for e in re.findall(r"T\.int64\((\d+)\)", line.split(" in ", 1)[1])
    ]
    assert extents == loops, text
    assert "tvmamp_pack_pairs_2x32" in text


@pytest.mark.parametrize(("k", "vector"), [(1500, None), (40, 40), (96, 32), (208, 16)])
def test_the_padded_copy_of_a_vectorises_only_whole_vectors(rng, k, vector):
    """A ragged ``K`` (1500 = 46.9 vectors: attention's P over 1500 keys) is left to LLVM,
    which hoists the row guard and vectorises with a remainder; vectorising all 1500 columns
    as one TVM vector ran at 8 GB/s. A ``K`` of whole 16- or 32-lane vectors, or of at most 64
    values, is vectorised by TVM as before."""
    m = 130  # a ragged row count, so A is copied (padded) before the GEMM
    mod, exe = _compile(_gemm(m, k, 64), VDPBF16PS)
    copy = next(
        f for gv, f in mod.functions_items() if gv.name_hint.endswith("prepacked_weight_prepack")
    )
    widths = [int(w) for w in re.findall(r"T\.vectorized\(T\.int64\((\d+)\)\)", copy.script())]
    assert widths == ([] if vector is None else [vector]), copy.script()
    if "avx512_bf16" in _host_flags():
        a, b = _bf16(rng, (m, k)), _bf16(rng, (k, 64))
        vm = relax.VirtualMachine(exe, tvm.cpu())
        out = vm["main"](tvm.runtime.tensor(a), tvm.runtime.tensor(b)).numpy()
        assert _rel_err(out, a.astype("float64") @ b.astype("float64")) <= 1e-2


@pytest.mark.parametrize(("m", "k", "n"), [(300, 64, 32), (64, 40, 48), (257, 96, 1024)])
def test_row_tiles_run_in_parallel_when_column_tasks_are_too_few(rng, m, k, n):
    """16 cores: 1, 2 or 32 column tasks; the row tiles join them in the parallel loop."""
    _needs_host("avx512_bf16")
    target = tvm.target.Target(
        {"kind": "llvm", "mcpu": "znver4", "mattr": ["-sse4a"], "num-cores": 16}
    )
    a, b = _bf16(rng, (m, k)), _bf16(rng, (k, n))
    mod, exe = _compile(_gemm(m, k, n), target)
    gemm = next(f for gv, f in mod.functions_items() if "matmul" in gv.name_hint)
    tasks = re.findall(r"T\.parallel\(T\.int64\((\d+)\)", gemm.script())
    assert tasks and int(tasks[0]) >= 16, tasks
    vm = relax.VirtualMachine(exe, tvm.cpu())
    out = vm["main"](tvm.runtime.tensor(a), tvm.runtime.tensor(b)).numpy()
    assert _rel_err(out, a.astype("float64") @ b.astype("float64")) <= 1e-2


def _bias_gelu_cast(bias: np.ndarray):
    def epilogue(bb, out):
        out = bb.emit(relax.op.add(out, relax.const(bias, "float32")))
        return relax.op.astype(relax.op.nn.gelu(out), "bfloat16")

    return epilogue


@pytest.mark.parametrize(("target", "instruction", "flag"), KERNELS)
def test_weight_packed_at_compile_time_with_fused_epilogue(rng, target, instruction, flag):
    _needs_host(flag)
    m, k, n = 64, 128, 96
    a, b, bias = _bf16(rng, (m, k)), _bf16(rng, (k, n)), rng.standard_normal(n).astype("float32")
    mod, exe = _compile(_gemm(m, k, n, b, _bias_gelu_cast(bias)), target)
    calls = _calls(mod["main"])
    prepacks = [c for c in calls if c.args[0].name_hint.endswith("_prepack")]
    # The weight packing is folded into a constant; AMX packs the activation into tiles.
    args = [a for c in prepacks for a in c.args[1].fields]
    assert not [a for a in args if isinstance(a, tvm.ir.expr.Constant)], prepacks
    assert len(prepacks) == (1 if instruction == "tdpbf16ps" else 0), prepacks
    assert len(calls) - len(prepacks) == 1, calls  # matmul, bias, gelu and cast are one kernel
    assert instruction in _asm(exe)
    out = relax.VirtualMachine(exe, tvm.cpu())["main"](tvm.runtime.tensor(a)).numpy()
    pre = a.astype("float64") @ b.astype("float64") + bias
    ref = 0.5 * pre * (1 + np.vectorize(math.erf)(pre / np.sqrt(2)))
    assert _rel_err(out.astype("float64"), ref) <= 1e-2


def _calls(func: relax.Function) -> list[relax.Call]:
    calls = []
    relax.analysis.post_order_visit(
        func.body,
        lambda e: (
            calls.append(e) if isinstance(e, relax.Call) and e.op.name == "relax.call_tir" else None
        ),
    )
    return calls


def test_rule_is_gated_on_avx512bf16():
    assert any(isinstance(r.rule, CPUMatmulBF16) for r in default_cpu_rules(VDPBF16PS))
    assert not any(isinstance(r.rule, CPUMatmulBF16) for r in default_cpu_rules(NO_BF16))
    assert not CPUMatmulBF16().is_target_available(NO_BF16)


def test_without_avx512bf16_the_build_widens_and_still_runs(rng):
    a, b = _bf16(rng, (33, 40)), _bf16(rng, (40, 24))
    _, exe = _compile(_gemm(33, 40, 24), NO_BF16)
    assert "vdpbf16ps" not in _asm(exe)
    out = relax.VirtualMachine(exe, tvm.cpu())["main"](*map(tvm.runtime.tensor, (a, b))).numpy()
    assert _rel_err(out, a.astype("float64") @ b.astype("float64")) <= 1e-2


@pytest.mark.parametrize("constant", [True, False], ids=["const_w", "runtime_w"])
@pytest.mark.parametrize(("rows", "on_vdpbf16ps"), [(67, False), (8, False), (4, True)])
def test_intel_without_amx_multiplies_gemms_of_many_rows_with_fp32_fma(
    rng, rows, on_vdpbf16ps, constant
):
    """On Emerald Rapids with AMX off, vdpbf16ps ran 86 GFLOP/s and the fp32 FMAs 176, and
    SimpleNet at O2 took 1.68x the time of fp32. From ``fma_min_rows`` rows the generic rule's
    widened fp32 FMAs take the GEMM; a GEMV, bound by reading its weight, keeps vdpbf16ps."""
    k, n = 96, 80
    a, b = _bf16(rng, (rows, k)), _bf16(rng, (k, n))
    _, exe = _compile(_gemm(rows, k, n, b if constant else None), COOPERLAKE)
    asm = _asm(exe)
    assert ("vdpbf16ps" in asm) == on_vdpbf16ps
    assert on_vdpbf16ps or "vfmadd" in asm
    _needs_host("avx512_bf16")
    args = [tvm.runtime.tensor(a), *([] if constant else [tvm.runtime.tensor(b)])]
    out = relax.VirtualMachine(exe, tvm.cpu())["main"](*args).numpy()
    assert _rel_err(out, a.astype("float64") @ b.astype("float64")) < 1e-5


@pytest.mark.parametrize("target", [COOPERLAKE, NO_BF16], ids=["cooperlake", "skylake"])
def test_fma_gemms_broadcast_a_widened_copy_of_a(rng, target):
    """The FMA GEMM read each bf16 ``A`` value with a shift and a broadcast from a general
    register, on the ports of Intel's FMAs (Emerald Rapids, AMX off: 1024^3 at 71-73 GFLOP/s,
    80-90 from an fp32 copy). ``A`` is copied to fp32 once and broadcast from memory."""
    m, k, n = 64, 96, 80  # whole row tiles: no padded copy of A would be made
    a, b = _bf16(rng, (m, k)), _bf16(rng, (k, n))
    mod, exe = _compile(_gemm(m, k, n), target)
    (kernel,) = [f for _, f in mod.functions_items() if isinstance(f, tirx.PrimFunc)]
    copy = r"x_reindex = T.sblock_alloc_buffer\(\(T.int64\(1\), T.int64\(64\), T.int64\(96\)\)\)"
    assert re.search(copy, kernel.script())  # no dtype: float32
    asm = _asm(exe)
    assert "vfmadd" in asm and not re.search(r"vpbroadcastd\s+%e\w+, %zmm", asm)
    if target is COOPERLAKE:
        _needs_host("avx512_bf16")
    else:
        _needs_host("avx512f")
    out = relax.VirtualMachine(exe, tvm.cpu())["main"](*map(tvm.runtime.tensor, (a, b))).numpy()
    assert _rel_err(out, a.astype("float64") @ b.astype("float64")) < 1e-5


def test_tuning_searches_no_vdpbf16ps_space_for_a_gemm_left_to_fma():
    from tvmamp.schedules.cpu.bf16_tuning import is_bf16_gemm

    for target, expected in ((COOPERLAKE, False), (VDPBF16PS, True)):
        with target:
            mod = tvm.transform.Sequential(LEGALIZE)(_gemm(64, 96, 80))
        (func,) = [f for _, f in mod.functions_items() if isinstance(f, tirx.PrimFunc)]
        assert is_bf16_gemm(func, target) == expected


def test_intrinsic_is_registered_for_meta_schedule():
    intrin = TensorIntrin.get(bf16_intrin.DPBF16PS_INTRIN)
    assert intrin is not None
    assert "tvmamp_dpbf16ps_16x2" in intrin.impl.script()


@pytest.mark.parametrize(
    ("rows", "tile_i"), [(49, 7), (196, 7), (13, 7), (197, 8), (50, 8), (256, 8), (6, 6)]
)
def test_a_row_shorter_tile_where_it_pads_fewer_rows(rows, tile_i):
    """A 7 x 7 feature map (49 rows) takes 7 tiles of 7 rows instead of 56 padded rows (the
    wide tile, which would take 197 and 50 rows, off)."""
    config = CPUMatmulBF16.Config(wide_tile=None)
    assert make_plan([1, rows, 256, 64], config).tile_i == tile_i
    # with one 16-lane vector (J = 16) seven rows would be seven accumulators: no change
    assert make_plan([1, rows, 16, 64], config).tile_i == min(8, rows)


def test_a_49_row_gemm_reads_a_in_place_and_matches_numpy(rng):
    _needs_host("avx512_bf16")
    a, b = _bf16(rng, (49, 96)), _bf16(rng, (96, 64))
    mod, exe = _compile(_gemm(49, 96, 64), VDPBF16PS)
    # the pre-processing functions: B's pack only (50 rows add a padded copy of A)
    preproc = [gv for gv, _ in mod.functions_items() if gv.name_hint.endswith("_prepack")]
    assert len(preproc) == 1, preproc
    vm = relax.VirtualMachine(exe, tvm.cpu())
    out = vm["main"](tvm.runtime.tensor(a), tvm.runtime.tensor(b)).numpy()
    assert _rel_err(out, a.astype("float64") @ b.astype("float64")) <= 1e-5


def test_tile_plan_exposes_the_config():
    config = CPUMatmulBF16.Config(tile_i=4, vectors_j=3)
    assert make_plan([1, 256, 512, 64], config).padding == [1, 4, 48, 2]
    gemv = make_plan([1, 1, 1024, 1024], config)
    assert (gemv.tile_i, gemv.tile_j) == (1, 16 * config.gemv_vectors_j)


@pytest.mark.slow  # about 3 minutes here: meta_schedule checks every traced primitive
def test_meta_schedule_space_samples_the_tiles():
    from tvm.s_tir import meta_schedule as ms

    from tvmamp.schedules.cpu.bf16_tuning import bf16_matmul_space

    with VDPBF16PS:
        mod = tvm.transform.Sequential(LEGALIZE)(_gemm(64, 64, 64))
    func = next(f for _, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc))
    context = ms.TuneContext(
        mod=tvm.IRModule({"main": func}),
        target=VDPBF16PS,
        space_generator=bf16_matmul_space(VDPBF16PS),
        search_strategy=ms.search_strategy.ReplayFunc(),
    )
    (space,) = context.generate_design_space()
    kinds = [inst.kind.name for inst in space.trace.insts]
    assert "SampleCategorical" in kinds
    assert "Tensorize" in kinds


@pytest.mark.parametrize("target, _asm, flag", KERNELS)
def test_a_blockless_kernel_beside_packed_weights_builds(target, _asm, flag, rng):
    """cumsum's generic kernel is bare loops with no block, which TVM's layout-rewrite split
    aborted on; the split now sees only the functions the bf16 rules marked."""
    import tvmamp

    weight = rng.standard_normal((128, 64)).astype("float32")
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((64, 128), "float32"))
    m = relax.Var("m", relax.TensorType((2, 8), "int64"))
    with bb.function("main", [x, m]):
        with bb.dataflow():
            y = bb.emit(relax.op.matmul(x, relax.const(weight)))
            c = bb.emit(relax.op.cumsum(m, axis=1, dtype="int64"))
            out = bb.emit_output(relax.Tuple([y, c]))
        bb.emit_func_output(out)
    exe = tvmamp.build(bb.get(), "O2", target, dtype="bfloat16")
    assert _asm in exe.get_source("asm")
    _needs_host(flag)
    xs = rng.standard_normal((64, 128)).astype("float32")
    ms = rng.integers(0, 5, (2, 8)).astype("int64")
    y, c = exe(xs, ms)
    np.testing.assert_array_equal(c, np.cumsum(ms, axis=1))
    np.testing.assert_allclose(y, xs @ weight, rtol=2e-2, atol=2e-2 * np.abs(xs @ weight).mean())


@pytest.mark.parametrize("shape", [(2, 5, 5), (3, 33, 20), (128, 512)], ids=str)
def test_an_operand_the_epilogue_also_reads(shape):
    """``x + x @ w`` and torch's ``baddbmm(x, x, x.T)``: the epilogue reads the GEMM's own
    operand. A padded copy of it split out of the kernel replaced it among the parameters, and
    lowering failed ("Buffer lv is used before its definition"); such an operand is now read in
    place when it can be, and the rule declines otherwise."""
    torch = pytest.importorskip("torch")
    import re

    import tvmamp

    class Residual(torch.nn.Module):
        def __init__(self, width):
            super().__init__()
            self.lin = torch.nn.Linear(width, width)

        def forward(self, x):
            if x.dim() == 3:
                n = x.shape[-1]
                return torch.baddbmm(x[:, :, :n], x, x.transpose(1, 2)[:, :, :n])
            return x + self.lin(x)

    torch.manual_seed(0)
    model = Residual(shape[-1]).eval()
    x = torch.randn(shape)
    mod, params = tvmamp.from_torch(model, (x,))
    exe = tvmamp.build(mod, "O2", "llvm -num-cores=1", params=params)
    with torch.no_grad():
        ref = model(x).numpy()
    out = exe(x.numpy())
    np.testing.assert_allclose(out, ref, rtol=2e-2, atol=2e-2 * np.abs(ref).max())
    if len(shape) == 2 and "avx512_bf16" in _host_flags():
        names = re.findall(r"@(\w+)", exe.vm_exec.as_text())
        assert any(n.endswith("_prepacked") for n in names), names  # still the bf16 kernel
    if len(shape) == 2 and shape[0] >= CPUMatmulBF16.Config().amx_min_rows:
        # With AMX (built only): the AMX kernel packs A, which the epilogue reads, and Intel's
        # vdpbf16ps runs at half rate, so the generic rule's fp32 FMAs take the GEMM.
        amx = tvmamp.build(mod, "O2", "llvm -mcpu=sapphirerapids -num-cores=1", params=params)
        names = re.findall(r"@(\w+)", amx.vm_exec.as_text())
        assert not any(n.endswith("_prepacked") for n in names), names


def _symbolic_rows_gemm(rows):
    """The legalized ``x[rows, 96] @ w[96, 80]`` in bf16 with fp32 accumulation."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([rows, 96], "bfloat16"))
    w = relax.Var("w", relax.TensorType([96, 80], "bfloat16"))
    with bb.function("main", [x, w]):
        y = bb.emit(relax.op.matmul(x, w, out_dtype="float32"))
        bb.emit_func_output(y)
    mod = relax.transform.LegalizeOps()(bb.get())
    (func,) = [f for _, f in mod.functions_items() if isinstance(f, tirx.PrimFunc)]
    return func.with_attr("global_symbol", "main")


def test_symbolic_rows_in_whole_tiles_take_vdpbf16ps():
    """A dynamic batch or a MoE expert's rows (padded to whole tiles by PadSymbolicRows) get
    the register-tiled kernel; rows that would need a padded bf16 copy inside the kernel
    (which TVM promotes to fp32) are left to the next rule."""
    target = Target({"kind": "llvm", "mcpu": "znver5", "num-cores": 2})
    m = tirx.Var("m", "int64")
    sch = CPUMatmulBF16().apply(_symbolic_rows_gemm(m * 8), target, False)
    assert sch is not None
    assert "tvmamp_dpbf16ps_16x2" in sch.mod.script()
    assert CPUMatmulBF16().apply(_symbolic_rows_gemm(m), target, False) is None


def test_epilogue_with_a_long_side_chain_is_inlined():
    """Swin V2's attention adds ``16 * sigmoid(bias)`` to its scores, a run-time table: the
    chain of blocks that computes it (8 once fast-math expands the sigmoid) is fused into the
    GEMM's kernel. Inlining stopped after 4 levels and left the kernel unscheduled, a scalar
    loop (4.3 ms instead of 0.15). Here a 12-block chain: the kernel takes vdpbf16ps."""
    rng = np.random.default_rng(9)
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((20, 48), "bfloat16"))
    table = relax.Var("table", relax.TensorType((20, 40), "float32"))
    weight = relax.const(_bf16(rng, (48, 40)), "bfloat16")
    with bb.function("main", [x, table]):
        with bb.dataflow():
            chain = table
            for _ in range(6):  # side computations on the run-time table, 2 blocks each
                chain = relax.op.sigmoid(relax.op.multiply(chain, relax.const(1.5, "float32")))
            scores = relax.op.matmul(x, weight, out_dtype="float32")
            out = bb.emit_output(relax.op.add(scores, chain))
        bb.emit_func_output(out)
    scheduled, _ = _compile(bb.get(), VDPBF16PS)
    kernels = [f.script() for _, f in scheduled.functions_items() if isinstance(f, tirx.PrimFunc)]
    assert any("tvmamp_dpbf16ps_16x2" in k and "sigmoid" in k for k in kernels)
