"""search_precision: the fastest per-node precision plan whose error stays within a budget.

The search, with few builds (steps 1-3 in :mod:`.accuracy`, step 4 in :mod:`.speed`, the state
they share in :mod:`.state`):

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
from tvmamp.conversion import as_module

from .accuracy import accuracy_steps
from .budget import ErrorBudget
from .plan import PrecisionPlan, model_hash
from .speed import speed_step
from .state import SearchState, compile_plan


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
    search = SearchState(
        mod, params, target, dtype, start_level, budget, calib, time_limit_s, progress
    )
    try:
        plan, exe, notes = _run(search, measure_latency)
    finally:
        search.bar.close()
    _measure(search, plan, exe, held, start, notes)
    return plan


def _run(search: SearchState, measure_latency: bool):
    """The search proper; returns (plan, executable, notes)."""
    notes = []
    chosen, error = accuracy_steps(search, notes)
    reasons = {c.node: c.reason() for c in chosen}
    fp32 = {c.node for c in chosen}
    if measure_latency and len(fp32) < len(search.low_nodes()):
        fp32 = speed_step(search, fp32, reasons, notes)
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


def _measure(search: SearchState, plan: PrecisionPlan, exe, held, start, notes):
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
    o1 = compile_plan(search.mod, "O1", search.target, search.dtype, search.params)
    sample = search.calib[0]
    metrics["latency_ms"] = median_latency_ms(exe, sample)
    metrics["latency_o1_ms"] = median_latency_ms(o1, sample)
    metrics["latency_fp32_ms"] = median_latency_ms(search.reference, sample)
    metrics["search_s"] = round(time.monotonic() - start, 1)
    metrics["notes"] = notes
    for note in notes:
        warnings.warn(f"tvmamp.search_precision: {note}", stacklevel=3)
