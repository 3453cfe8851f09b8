"""Steps 1-3 of the precision search: the fewest nodes to return to fp32 to meet the budget."""

from __future__ import annotations

from tvmamp.messages import last_line

from .attribution import rank_candidates
from .state import SearchState


def accuracy_steps(search: SearchState, notes: list) -> tuple[list, float]:
    """Steps 1-3: the low nodes to return to fp32 (ranked candidates) and the plan's error.

    1. The base level with every node low; done if it meets the budget.
    2. Rank the low nodes by per-op attribution (:func:`ranked_candidates`).
    3. The smallest top-k prefix that meets the budget (:func:`smallest_prefix`), then GEMM-like
       nodes of it back to low where the budget allows (:func:`restore_expensive`).
    """
    error, _ = search.evaluate(set())
    if search.budget.met(error):
        return [], error
    ranked = (
        ranked_candidates(search, notes)
        if not search.out_of_time()
        else rank_candidates(search.mod, search.nodes, [])
    )
    k, error = smallest_prefix(search, ranked)
    if k is None:
        why = "before the time limit" if search.out_of_time() else "with any node in low"
        notes.append(f"no mixed-precision plan met the budget {why}; returning the fp32 plan")
        return list(ranked), error
    chosen, error = restore_expensive(search, ranked[:k], error)
    if len(chosen) == len(ranked):
        notes.append("only the fp32 plan meets the budget; returning the fp32 plan")
    return chosen, error


def ranked_candidates(search: SearchState, notes: list) -> list:
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
            f"{last_line(err)[:200]}); ranked without it"
        )
        return rank_candidates(search.mod, search.nodes, [])
    return rank_candidates(search.mod, search.nodes, report.rows)


def smallest_prefix(search: SearchState, ranked: list) -> tuple[int | None, float]:
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


def restore_expensive(search: SearchState, chosen: list, error: float) -> tuple[list, float]:
    """Put GEMM-like nodes of ``chosen`` back to low where the budget allows."""
    for cand in [c for c in chosen if c.expensive]:
        if search.out_of_time():
            break
        trial = [c for c in chosen if c is not cand]
        trial_err, _ = search.evaluate({c.node for c in trial})
        if search.budget.met(trial_err):
            chosen, error = trial, trial_err
    return chosen, error
