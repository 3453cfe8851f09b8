"""search_precision and PrecisionPlan: budgets, plans applied exactly, and the edge cases."""

import json

import numpy as np
import pytest

import tvmamp
from tvmamp import models
from tvmamp.benchmark import max_rel_error
from tvmamp.search import ErrorBudget, PrecisionPlan, model_hash

TARGET = "llvm -num-cores=1"


@pytest.fixture(scope="module")
def overflow_case():
    """The model plain fp16 O2 breaks, calibration data, and a searched plan."""
    mod, params = models.overflow_net(batch=4, dim=32)
    rng = np.random.default_rng(7)
    calib = [rng.standard_normal((4, 32)).astype("float32") for _ in range(6)]
    plan = tvmamp.search_precision(
        mod,
        calib,
        TARGET,
        "float16",
        ErrorBudget(5e-3),
        params,
        progress=False,
        measure_latency=False,  # so small a model runs fastest in fp32: test the accuracy search
    )
    return mod, params, calib, plan


def test_search_fixes_the_model_o2_breaks(overflow_case):
    mod, params, calib, plan = overflow_case
    reference = tvmamp.build(mod, "O0", TARGET, params=params)
    o2 = tvmamp.build(mod, "O2", TARGET, dtype="float16", params=params)
    assert not np.isfinite(o2(calib[0])).all()  # O2 is broken (NaN/inf)
    exe = tvmamp.build(mod, target=TARGET, params=params, plan=plan)
    for x in calib:  # the budget is normwise (ErrorBudget: max|amp - fp32| / max|fp32|)
        assert max_rel_error(exe(x), reference(x)) <= 5e-3
    assert plan.metrics["met_budget"] and plan.metrics["calibration_error"] <= 5e-3
    assert "holdout_error" in plan.metrics
    assert 0 < len(plan.fp32_nodes) < len(plan.node_dtypes)
    assert all("relax.multiply" in plan.reasons[n] for n in plan.fp32_nodes)
    assert {n.node: n.dtype for n in exe.stats.nodes} == {
        k: ("float32" if v == "float32" else "float16") for k, v in plan.node_dtypes.items()
    }


def test_plan_round_trips_through_json(overflow_case, tmp_path):
    mod, params, calib, plan = overflow_case
    path = tmp_path / "plan.json"
    plan.save(path)
    loaded = PrecisionPlan.load(path)
    assert loaded == plan
    assert "kept fp32" in loaded.summary()
    data = json.loads(path.read_text())
    assert data["format"] == "tvmamp.precision_plan" and data["version"] == 1
    data["version"] = 99
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="plan version 99"):
        PrecisionPlan.load(path)
    path.write_text("{not json")
    with pytest.raises(ValueError, match="is not JSON"):
        PrecisionPlan.load(path)


def test_plan_for_another_model_is_refused(overflow_case):
    _, _, _, plan = overflow_case
    other, params = models.simple_net(batch=4, hidden=32, layers=2)
    assert model_hash(other) != plan.model_hash
    with pytest.raises(ValueError, match="was made for model"):
        tvmamp.build(other, target=TARGET, params=params, plan=plan)


def test_plan_contradictions_are_refused(overflow_case):
    mod, params, _, plan = overflow_case
    with pytest.raises(ValueError, match="contradicts the plan's level"):
        tvmamp.build(mod, "O1", TARGET, params=params, plan=plan)
    with pytest.raises(ValueError, match="contradicts the plan's dtype"):
        tvmamp.build(mod, target=TARGET, dtype="bfloat16", params=params, plan=plan)


def test_an_impossible_budget_returns_the_fp32_plan_and_says_so():
    mod, params = models.overflow_net(batch=2, dim=16)
    calib = [np.random.default_rng(1).standard_normal((2, 16)).astype("float32")]
    with pytest.warns(UserWarning, match="returning the fp32 plan"):
        plan = tvmamp.search_precision(
            mod, calib, TARGET, "float16", ErrorBudget(0.0), params, holdout=0, progress=False
        )
    assert all(d == "float32" for d in plan.node_dtypes.values())
    assert plan.metrics["notes"]


def test_the_time_limit_is_respected():
    mod, params = models.overflow_net(batch=2, dim=16)
    calib = [np.random.default_rng(2).standard_normal((2, 16)).astype("float32")] * 2
    with pytest.warns(UserWarning, match="before the time limit"):
        plan = tvmamp.search_precision(
            mod, calib, TARGET, "float16", ErrorBudget(1e-3), params, time_limit_s=0, progress=False
        )
    assert plan.metrics["builds"] <= 2  # the starting plan, then the fp32 plan: no search


def test_the_fastest_plan_that_meets_the_budget_wins():
    """Within budget, the searched plan is timed against O1, O2 and fp32 and the fastest wins."""
    mod, params = models.simple_net(batch=2, hidden=32, layers=2)
    calib = [np.random.default_rng(3).standard_normal((2, 32)).astype("float32")] * 2
    plan = tvmamp.search_precision(
        mod, calib, TARGET, "bfloat16", ErrorBudget(5e-2), params, progress=False
    )
    compared = plan.metrics["compared_ms"]
    assert {"searched", "O1", "O2", "fp32"} <= set(compared)
    winner = plan.metrics["chosen"]
    assert compared[winner] * (1 - 0.03) <= min(compared.values())  # fastest, up to the margin
    o3 = tvmamp.convert(mod, "O3", TARGET, "bfloat16", params).report.nodes
    low = {n.node for n in o3 if n.dtype != "float32"}
    if winner == "searched":
        assert plan.fp32_nodes == []
    elif winner == "fp32":
        assert set(plan.fp32_nodes) >= low
    else:
        level = tvmamp.convert(mod, winner, TARGET, "bfloat16", params).report.nodes
        assert plan.node_dtypes == {
            n.node: "float32" if n.dtype == "float32" else "low" for n in level
        }


def test_node_calls_match_the_pass_node_ids():
    """speed.node_calls numbers bindings as the AMP pass does, repeated names included."""
    from tvmamp.conversion import bind_params
    from tvmamp.search.speed import node_calls, op_latencies

    mod, params = models.transformer_layer(batch=2, seq=8, dim=32, heads=4)
    report = tvmamp.convert(mod, "O3", TARGET, "bfloat16", params).report
    calls = node_calls(bind_params(mod, params)[0])
    assert report.nodes and all(calls[n.node].op.name == n.op for n in report.nodes)
    cache = {}
    matmuls = [calls[n.node] for n in report.nodes if n.op == "relax.matmul"]
    times = [op_latencies(c, TARGET, "bfloat16", cache) for c in matmuls[:2]]
    assert all(t32 > 0 and tlow > 0 for t32, tlow in times)
    assert len(cache) <= 2 and times[0] is not None


def test_top1_and_callable_budgets():
    ref = [np.array([[0.1, 0.9], [0.8, 0.2]])]
    assert ErrorBudget(0.0, "top1").measure(ref, [np.array([[0.2, 0.7], [0.6, 0.5]])]) == 0.0
    assert ErrorBudget(0.0, "top1").measure(ref, [np.array([[0.9, 0.1], [0.6, 0.5]])]) == 0.5

    def worst_abs(a, b):
        return max(float(np.abs(x - y).max()) for x, y in zip(a, b))

    assert ErrorBudget(0.1, worst_abs).measure(ref, [ref[0] + 0.05]) == pytest.approx(0.05)
    assert ErrorBudget().measure(ref, [ref[0] * np.nan]) == float("inf")


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(max_rel_err=-1), "must be a number >= 0"),
        (dict(metric="mse"), "metric 'mse' is not one of output, top1"),
    ],
)
def test_bad_budgets(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ErrorBudget(**kwargs)


def test_bad_search_arguments():
    mod, params = models.simple_net(batch=2, hidden=32, layers=2)
    x = np.ones((2, 32), "float32")
    with pytest.raises(TypeError, match="not a single array"):
        tvmamp.search_precision(mod, x, TARGET, params=params)
    with pytest.raises(ValueError, match="calib_inputs is empty"):
        tvmamp.search_precision(mod, [], TARGET, params=params)
    with pytest.raises(ValueError, match="start_level 'O0'"):
        tvmamp.search_precision(mod, [x], TARGET, params=params, start_level="O0")
    with pytest.raises(TypeError, match="budget must be an ErrorBudget"):
        tvmamp.search_precision(mod, [x], TARGET, params=params, budget=0.01)


def test_cli_search_then_compile_with_the_plan(tmp_path, capsys):
    from tvmamp.cli import main

    rng = np.random.default_rng(5)
    calib, plan_path = tmp_path / "calib.npz", tmp_path / "plan.json"
    np.savez(calib, x=rng.standard_normal((4, 8, 64)).astype("float32"))
    assert (
        main(
            [
                "search",
                "overflow",
                "--inputs",
                str(calib),
                "--dtype",
                "float16",
                "--target",
                TARGET,
                "--budget",
                "5e-3",
                "-o",
                str(plan_path),
            ]
        )
        == 0
    )
    assert "kept fp32" in capsys.readouterr().out
    plan = PrecisionPlan.load(plan_path)
    assert plan.fp32_nodes and plan.metrics["met_budget"]
    lib = tmp_path / "m.so"
    assert (
        main(["compile", "overflow", "--plan", str(plan_path), "--target", TARGET, "-o", str(lib)])
        == 0
    )
    assert lib.exists()
    assert (
        main(["compile", "overflow", "--plan", str(plan_path), "--level", "O1", "-o", str(lib)])
        == 2
    )
    assert "contradicts the plan's level" in capsys.readouterr().err
    auto = ["compile", "overflow", "--level", "auto-search", "--target", TARGET, "-o", str(lib)]
    assert main(auto) == 2
    assert "needs --inputs" in capsys.readouterr().err
    lib.unlink()
    assert main([*auto, "--inputs", str(calib), "--dtype", "float16", "--budget", "5e-3"]) == 0
    assert lib.exists()


def test_build_auto_search_level(overflow_case):
    """level="auto-search" searches on calib_inputs and builds the plan (exe.plan)."""
    mod, params, calib, _ = overflow_case
    exe = tvmamp.build(
        mod,
        "auto-search",
        TARGET,
        "float16",
        params,
        calib_inputs=calib,
        budget=ErrorBudget(5e-3),
    )
    assert exe.plan is not None and exe.plan.metrics["met_budget"]
    assert {n.node: n.dtype for n in exe.stats.nodes} == {
        k: ("float32" if v == "float32" else "float16") for k, v in exe.plan.node_dtypes.items()
    }
    reference = tvmamp.build(mod, "O0", TARGET, params=params)
    assert max_rel_error(exe(calib[0]), reference(calib[0])) <= 5e-3  # the (normwise) budget


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(level="auto-search"), "needs calib_inputs="),
        (dict(level="O2", calib_inputs=[np.ones((4, 32), "float32")]), "only used with level"),
        (dict(level="auto-searh"), "is not one of O0, .* or auto-search"),
    ],
)
def test_auto_search_argument_errors(overflow_case, kwargs, match):
    mod, params, _, plan = overflow_case
    with pytest.raises(ValueError, match=match):
        tvmamp.build(mod, target=TARGET, params=params, **kwargs)
    if kwargs["level"] == "auto-search":
        with pytest.raises(ValueError, match="do not pass plan="):
            tvmamp.build(mod, "auto-search", TARGET, params=params, plan=plan, calib_inputs=[])
