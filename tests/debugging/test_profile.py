"""The per-kernel profile: FLOPs from the TIR, the profile of a built model, the CLI."""

import json

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import tirx as T

import tvmamp
from tvmamp import cli, debugging, models
from tvmamp.debugging.costs import func_cost, kernel_costs
from tvmamp.targets import resolve_target

# Rates no kernel reaches / every kernel exceeds: flag everything / nothing.
HUGE = debugging.Peaks(gflops=1e9, gbs=1e9, threads=1, source="test")
TINY = debugging.Peaks(gflops=1e-9, gbs=1e-9, threads=1, source="test")


@T.prim_func(s_tir=True)
def matmul(a: T.handle, b: T.handle, c: T.handle):
    n = T.int64()
    A = T.match_buffer(a, (n, T.int64(24)), "float32")
    B = T.match_buffer(b, (T.int64(24), T.int64(10)), "float32")
    C = T.match_buffer(c, (n, T.int64(10)), "float32")
    for i, j, k in T.grid(n, T.int64(10), T.int64(24)):
        with T.sblock("C"):
            vi, vj, vk = T.axis.remap("SSR", [i, j, k])
            with T.init():
                C[vi, vj] = T.float32(0)
            C[vi, vj] = C[vi, vj] + A[vi, vk] * B[vk, vj]


@T.prim_func(s_tir=True)
def gelu_like(a: T.Buffer((7, 9), "bfloat16"), out: T.Buffer((7, 9), "float32")):
    for i, j in T.grid(7, 9):
        with T.sblock("out"):
            vi, vj = T.axis.remap("SS", [i, j])
            out[vi, vj] = T.max(
                T.tanh(T.Cast("float32", a[vi, vj])) * T.Cast("float32", a[vi, vj]) + T.float32(1),
                T.float32(0),
            )


@T.prim_func(s_tir=True)
def repeated_term(a: T.Buffer((5, 8), "float32"), out: T.Buffer((5, 8), "float32")):
    for i, j in T.grid(5, 8):
        with T.sblock("out"):
            vi, vj = T.axis.remap("SS", [i, j])
            out[vi, vj] = (a[vi, vj] * T.float32(2) + T.float32(1)) * (
                a[vi, vj] * T.float32(2) + T.float32(1)
            ) + (a[vi, vj] * T.float32(2) + T.float32(1))


def test_matmul_flops_are_two_m_n_k_once_the_shape_is_bound():
    cost = func_cost("matmul", matmul)
    assert cost.flops is None  # n is symbolic until a call binds it
    args = [np.zeros((13, 24)), np.zeros((24, 10)), np.zeros((13, 10))]
    assert cost.flops_for(args) == 2 * 13 * 10 * 24


@T.prim_func(s_tir=True)
def scaled_rows(a: T.handle, n: T.int64, out: T.handle):
    A = T.match_buffer(a, (n, T.int64(6)), "float32")
    Out = T.match_buffer(out, (n, T.int64(6)), "float32")
    for i, j in T.grid(n, T.int64(6)):
        with T.sblock("out"):
            vi, vj = T.axis.remap("SS", [i, j])
            Out[vi, vj] = A[vi, vj] * T.float32(3)


def test_a_scalar_parameter_is_bound_from_the_call():
    """A kernel with a scalar parameter (a shape value passed in, as the index check of
    ``relay_passes/take_bounds.py`` has) is costed, not rejected."""
    cost = func_cost("scaled_rows", scaled_rows)
    assert cost.flops_for([np.zeros((5, 6)), 5, np.zeros((5, 6))]) == 5 * 6


def test_elementwise_flops_count_arithmetic_and_math_calls_not_casts():
    assert func_cost("gelu_like", gelu_like).flops == 7 * 9 * 4  # tanh, *, +, max


def test_a_repeated_subexpression_counts_once():
    """``t * t + t`` with ``t = 2a + 1``: 4 FLOPs, as compiled (TE inlining repeats ``t``)."""
    assert func_cost("repeated_term", repeated_term).flops == 5 * 8 * 4


@pytest.mark.parametrize("groups,stride", [(1, 1), (3, 2)])
def test_legalized_conv2d_flops_are_the_exact_formula(groups, stride):
    n, c, h, w, oc, k = 2, 6, 11, 9, 12, 3
    x = relax.Var("x", relax.TensorType((n, c, h, w), "float32"))
    wt = relax.Var("w", relax.TensorType((oc, c // groups, k, k), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, wt]):
        y = bb.emit(relax.op.nn.conv2d(x, wt, strides=stride, padding=1, groups=groups))
        bb.emit_func_output(y)
    costs = kernel_costs(relax.transform.LegalizeOps()(bb.get()))
    (cost,) = costs.values()
    oh, ow = (h + 2 - k) // stride + 1, (w + 2 - k) // stride + 1
    assert cost.flops == 2 * n * oc * oh * ow * (c // groups) * k * k  # padding adds none


# convnet's first conv (3 -> 16 channels, 3x3, 16x16) with its fused epilogue: the batch norm
# folded into a bias add (FoldBatchNorm), then ReLU, one FLOP each per output
CONV_FLOPS = 2 * 16 * 16 * 16 * 3 * 3 * 3 + 2 * 16 * 16 * 16


def _first_conv(records):
    """The first conv of convnet (found by its input, whatever the schedules named it)."""
    (conv,) = [r for r in records if r.shapes[:1] == [[1, 3, 16, 16]] and r.flops]
    return conv


@pytest.fixture(scope="module")
def convnet_o0():
    mod, params = models.get_model("convnet")
    with debugging.kernel_cost_recording() as costs:
        exe = tvmamp.build(mod, "O0", params=params)
    return exe, costs, models.example_inputs(mod)


def test_profile_lists_every_kernel_with_shares_summing_to_one(convnet_o0):
    exe, costs, inputs = convnet_o0
    prof = debugging.profile(exe, inputs, costs=costs, peaks=HUGE)
    kernels = {r.name for r in prof.records if r.shapes}
    assert kernels == set(costs.scheduled)  # every PrimFunc of the final module, no more
    assert sum(r.share for r in prof.records) == pytest.approx(1.0)
    assert [r.ms for r in prof.records] == sorted((r.ms for r in prof.records), reverse=True)
    assert all(r.calls == 1 for r in prof.records)  # batch norms folded: no kernel of their own
    conv = _first_conv(prof.records)  # 3 -> 16 channels, 3x3, on 16x16
    assert conv.flops == CONV_FLOPS
    assert conv.shapes[-1] == [1, 16, 16, 16]
    assert conv.bytes == 4 * sum(int(np.prod(s)) for s in conv.shapes)
    rated = [r for r in prof.records if r.efficiency is not None]
    assert rated and all(r.flagged for r in rated)
    assert not debugging.profile(exe, inputs, costs=costs, peaks=TINY, rounds=1).flagged


def test_profile_classes_kernels_by_the_machines_balance(convnet_o0):
    exe, costs, inputs = convnet_o0
    # Balance 1e6 FLOP/byte: every kernel is memory-bound; 1e-6: those with FLOPs compute-bound.
    mem = debugging.Peaks(gflops=1e6, gbs=1.0, threads=1, source="test")
    flop = debugging.Peaks(gflops=1.0, gbs=1e6, threads=1, source="test")
    by_mem = _first_conv(debugging.profile(exe, inputs, costs=costs, peaks=mem).records)
    by_flop = _first_conv(debugging.profile(exe, inputs, costs=costs, peaks=flop).records)
    assert by_mem.bound == "memory" and by_flop.bound == "compute"
    assert by_mem.efficiency == pytest.approx(by_mem.gbs / 1.0)
    assert by_flop.efficiency == pytest.approx(by_flop.gflops / 1.0)


def test_profile_without_recorded_costs_counts_the_kernels_again(convnet_o0):
    exe, costs, inputs = convnet_o0
    prof = debugging.profile(exe, inputs, peaks=HUGE, rounds=1)
    recorded = debugging.profile(exe, inputs, costs=costs, peaks=HUGE, rounds=1).records
    assert {r.name: r.flops for r in prof.records if r.shapes} == {
        r.name: r.flops for r in recorded if r.shapes
    }
    assert _first_conv(prof.records).flops == CONV_FLOPS


def test_profile_json_round_trips(convnet_o0):
    exe, costs, inputs = convnet_o0
    prof = debugging.profile(exe, inputs, costs=costs, peaks=HUGE, rounds=1)
    data = json.loads(json.dumps(prof.as_dict()))
    assert len(data["kernels"]) == len(prof.records)
    assert data["peaks"]["source"] == "test"
    assert _first_conv(prof.records).name in prof.table()


def test_profile_rejects_bad_arguments(convnet_o0):
    exe, _, inputs = convnet_o0
    with pytest.raises(ValueError, match="rounds 0 is not a positive integer"):
        debugging.profile(exe, inputs, rounds=0, peaks=HUGE)
    with pytest.raises(ValueError, match="threshold 2 is not a fraction"):
        debugging.profile(exe, inputs, threshold=2, peaks=HUGE)
    with pytest.raises(TypeError, match="expected a tvmamp Executable, got IRModule"):
        debugging.profile(exe.mod, inputs, peaks=HUGE)


def test_measured_peaks_are_positive_and_measured_once():
    target = resolve_target("llvm")[0]
    peaks = debugging.measure_peaks(target, 1)
    assert peaks.gflops > 1 and peaks.gbs > 0.1 and peaks.threads == 1
    assert "measured" in peaks.describe()
    assert debugging.measure_peaks(target, 1) is peaks
    with pytest.raises(ValueError, match="CPU targets only, not .*cuda"):
        debugging.measure_peaks(tvm.target.Target({"kind": "cuda", "arch": "sm_80"}))


def test_peak_kernels_keep_their_accumulators_off_the_heap():
    """The FMA peak's parallel loop holds 16 vector accumulators. Compiled with TVM's default
    TIR pipeline they went to a TVMBackendAllocWorkspace buffer, and the two-thread FMA peak
    came out at 269 instead of 539 GFLOP/s (so every kernel's "% of peak" was doubled)."""
    from tvmamp.debugging import peaks

    target = resolve_target("llvm -num-cores=2")[0]
    lib = peaks._build(peaks._fma_func(2, 16, 8), target)
    source = lib.inspect_source("ll")
    assert "define" in source and "TVMBackendAllocWorkspace" not in source


def test_bf16_kernels_get_the_bf16_compute_peak_where_the_cpu_has_it():
    peaks = debugging.Peaks(100.0, 10.0, 1, "test", {"bfloat16": (2, "vdpbf16ps")})
    assert peaks.compute_peak("bfloat16") == 200.0
    assert peaks.compute_peak("float32") == peaks.compute_peak("float16") == 100.0


@pytest.mark.parametrize("mcpu,factor", [("sapphirerapids", 16), ("znver4", 2), ("skylake", None)])
def test_the_bf16_peak_factor_follows_the_cpus_dot_product(mcpu, factor):
    """AMX does 512 bf16 multiply-adds per cycle (2900 GFLOP/s against 176 for fp32 FMA on an
    Emerald Rapids core); a factor of 32 halved every AMX kernel's "% of peak"."""
    from tvmamp.debugging import peaks
    from tvmamp.targets.cpu_features import target_cpu_features

    target = resolve_target(f"llvm -mcpu={mcpu}")[0]
    low = peaks.low_peak_factors(set(target_cpu_features(target)))
    assert low.get("bfloat16", (None,))[0] == factor


def test_cli_profiles_a_builtin_model(capsys):
    assert cli.main(["profile", "convnet", "--level", "O0", "--json", "--rounds", "1"]) == 0
    captured = capsys.readouterr()
    data = json.loads(captured.out)
    assert data["level"] == "O0" and data["model"] == "convnet"
    assert CONV_FLOPS in [k["flops"] for k in data["kernels"]]
    assert sum(k["share"] for k in data["kernels"]) == pytest.approx(1.0)
    assert "[profile 2/4] building at O0" in captured.err
    assert cli.main(["profile", "convnet", "--level", "O0", "--rounds", "1"]) == 0
    assert "% peak" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv,message",
    [
        (["convnet", "--level", "O5"], "level 'O5' is not one of O0, O1, O2, O3, OD, auto"),
        (["nosuch"], "cannot load model 'nosuch': give a built-in model (convnet"),
        (["convnet", "--threads", "0"], "--threads 0 is not between 1 and"),
        (["convnet", "--target", "cuda"], "target 'cuda' is not supported"),
    ],
)
def test_cli_names_the_bad_value(argv, message, capsys):
    assert cli.main(["profile", *argv]) == 2
    assert message in capsys.readouterr().err


def test_cli_refuses_a_thread_count_the_running_pool_cannot_take(capsys, monkeypatch):
    running = tvm.runtime.num_threads()
    monkeypatch.setenv("TVM_NUM_THREADS", str(running))  # restored after the test
    other = running + 1
    assert cli.main(["profile", "convnet", "--threads", str(other)]) == 2
    assert f"--threads {other} cannot apply" in capsys.readouterr().err


def test_profile_of_a_decoder_step_lists_kernels_not_its_relax_functions(rng):
    """A decoder built over a symbolic query length calls its one-query step, a Relax function
    (``relay_passes/decode_step.py``), through an ``If``: the VM calls those functions too,
    and their time, their kernels' again, was listed as two more kernels (three times the
    model's time in all)."""
    s, p = (tvm.tirx.Var(name, "int64") for name in "sp")
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, s, 2, 16), "float32"))
    past = relax.Var("past", relax.TensorType((1, p, 2, 16), "float32"))
    with bb.function("main", [x, past]):
        with bb.dataflow():
            present = bb.emit(relax.op.concat([past, x], axis=1))
            out = bb.emit_output(relax.op.nn.attention(x, present, present))
        bb.emit_func_output(out)
    with debugging.kernel_cost_recording() as costs:
        exe = tvmamp.build(bb.get(), "O0", "llvm -num-cores=1")
    inputs = [rng.standard_normal((1, n, 2, 16)).astype("float32") for n in (1, 9)]
    prof = debugging.profile(exe, inputs, costs=costs, peaks=HUGE, rounds=1)
    names = {r.name for r in prof.records}
    assert not any(name.startswith("main") for name in names)
    assert {r.name for r in prof.records if r.shapes} <= set(costs.scheduled)
