"""search_precision: the fastest per-node precision plan whose error stays within a budget.

The search, with few builds:

1. Convert at the most aggressive level (``start_level``, O3 by default) and measure the error
   on the calibration inputs.
2. If it misses the budget, attribute the error to nodes once: per-op errors and out-of-range
   counts from ``tvmamp.debugging.compare_accuracy`` on a calibration input, corrected for
   error that only flows through a node (``attribution.rank_candidates``). Cheap ops rank before
   GEMM-like ones, whose low precision buys the most speed.
3. Return the top-k ranked nodes to fp32 for k = 1, 2, 4, ... until the budget is met, then
   bisect for the smallest such k, and try to put each GEMM-like node of that prefix back low.
4. Speed (:mod:`.speed`): matmuls whose low kernel, compiled alone, is slower than
   fp32 are candidates to go back to fp32; that plan, the O1 and O2 assignments and the fp32
   plan are checked against the budget, and those that meet it are timed in one interleaved run
   with the searched plan. The fastest is the answer, so the plan is never slower than a level
   that meets the budget (within the noise of one measurement).
5. Check the plan on held-out inputs; warn when their error exceeds the budget.

If no mixed plan meets the budget, or time runs out first, the fp32 plan is returned and says so.
"""

from __future__ import annotations

import time
import warnings

import numpy as np

from tvmamp.benchmark import median_latency_ms
from tvmamp.build import as_module, build, convert

from . import speed
from .attribution import rank_candidates
from .budget import ErrorBudget
from .plan import PrecisionPlan, model_hash


def _samples(calib_inputs) -> list[tuple]:
    """Normalise calibration data to a list of input tuples."""
    if isinstance(calib_inputs, np.ndarray):
        raise TypeError(
            "tvmamp.search_precision: calib_inputs must be a list of samples (each an array or a "
            "tuple of arrays, one per model input), not a single array"
        )
    samples = [tuple(s) if isinstance(s, (tuple, list)) else (s,) for s in calib_inputs]
    if not samples:
        raise ValueError("tvmamp.search_precision: calib_inputs is empty")
    return samples


def _split(samples, holdout: float):
    if not 0 <= holdout < 1:
        raise ValueError(f"tvmamp.search_precision: holdout {holdout!r} must be in [0, 1)")
    n_hold = int(round(len(samples) * holdout)) if len(samples) > 1 else 0
    n_hold = min(max(n_hold, 1 if holdout > 0 and len(samples) > 1 else 0), len(samples) - 1)
    return samples[: len(samples) - n_hold], samples[len(samples) - n_hold :]


class _Search:
    """State of one search: the reference outputs, the budget and the clock."""

    def __init__(self, mod, params, target, dtype, level, budget, calib, time_limit_s, progress):
        self.mod, self.params, self.target, self.level = mod, params, target, level
        self.budget, self.calib, self.deadline = budget, calib, time.monotonic() + time_limit_s
        self.reference = build(mod, "O0", target, params=params)
        self.ref_out = [self.reference(*s) for s in calib]
        self.base = convert(mod, level, target, dtype, params)
        self.dtype = self.base.policy.low_dtype
        self.nodes = list(self.base.report.nodes)
        self.builds = 0
        self.bar = _progress_bar(progress)
        self._tried: dict = {}
        self.op_times: dict = {}  # single-op latencies, shared by identical layers
        self.latencies: dict = {}  # the whole-model plans compared in step 4, in ms
        self.chosen = None  # the name of the plan step 4 chose

    def out_of_time(self) -> bool:
        return time.monotonic() > self.deadline

    def plan_dtypes(self, fp32: set) -> dict:
        return {
            n.node: "float32" if n.node in fp32 or n.dtype == "float32" else "low"
            for n in self.nodes
        }

    def evaluate(self, fp32: set):
        """Build with the ``fp32`` nodes in fp32; (error on the calibration inputs, executable)."""
        key = frozenset(fp32)
        if key not in self._tried:
            exe = build(
                self.mod,
                self.level,
                self.target,
                self.dtype,
                self.params,
                node_dtypes=self.plan_dtypes(fp32),
            )
            self.builds += 1
            error = self.budget.measure(self.ref_out, [exe(*s) for s in self.calib])
            self._tried[key] = (error, exe)
            self.bar.update(1)
            self.bar.set_postfix(fp32_nodes=len(fp32), error=f"{error:.2e}")
        return self._tried[key]


def _progress_bar(enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(desc="precision search", unit="plan", disable=not enabled, leave=False)


def _smallest_prefix(search: _Search, ranked: list) -> tuple[int | None, float]:
    """Smallest k such that the top-k ranked nodes in fp32 meet the budget (None if none).

    Doubles k from 1 until the budget is met, then bisects between the last failing k and it.
    """
    lo, hi, hi_err = 0, None, float("inf")  # lo: the largest k known to miss the budget
    while hi is None and lo < len(ranked) and not search.out_of_time():
        k = min(2 * lo, len(ranked)) if lo else 1
        error, _ = search.evaluate({c.node for c in ranked[:k]})
        if search.budget.met(error):
            hi, hi_err = k, error
        else:
            lo = k
    while hi is not None and hi - lo > 1 and not search.out_of_time():
        mid = (lo + hi) // 2
        error, _ = search.evaluate({c.node for c in ranked[:mid]})
        if search.budget.met(error):
            hi, hi_err = mid, error
        else:
            lo = mid
    return hi, hi_err


def _restore_expensive(search: _Search, chosen: list, error: float) -> tuple[list, float]:
    """Put GEMM-like nodes of ``chosen`` back to low where the budget allows."""
    for cand in [c for c in chosen if c.expensive]:
        if search.out_of_time():
            break
        trial = [c for c in chosen if c is not cand]
        trial_err, _ = search.evaluate({c.node for c in trial})
        if search.budget.met(trial_err):
            chosen, error = trial, trial_err
    return chosen, error


def search_precision(
    mod,
    calib_inputs,
    target="llvm",
    dtype: str | None = None,
    budget: ErrorBudget | None = None,
    params=None,
    start_level: str = "O3",
    time_limit_s: float = 300.0,
    holdout: float = 0.25,
    progress: bool = True,
    measure_latency: bool = True,
) -> PrecisionPlan:
    """Find the fastest per-node precision plan whose error on calibration data meets ``budget``.

    Parameters
    ----------
    mod : tvm.IRModule or relax.Function
        The fp32 model.
    calib_inputs : list
        Calibration samples: each an array (one-input models) or a tuple of arrays. The last
        ``holdout`` fraction is kept aside to check the plan on inputs the search never saw.
    target, dtype, params
        As for :func:`tvmamp.build`.
    budget : ErrorBudget
        The metric and its bound (default: max relative output error 5e-3).
    start_level : str
        The most aggressive level to start from ("O3", "O2" or "O1").
    time_limit_s : float
        The search stops trying new plans after this many seconds.
    holdout : float
        Fraction of the samples held out (0 for none).
    progress : bool
        Show a progress bar (plans tried, fp32 nodes, current error, then latency).
    measure_latency : bool
        Run the speed step (4): time candidate plans and keep the fastest. Off, the plan is the
        accuracy search's (the most low nodes that meet the budget), with no latency compared.

    Returns
    -------
    PrecisionPlan
        Apply it with ``tvmamp.build(mod, plan=plan)``; ``plan.summary()`` explains it.
    """
    budget = budget if budget is not None else ErrorBudget()
    if not isinstance(budget, ErrorBudget):
        raise TypeError(f"tvmamp.search_precision: budget must be an ErrorBudget, got {budget!r}")
    if start_level not in ("O1", "O2", "O3"):
        raise ValueError(
            f"tvmamp.search_precision: start_level {start_level!r} is not O1, O2 or O3"
        )
    mod = as_module(mod, "tvmamp.search_precision")
    start = time.monotonic()
    calib, held = _split(_samples(calib_inputs), holdout)
    search = _Search(mod, params, target, dtype, start_level, budget, calib, time_limit_s, progress)
    try:
        plan, exe, notes = _run(search, measure_latency)
    finally:
        search.bar.close()
    _measure(search, plan, exe, held, start, notes)
    return plan


def _run(search: _Search, measure_latency: bool):
    """The search proper; returns (plan, executable, notes)."""
    notes = []
    chosen, error = _accuracy(search, notes)
    reasons = {c.node: c.reason() for c in chosen}
    fp32 = {c.node for c in chosen}
    if measure_latency and len(fp32) < len(_low_nodes(search)):
        fp32 = _speed(search, fp32, reasons, notes)
    error, exe = search.evaluate(fp32)
    plan = PrecisionPlan(
        model_hash=model_hash(search.mod),
        target=str(search.base.target),
        dtype=search.dtype,
        base_level=search.level,
        node_dtypes=search.plan_dtypes(fp32),
        reasons={n: reasons.get(n, "fp32 in the base level") for n in fp32},
        metrics={"calibration_error": error, "met_budget": search.budget.met(error)},
    )
    return plan, exe, notes


def _low_nodes(search: _Search) -> list[str]:
    return [n.node for n in search.nodes if n.dtype != "float32"]


def _accuracy(search: _Search, notes: list) -> tuple[list, float]:
    """Steps 1-3: the low nodes to return to fp32 (ranked candidates) and the plan's error."""
    error, _ = search.evaluate(set())
    if search.budget.met(error):
        return [], error
    ranked = (
        _ranked(search, notes)
        if not search.out_of_time()
        else rank_candidates(search.mod, search.nodes, [])
    )
    k, error = _smallest_prefix(search, ranked)
    if k is None:
        why = "before the time limit" if search.out_of_time() else "with any node in low"
        notes.append(f"no mixed-precision plan met the budget {why}; returning the fp32 plan")
        return list(ranked), error
    chosen, error = _restore_expensive(search, ranked[:k], error)
    if len(chosen) == len(ranked):
        notes.append("only the fp32 plan meets the budget; returning the fp32 plan")
    return chosen, error


def _speed(search: _Search, fp32: set, reasons: dict, notes: list) -> set:
    """Step 4: the fastest of the plans that meet the budget; fills ``reasons`` for its nodes."""
    _, exe = search.evaluate(fp32)
    search.bar.set_postfix_str("timing the low matmuls alone, in fp32 and low")
    slow = speed.slow_low_nodes(
        search.mod,
        search.params,
        exe.stats.nodes,
        search.target,
        search.dtype,
        search.op_times,
        search.out_of_time,
    )
    plans = {"searched": fp32}
    if slow:
        plans["searched, slow kernels fp32"] = fp32 | set(slow)
        for node, (t32, tlow) in slow.items():
            reasons[node] = f"its low kernel is slower: {tlow:.3f} ms against {t32:.3f} ms in fp32"
    for level in ("O1", "O2"):
        if level != search.level:
            report = convert(search.mod, level, search.target, search.dtype, search.params).report
            plans[level] = {n.node for n in report.nodes if n.dtype == "float32"}
    plans["fp32"] = set(_low_nodes(search))
    executables = {}
    for name, nodes in plans.items():
        if search.out_of_time() and executables:
            notes.append(f"time limit: the {name} plan and later ones were not compared")
            break
        error, candidate = search.evaluate(nodes)
        if search.budget.met(error):
            executables[name] = candidate
    if not executables:
        return fp32
    search.bar.set_postfix_str(f"timing {len(executables)} plans that meet the budget")
    winner, search.latencies = speed.fastest(executables, list(search.calib[0]))
    search.chosen = winner
    search.bar.set_postfix(plan=winner, latency=f"{search.latencies[winner]:.3f} ms")
    for node in plans[winner] - fp32:
        reasons.setdefault(node, f"fp32 in the {winner} plan, the fastest that meets the budget")
    return plans[winner]


def _ranked(search: _Search, notes: list) -> list:
    """Candidates ranked by per-op attribution on the first calibration input.

    If the instrumented builds that attribution needs fail, the candidates keep the static
    order (cheap ops before GEMMs, graph order) and the plan's notes say so.
    """
    from tvmamp.debugging import compare_accuracy

    try:
        report = compare_accuracy(
            search.mod,
            list(search.calib[0]),
            level=search.level,
            dtype=search.dtype,
            params=search.params,
            target=search.target,
            plot=False,
        )
    except (RuntimeError, TypeError, ValueError) as err:
        notes.append(
            f"per-op attribution failed ({type(err).__name__}: "
            f"{str(err).strip().splitlines()[-1][:200]}); ranked without it"
        )
        return rank_candidates(search.mod, search.nodes, [])
    return rank_candidates(search.mod, search.nodes, report.rows)


def _measure(search: _Search, plan: PrecisionPlan, exe, held, start, notes):
    """Held-out error and latency against O1 and fp32, into ``plan.metrics``."""
    metrics = plan.metrics
    metrics.update(
        budget=search.budget.max_rel_err, metric=search.budget.name, builds=search.builds
    )
    if search.latencies:
        metrics["compared_ms"] = {k: round(v, 4) for k, v in search.latencies.items()}
        metrics["chosen"] = search.chosen
    if held:
        held_ref = [search.reference(*s) for s in held]
        metrics["holdout_error"] = search.budget.measure(held_ref, [exe(*s) for s in held])
        if not search.budget.met(metrics["holdout_error"]):
            notes.append(
                f"held-out error {metrics['holdout_error']:.3g} exceeds the budget "
                f"{search.budget.max_rel_err:g}"
            )
    o1 = build(search.mod, "O1", search.target, search.dtype, search.params)
    sample = search.calib[0]
    metrics["latency_ms"] = median_latency_ms(exe, sample)
    metrics["latency_o1_ms"] = median_latency_ms(o1, sample)
    metrics["latency_fp32_ms"] = median_latency_ms(search.reference, sample)
    metrics["search_s"] = round(time.monotonic() - start, 1)
    metrics["notes"] = notes
    for note in notes:
        warnings.warn(f"tvmamp.search_precision: {note}", stacklevel=3)
