"""The AMX kernel's cache blocking (n/k blocks), tile-packed activations and tensorized packing."""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.s_tir import dlight as dl

from tvmamp.pipeline import legalize_passes
from tvmamp.schedules.cpu import CPUMatmulBF16
from tvmamp.schedules.cpu.bf16_amx import (
    MAX_COLUMN_PADDING,
    WEIGHT_SLICE_BYTES,
    auto_n_block,
    call_panels,
    make_plan,
    padding,
)
from tvmamp.schedules.cpu.bf16_passes import SplitPreproc
from tvmamp.targets.llvm import _host_flags

AMX = tvm.target.Target({"kind": "llvm", "mcpu": "sapphirerapids", "num-cores": 1})
LEGALIZE = legalize_passes()


@pytest.mark.parametrize(
    ("extents", "n_block", "k_block", "expected"),
    [
        ([1, 1024, 1024, 1024], 512, 1024, (512, 1024, 1024)),  # one K block: local tiles
        ([1, 257, 1024, 4096], 512, 1024, (512, 1024, 4096)),  # four K blocks
        ([1, 64, 999, 3000], 512, 1024, (512, 1024, 3072)),  # 94 steps: 3 x 32 steps
        ([1, 64, 544, 2100], 512, 1024, (32, 704, 2112)),  # 17 panels; 66 steps: 3 x 22
        ([1, 64, 96, 37], 512, 1024, (96, 64, 64)),
    ],
)
def test_plan_balances_k_blocks_and_divides_columns(extents, n_block, k_block, expected):
    plan = make_plan(extents, n_block, k_block)
    assert (plan.n_block, plan.k_block, plan.k_padded) == expected
    assert plan.k_blocked == (expected[2] > expected[1])


@pytest.mark.parametrize(
    ("extents", "expected"),
    [
        ([1, 1024, 1024, 1024], (512, 1024, 1024)),  # 512 columns at most
        ([1, 1024, 512, 2048], (256, 2048, 2048)),  # K unblocked, a 1 MiB weight slice
        ([1, 4096, 4096, 4096], (128, 4096, 4096)),
        ([1, 257, 1024, 4096], (128, 4096, 4096)),  # 288 x 512 fp32: 576 KiB
        ([1, 1024, 999, 3000], (128, 3008, 3008)),  # 160 columns fit; 128 divide the padded J
        ([1, 1024, 256, 10000], (128, 3360, 10080)),  # three K blocks of 105 steps
        ([1, 4096, 64, 40000], (64, 4000, 40000)),  # ten K blocks; J has two panels
        # few rows: the K-blocked fp32 accumulator stays in L2, so K blocks of 1024
        ([1, 128, 384, 1536], (384, 768, 1536)),  # BERT's FFN down-projection, 192 KiB
        ([1, 256, 1024, 4096], (512, 1024, 4096)),  # 256 x 512 fp32: 512 KiB
        ([12, 197, 64, 2048], (64, 1024, 2048)),  # a batch: the accumulator is per batch
    ],
)
def test_automatic_blocks_keep_the_weight_slice_or_the_accumulator_in_l2(extents, expected):
    plan = make_plan(extents, None, CPUMatmulBF16.Config().amx_k_block)
    assert (plan.n_block, plan.k_block, plan.k_padded) == expected
    assert plan.n_block == 32 or plan.n_block * plan.k_block * 2 <= WEIGHT_SLICE_BYTES


def test_automatic_column_block_is_at_least_one_panel():
    assert [auto_n_block(k) for k in (512, 1024, 2048, 8192, 1 << 15)] == [512, 512, 256, 64, 32]


@pytest.mark.parametrize(("n_block", "k_block"), [(100, 1024), (512, 0), (512, 48)])
def test_plan_rejects_blocks_that_are_not_multiples_of_32(n_block, k_block):
    with pytest.raises(ValueError, match="not a positive multiple of 32"):
        make_plan([1, 64, 64, 64], n_block, k_block)


@pytest.mark.parametrize(
    ("extents", "cores", "expected"),
    [
        ([1, 256, 1024, 1024], 1, (512, 1)),  # one core: widest column block, rows uncut
        ([1, 256, 1024, 1024], 16, (128, 2)),  # 8 column blocks x 2 row chunks
        ([1, 1024, 1024, 1024], 16, (256, 4)),
        ([1, 4096, 4096, 4096], 16, (512, 2)),  # 8 column blocks are not enough alone
        ([1, 3136, 64, 576], 16, (64, 14)),  # a conv GEMM: 64 columns, so the rows are cut
        ([12, 128, 128, 64], 4, (128, 1)),  # the batch gives the tasks
    ],
)
def test_plan_gives_every_core_work(extents, cores, expected):
    plan = make_plan(extents, 512, 1024, cores)
    assert (plan.n_block, plan.row_chunks) == expected
    rows, panels = -(-extents[1] // 32), -(-extents[2] // 32)
    assert rows % plan.row_chunks == 0 and panels * 32 % plan.n_block == 0
    tasks = extents[0] * (panels * 32 // plan.n_block) * plan.row_chunks
    busiest = -(-tasks // cores) * (rows // plan.row_chunks) * (plan.n_block // 32)
    assert busiest <= 1.25 * -(-extents[0] * rows * panels // cores)  # 32 x 32 blocks


@pytest.mark.parametrize(
    ("extents", "cores", "n_block"),
    [
        ([1, 128, 50257, 384], 1, 512),  # GPT-2's LM head: 1571 panels, a prime; pads 13
        ([1, 128, 30522, 768], 1, 512),  # BERT's vocabulary: 954 panels, 16 divide none
        ([1, 40, 1690, 64], 1, 288),  # 53 panels (prime): 9-panel blocks pad one
        ([1, 64, 544, 2100], 1, 32),  # 17 panels: a wider block would pad 6 %
        ([1, 128, 50257, 384], 16, 480),  # 15-panel blocks: 105 of them for 16 cores
    ],
)
def test_column_blocks_may_pad_a_prime_panel_count_a_little(extents, cores, n_block):
    plan = make_plan(extents, None, CPUMatmulBF16.Config().amx_k_block, cores)
    assert plan.n_block == n_block
    padded = -(-extents[2] // plan.n_block) * plan.n_block
    assert padded <= -(-extents[2] // 32) * 32 * (1 + MAX_COLUMN_PADDING)
    assert padding(plan)[2] == plan.n_block


@pytest.mark.parametrize(
    ("columns", "expected"), [(32, 1), (64, 2), (96, 3), (128, 4), (288, 3), (512, 4), (160, 1)]
)
def test_a_kernel_call_walks_at_most_four_panels_that_divide_the_block(columns, expected):
    assert call_panels(columns) == expected


def test_lm_head_kernel_pads_columns_to_whole_blocks_of_several_panels_per_call():
    """53 column panels (prime): 9-panel blocks, J padded from 1696 to 1728, 3 panels a call."""
    b = np.random.default_rng(0).standard_normal((64, 1690)).astype(ml_dtypes.bfloat16)
    text = _kernel_text(_schedule(_gemm_relu(40, 64, 1690, b), CPUMatmulBF16.Config()))
    assert "tvmamp_amx_bf16_32xn" in text and "T.int64(3))" in text
    assert "T.int64(108), T.int64(32), T.int64(16), T.int64(2)" in text  # 1728 / 16 panels


def _gemm_relu(m: int, k: int, n: int, weight=None) -> tvm.IRModule:
    """``relu(x[m, k] @ w[k, n])`` in bf16 with fp32 output; ``w`` a constant when given."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((m, k), "bfloat16"))
    w = relax.Var("w", relax.TensorType((k, n), "bfloat16"))
    with bb.function("main", [x, w]):
        with bb.dataflow():
            out = bb.emit(relax.op.matmul(x, w, out_dtype="float32"))
            out = bb.emit_output(relax.op.nn.relu(out))
        bb.emit_func_output(out)
    mod = bb.get()
    if weight is not None:
        mod["main"] = mod["main"].bind_params({"w": relax.const(weight, "bfloat16")})
    return mod


def _schedule(mod: tvm.IRModule, config: CPUMatmulBF16.Config) -> tvm.IRModule:
    passes = [*LEGALIZE, dl.ApplyDefaultSchedule(CPUMatmulBF16(config)), SplitPreproc()]
    with AMX:
        return tvm.transform.Sequential(passes)(mod)


def _kernel_text(mod: tvm.IRModule) -> str:
    funcs = [f for _, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    return "\n".join(f.script() for f in funcs)


@pytest.mark.parametrize(("m", "k", "n"), [(70, 2100, 100), (64, 1024, 64), (33, 96, 544)])
@pytest.mark.parametrize("constant", [True, False], ids=["const_w", "runtime_w"])
def test_k_blocked_kernel_matches_float64(rng, m, k, n, constant):
    if "amx_bf16" not in _host_flags():
        pytest.skip("the host CPU lacks amx_bf16")
    config = dataclasses.replace(CPUMatmulBF16.Config(), amx_n_block=64, amx_k_block=512)
    a = rng.standard_normal((m, k)).astype(ml_dtypes.bfloat16)
    b = rng.standard_normal((k, n)).astype(ml_dtypes.bfloat16)
    mod = _schedule(_gemm_relu(m, k, n, b if constant else None), config)
    text = _kernel_text(mod)
    assert "tvmamp_amx_bf16_32xn" in text
    acc = [line for line in text.splitlines() if "C = T.match_buffer" in line]
    # One K block: 32 x 32 local tiles; several: a global fp32 buffer accumulates across them.
    assert acc and all(('scope="local"' in line) == (k <= 512) for line in acc), acc
    vm = relax.VirtualMachine(tvm.compile(mod, target=AMX), tvm.cpu())
    args = [tvm.runtime.tensor(a)] + ([] if constant else [tvm.runtime.tensor(b)])
    out = vm["main"](*args).numpy()
    ref = np.maximum(a.astype("float64") @ b.astype("float64"), 0)
    assert np.abs(out - ref).max() / np.abs(ref).max() <= 1e-2


@pytest.mark.parametrize("m", [2, 5, 16])
def test_amx_for_fewer_than_32_rows_pads_them_and_matches_float64(rng, m):
    """The tuning choice ``amx_min_rows=2``: rows padded to 32, the padding never written out."""
    config = dataclasses.replace(CPUMatmulBF16.Config(), amx_min_rows=2)
    k, n = 96, 80
    a = rng.standard_normal((m, k)).astype(ml_dtypes.bfloat16)
    b = rng.standard_normal((k, n)).astype(ml_dtypes.bfloat16)
    mod = _schedule(_gemm_relu(m, k, n, b), config)
    assert "tvmamp_amx_bf16_32xn" in _kernel_text(mod)
    if "amx_bf16" not in _host_flags():
        pytest.skip("the host CPU lacks amx_bf16 (scheduled, not run)")
    vm = relax.VirtualMachine(tvm.compile(mod, target=AMX), tvm.cpu())
    out = vm["main"](tvm.runtime.tensor(a)).numpy()
    ref = np.maximum(a.astype("float64") @ b.astype("float64"), 0)
    assert out.shape == (m, n)
    assert np.abs(out - ref).max() / np.abs(ref).max() <= 1e-2


AMX_16 = tvm.target.Target({"kind": "llvm", "mcpu": "sapphirerapids", "num-cores": 16})


@pytest.mark.parametrize(("m", "k", "n"), [(256, 1024, 1024), (200, 2100, 96), (33, 96, 544)])
def test_kernel_split_for_16_cores_matches_float64(rng, m, k, n):
    """Row chunks and narrower column blocks in parallel (the plan for 16 cores)."""
    if "amx_bf16" not in _host_flags():
        pytest.skip("the host CPU lacks amx_bf16")
    a = rng.standard_normal((m, k)).astype(ml_dtypes.bfloat16)
    b = rng.standard_normal((k, n)).astype(ml_dtypes.bfloat16)
    passes = [*LEGALIZE, dl.ApplyDefaultSchedule(CPUMatmulBF16()), SplitPreproc()]
    with AMX_16:
        mod = tvm.transform.Sequential(passes)(_gemm_relu(m, k, n))
    assert "T.parallel" in _kernel_text(mod)
    vm = relax.VirtualMachine(tvm.compile(mod, target=AMX_16), tvm.cpu())
    out = vm["main"](tvm.runtime.tensor(a), tvm.runtime.tensor(b)).numpy()
    ref = np.maximum(a.astype("float64") @ b.astype("float64"), 0)
    assert np.abs(out - ref).max() / np.abs(ref).max() <= 1e-2


def test_weight_packing_calls_the_pair_helper_padded_or_not():
    config = CPUMatmulBF16.Config()
    aligned = _kernel_text(_schedule(_gemm_relu(64, 128, 96), config))
    padded = _kernel_text(_schedule(_gemm_relu(64, 127, 99), config))
    assert "tvmamp_pack_pairs_2x32" in aligned  # two rows x 32 columns per call
    # guarded reads: the helper on the whole tiles (ragged_pack), scalar loops for the rest
    assert "tvmamp_pack_pairs_2x32" in padded.split("weight_prepack")[-1]
