"""ErrorBudget: how far a mixed-precision model may drift from fp32, and how to measure it."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

METRICS = ("output", "top1")


def _first(output):
    return output[0] if isinstance(output, tuple) else output


def _rel_error(out, ref) -> float:
    if isinstance(ref, tuple):
        return max(_rel_error(o, r) for o, r in zip(out, ref))
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    if not np.isfinite(out).all():
        return float("inf")
    return float(np.abs(out - ref).max() / (np.abs(ref).max() or 1.0))


@dataclasses.dataclass(frozen=True)
class ErrorBudget:
    """The largest acceptable error of a mixed-precision model against its fp32 build.

    Parameters
    ----------
    max_rel_err : float
        The bound on the metric (>= 0): with ``metric="output"`` the max relative error
        ``max|amp - fp32| / max|fp32|`` over every output and calibration input; with
        ``"top1"`` the fraction of rows whose arg-max class differs from fp32 (0.01 = 99 %
        top-1 agreement); with a callable, the value it returns.
    metric : str or callable
        ``"output"``, ``"top1"``, or ``metric(outputs_fp32, outputs_amp) -> float`` taking two
        lists (one entry per calibration input) and returning an error (lower is better).
    """

    max_rel_err: float = 5e-3
    metric: str | Callable = "output"

    def __post_init__(self):
        if not isinstance(self.max_rel_err, (int, float)) or not self.max_rel_err >= 0:
            raise ValueError(
                f"tvmamp.ErrorBudget: max_rel_err must be a number >= 0, got {self.max_rel_err!r}"
            )
        if not callable(self.metric) and self.metric not in METRICS:
            raise ValueError(
                f"tvmamp.ErrorBudget: metric {self.metric!r} is not one of "
                f"{', '.join(METRICS)} or a callable"
            )

    @property
    def name(self) -> str:
        """A short label for the metric."""
        return (
            self.metric
            if isinstance(self.metric, str)
            else getattr(self.metric, "__name__", "metric")
        )

    def measure(self, reference: list, outputs: list) -> float:
        """The metric of ``outputs`` against ``reference`` (one entry per calibration input)."""
        if callable(self.metric):
            value = float(self.metric(reference, outputs))
        elif self.metric == "top1":
            ref = np.concatenate(
                [np.asarray(_first(r)).reshape(-1, _first(r).shape[-1]) for r in reference]
            )
            out = np.concatenate(
                [np.asarray(_first(o)).reshape(-1, _first(o).shape[-1]) for o in outputs]
            )
            value = float(np.mean(ref.argmax(-1) != out.argmax(-1)))
        else:
            value = max(_rel_error(o, r) for o, r in zip(outputs, reference))
        return value if np.isfinite(value) else float("inf")

    def met(self, value: float) -> bool:
        """Whether a measured value is within the budget."""
        return value <= self.max_rel_err
