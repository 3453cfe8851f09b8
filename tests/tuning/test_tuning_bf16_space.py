"""bf16 GEMM tasks are tuned in tvmamp's vdpbf16ps/AMX space: grouping, budget, the space."""

from __future__ import annotations

import pytest
import tvm
from tvm import relax, s_tir
from tvm.s_tir import TensorIntrin
from tvm.s_tir import meta_schedule as ms

import tvmamp
from tvmamp import models
from tvmamp.schedules.cpu import bf16_softmax
from tvmamp.schedules.cpu.bf16_tuning import (
    AMX_K_BLOCKS,
    AMX_N_BLOCKS,
    bf16_matmul_spaces,
    distinct_choices,
    gemm_extents,
    plan_key,
    space_version,
    tuning_choices,
)
from tvmamp.schedules.intrin_loader import only_target_intrinsics
from tvmamp.schedules.x86 import amx_intrin
from tvmamp.targets import DEFAULT_SPACE
from tvmamp.targets.llvm import BF16_SPACE
from tvmamp.tuning.callbacks import module_key
from tvmamp.tuning.grid_search import EnumerateSpaces, decision_of
from tvmamp.tuning.intrinsics import register_log_intrinsics
from tvmamp.tuning.loader import _stale_space
from tvmamp.tuning.tasks import Task, extract_tasks, split_budget

# sapphirerapids: avx512_bf16 and AMX-BF16; znver4: avx512_bf16 only; skylake-avx512: neither.
AMX = tvm.target.Target({"kind": "llvm", "mcpu": "sapphirerapids", "num-cores": 1})
VDPBF16PS = tvm.target.Target(
    {"kind": "llvm", "mcpu": "znver4", "mattr": ["-sse4a"], "num-cores": 1}
)
NO_BF16 = {"kind": "llvm", "mcpu": "skylake-avx512", "num-cores": 1}


def _gemm_func(m: int, k: int, n: int) -> tvm.tirx.PrimFunc:
    """The legalized PrimFunc of ``x[m, k] @ w[k, n]``, bf16 in, fp32 out."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((m, k), "bfloat16"))
    w = relax.Var("w", relax.TensorType((k, n), "bfloat16"))
    with bb.function("main", [x, w]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.matmul(x, w, out_dtype="float32"))
        bb.emit_func_output(out)
    mod = relax.transform.LegalizeOps()(bb.get())
    return next(f for _, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc))


def _spaces(func, target) -> list[s_tir.Schedule]:
    with only_target_intrinsics(("x86",)):
        ctx = ms.TuneContext(
            mod=tvm.IRModule({"main": func}),
            target=target,
            space_generator=bf16_matmul_spaces(target),
            search_strategy=EnumerateSpaces(),
        )
        return list(ctx.generate_design_space())


def test_bf16_matmul_tasks_get_the_bf16_space_and_others_keep_the_default():
    mod, params = models.simple_net(batch=64, hidden=128, layers=2, seed=1)
    tasks = extract_tasks(tvmamp.convert(mod, "O2", AMX, "bfloat16", params))
    spaces = {t.name: (t.space, t.space_size, t.space_generator) for t in tasks}
    gemms = [n for n in spaces if "matmul" in n]
    assert len(gemms) == 2 and len(spaces) > 2
    for name, (space, size, generator) in spaces.items():
        expected = f"{BF16_SPACE}:{space_version(AMX)}" if name in gemms else DEFAULT_SPACE.name
        assert space == expected, (name, space)
        assert (size is not None and size > 1) if name in gemms else size is None
        assert (generator is bf16_matmul_spaces) if name in gemms else generator is None
    # without avx512_bf16 the bf16 kernels are tuned in meta_schedule's generic space
    with pytest.warns(UserWarning, match="no avx512_bf16"):
        plain = extract_tasks(tvmamp.convert(mod, "O2", NO_BF16, "bfloat16", params))
    assert {t.space for t in plain} == {DEFAULT_SPACE.name}


def _merged_attention_func(rows: int, keys: int, dim: int, target) -> tvm.tirx.PrimFunc:
    """The merged scores-and-softmax kernel of ``softmax(q @ k^T * c) @ v`` at O2 bf16."""
    bb = relax.BlockBuilder()
    q = relax.Var("q", relax.TensorType((2, rows, dim), "float32"))
    k = relax.Var("k", relax.TensorType((2, keys, dim), "float32"))
    v = relax.Var("v", relax.TensorType((2, keys, dim), "float32"))
    with bb.function("main", [q, k, v]):
        with bb.dataflow():
            s = bb.emit(relax.op.matmul(q, relax.op.permute_dims(k, [0, 2, 1])))
            s = bb.emit(relax.op.multiply(s, relax.const(0.125, "float32")))
            p = bb.emit(relax.op.nn.softmax(s, axis=-1))
            out = bb.emit_output(relax.op.matmul(p, v))
        bb.emit_func_output(out)
    tasks = extract_tasks(tvmamp.convert(bb.get(), "O2", target, "bfloat16"))
    (task,) = [t for t in tasks if "softmax" in t.name and "matmul" in t.name]
    assert task.space == f"{BF16_SPACE}:{space_version(target)}"
    return task.mod["main"]


@pytest.mark.parametrize(
    "target, kernels", [(VDPBF16PS, {"vdpbf16ps": 6}), (AMX, {"amx": 1, "vdpbf16ps": 6})]
)
def test_merged_scores_and_softmax_are_tuned_in_the_bf16_space(target, kernels):
    """Attention's merged kernel gets the bf16 space (its tiles; on AMX hosts the AMX kernel,
    whose cache blocks it does not use, once), not meta_schedule's generic one."""
    func = _merged_attention_func(64, 64, 32, target)
    extents = gemm_extents(func)
    keys = [bf16_softmax.plan_key(extents, target, c)[0] for c in distinct_choices(func, target)]
    assert {kind: keys.count(kind) for kind in kernels} == kernels
    spaces = _spaces(func, target)
    assert len(spaces) == sum(kernels.values())
    intrins = {str(i.attrs[0]) for s in spaces for i in s.trace.insts if i.kind.name == "Tensorize"}
    assert any("dpbf16ps" in n for n in intrins)


def test_records_of_another_space_version_are_not_replayed():
    """A record holds the index of its configuration in :func:`tuning_choices`: one tuned when
    that list was another (its space name says so) would replay as another configuration."""
    mod, params = models.simple_net(batch=64, hidden=128, layers=1, seed=1)
    converted = tvmamp.convert(mod, "O2", AMX, "bfloat16", params)
    (gemm,) = [t for t in extract_tasks(converted) if "matmul" in t.name]
    assert _stale_space({"name": gemm.name, "space": gemm.space}, gemm.mod, converted) is None
    note = _stale_space({"name": gemm.name, "space": BF16_SPACE}, gemm.mod, converted)
    assert note.startswith(f"kept the default schedule of {gemm.name}") and gemm.space in note
    other = {"name": "x", "space": DEFAULT_SPACE.name}  # meta_schedule's own space: not checked
    assert _stale_space(other, gemm.mod, converted) is None
    assert space_version(AMX) != space_version(VDPBF16PS)  # AMX adds choices


def test_budget_beyond_a_space_goes_to_the_other_tasks():
    def task(name, flops, size=None):
        return Task(name, None, 1, flops, name, space_size=size)

    tasks = [task("gemm", 600.0, size=5), task("conv", 300.0), task("add", 100.0), task("cast", 0)]
    trials = {t.name: t.trials for t in split_budget(tasks, 40)}
    assert trials == {"gemm": 5, "conv": 26, "add": 9, "cast": 0}
    assert sum(trials.values()) == 40
    small = {t.name: t.trials for t in split_budget(tasks, 10)}
    assert small == {"gemm": 5, "conv": 4, "add": 1, "cast": 0}


def test_choices_hold_the_amx_blocks_only_where_amx_exists():
    amx, vdp = tuning_choices(AMX), tuning_choices(VDPBF16PS)
    base = type(amx[0])()
    assert amx[0] == base and vdp[0] == base  # the default schedule comes first
    blocks = {(c.amx_n_block, c.amx_k_block) for c in amx if c.amx}
    assert blocks == {(n, k) for n in AMX_N_BLOCKS for k in AMX_K_BLOCKS}
    assert {c.amx_min_rows for c in amx} == {base.amx_min_rows, 2}
    assert {c.amx_min_rows for c in vdp} == {base.amx_min_rows}
    assert {(c.amx_n_block, c.amx_k_block) for c in vdp} == {(base.amx_n_block, base.amx_k_block)}
    tiles = {(c.tile_i, c.vectors_j) for c in vdp if not c.amx}
    assert len(tiles) >= 5 and all(i * j <= 28 for i, j in tiles)
    assert len(set(map(repr, amx))) == len(amx)  # no duplicates


@pytest.mark.parametrize(
    ("shape", "target", "kernels"),
    [
        # K = 1024: every k_block gives one block; the automatic n_block is 512
        ((512, 1024, 1024), AMX, {"amx": 4, "vdpbf16ps": 6}),
        # 1, 2 or 4 K blocks, with 4 column blocks each (automatic: 512, 256, 128)
        ((257, 4096, 1024), AMX, {"amx": 12, "vdpbf16ps": 6}),
        ((64, 96, 80), AMX, {"amx": 1, "vdpbf16ps": 6}),  # J and K below every block
        ((16, 768, 3072), AMX, {"amx": 4, "vdpbf16ps": 6}),  # 8 rows or more: AMX by default
        # from 2 to 7 rows one choice tries AMX (rows padded to 32)
        ((6, 768, 3072), AMX, {"amx": 1, "vdpbf16ps": 4}),  # tiles of 6 rows and more: one
        ((2, 256, 512), AMX, {"amx": 1, "vdpbf16ps": 3}),
        ((1, 256, 512), AMX, {"vdpbf16ps": 3}),  # batch 1: no AMX, the GEMV tiles
        ((512, 1024, 1024), VDPBF16PS, {"vdpbf16ps": 6}),
    ],
)
def test_distinct_choices_give_distinct_kernels(shape, target, kernels):
    func = _gemm_func(*shape)
    extents = gemm_extents(func)
    keys = [plan_key(extents, target, c) for c in distinct_choices(func, target)]
    assert len(set(keys)) == len(keys)
    counts = {kind: [k[0] for k in keys].count(kind) for kind in ("amx", "vdpbf16ps")}
    assert counts == {"amx": 0, **kernels}


def test_space_yields_decided_schedules_that_replay_from_json():
    func = _gemm_func(64, 96, 80)
    spaces = _spaces(func, AMX)
    assert len(spaces) == len(distinct_choices(func, AMX)) == 7
    assert len({module_key(s.mod) for s in spaces}) == len(spaces)
    for index, space in enumerate(spaces):
        insts = {i.kind.name: i for i in space.trace.insts}
        assert int(space.trace.decisions[insts["SampleCategorical"]]) == index
        intrin = str(insts["Tensorize"].attrs[0])
        assert intrin.startswith("tvmamp_x86_amx" if index == 0 else "tvmamp_x86_dpbf16ps")
        # what a tuning log stores and a build replays: the trace as JSON
        replayed = s_tir.Schedule(tvm.IRModule({"main": func}))
        s_tir.Trace.apply_json_to_schedule(space.trace.as_json(), replayed)
        tvm.ir.assert_structural_equal(replayed.mod, space.mod)


def test_a_decided_space_builds_with_vdpbf16ps():
    func = _gemm_func(48, 64, 64)
    space = _spaces(func, VDPBF16PS)[1]
    # as meta_schedule's builder does: the weight packing becomes the caller's job
    mod = tvm.s_tir.transform.RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(space.mod)
    mod = tvm.IRModule({"main": mod["main"].with_attr("global_symbol", "main")})
    built = tvm.compile(mod, target=VDPBF16PS)
    mods = [built.mod, *built.mod.imports]
    assert "vdpbf16ps" in "".join(m.inspect_source("asm") for m in mods if m.kind == "llvm")


def test_a_gemm_of_fewer_than_8_rows_has_an_amx_space_that_builds():
    """AMX pads the 6 rows to 32; vdpbf16ps runs at half the fp32 FMA rate on Intel cores."""
    spaces = _spaces(_gemm_func(6, 96, 80), AMX)
    intrins = [
        str(next(i for i in s.trace.insts if i.kind.name == "Tensorize").attrs[0]) for s in spaces
    ]
    assert intrins[0].startswith("tvmamp_x86_dpbf16ps")  # the default: vdpbf16ps
    (amx,) = [
        s for s, name in zip(spaces, intrins, strict=True) if name.startswith("tvmamp_x86_amx")
    ]
    built = tvm.compile(
        tvm.IRModule({"main": amx.mod["main"].with_attr("global_symbol", "main")}), target=AMX
    )
    mods = [built.mod, *built.mod.imports]
    assert "tdpbf16ps" in "".join(m.inspect_source("asm") for m in mods if m.kind == "llvm")


def test_enumeration_measures_each_space_once_and_skips_measured_ones():
    spaces = _spaces(_gemm_func(64, 96, 80), AMX)
    done = {2}  # the decision an earlier run measured
    strategy = EnumerateSpaces(done)
    strategy.pre_tuning(5, 2, spaces, None, None)
    batches = []
    while (batch := strategy.generate_measure_candidates()) is not None:
        batches.append([decision_of(c.sch.trace) for c in batch])
        strategy.notify_runner_results(batch, [])
    assert batches == [[0, 1], [3, 4], [5]]
    assert done == {0, 1, 2, 3, 4, 5}  # shared: a second round proposes only the rest
    strategy.pre_tuning(5, 2, spaces, None, None)
    assert [decision_of(c.sch.trace) for c in strategy.generate_measure_candidates()] == [6]


def test_log_intrinsics_are_registered_before_replay(tmp_path):
    name = amx_intrin.amx_intrin(64, "global")  # the name pattern the log scan looks for
    assert amx_intrin.NAME_PATTERN.fullmatch(name)
    k = 32 * 77  # a reduction length nothing registered yet
    fresh = [name.replace("32x32x64_global", f"32x{cols}x{k}_local") for cols in (32, 96)]
    assert all(TensorIntrin.get(f, allow_missing=True) is None for f in fresh)
    traces = ", ".join(f'[["Tensorize", ["{f}"]]]' for f in fresh)
    (tmp_path / "database_tuning_record.json").write_text(f"[0, [{traces}]]\n")
    register_log_intrinsics(str(tmp_path))
    assert all(TensorIntrin.get(f, allow_missing=True) is not None for f in fresh)


def _head_split_attention() -> relax.Function:
    """Attention on heads split from one ``qkv[tokens, batch, 3 * heads * dim]`` tensor, as
    torch's ``nn.MultiheadAttention`` splits them (2 heads of 32, 32 tokens, batch 2)."""
    bb = relax.BlockBuilder()
    qkv = relax.Var("qkv", relax.TensorType((32, 2, 192), "float32"))
    with bb.function("main", [qkv]):
        with bb.dataflow():
            x = bb.emit(relax.op.reshape(qkv, (32, 2, 3, 2, 32)))
            x = bb.emit(relax.op.permute_dims(x, [2, 1, 3, 0, 4]))
            q, k, v = (
                bb.emit(relax.op.squeeze(relax.op.strided_slice(x, [0], [i], [i + 1]), [0]))
                for i in range(3)
            )
            s = bb.emit(relax.op.matmul(q, relax.op.permute_dims(k, [0, 1, 3, 2])))
            p = bb.emit(relax.op.nn.softmax(relax.op.multiply(s, relax.const(0.125)), axis=-1))
            # an epilogue, so that P @ V is a fused function (a bare call is not merged into)
            out = bb.emit_output(relax.op.multiply(relax.op.matmul(p, v), relax.const(2.0)))
        bb.emit_func_output(out)
    return bb.get()


def test_a_kernel_packing_through_layout_ops_is_measured_with_its_packing_split_out():
    """TVM's RemoveWeightLayoutRewriteBlock aborts on a packing that reads ``qkv[s, b, h * 32 +
    d + 64]`` (relay_passes/gemm_layout.py merges such reads into the GEMM kernels): the
    measured kernel gets its packing split out first, as for a padded weight."""
    from tvmamp.tuning.packed_weights import for_measuring, measured_args

    tasks = extract_tasks(tvmamp.convert(_head_split_attention(), "O2", VDPBF16PS, "bfloat16"))
    gathered = [t for t in tasks if t.name.endswith("_gather_b")]
    assert len(gathered) == 2, [t.name for t in tasks]
    for task in gathered:
        space = _spaces(task.mod["main"], VDPBF16PS)[0]
        assert not for_measuring(space.mod).same_as(space.mod)
        assert measured_args(space.mod)  # aborted in TVM before
