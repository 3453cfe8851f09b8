"""The state of one precision search: reference outputs, the budget, the clock, the plans tried."""

from __future__ import annotations

import time

from tvmamp.conversion import convert
from tvmamp.pipeline import compile_converted


def compile_plan(mod, level, target, dtype=None, params=None, node_dtypes=None):
    """Convert at ``level`` with exact ``node_dtypes`` and compile through the pipeline."""
    return compile_converted(convert(mod, level, target, dtype, params, node_dtypes=node_dtypes))


class SearchState:
    """One search: the fp32 reference, the base conversion, the budget and the clock.

    ``evaluate(fp32)`` builds the plan with the ``fp32`` nodes in fp32 (each plan once) and
    measures its error on the calibration inputs.
    """

    def __init__(self, mod, params, target, dtype, level, budget, calib, time_limit_s, progress):
        self.mod, self.params, self.target, self.level = mod, params, target, level
        self.budget, self.calib, self.deadline = budget, calib, time.monotonic() + time_limit_s
        self.reference = compile_plan(mod, "O0", target, params=params)
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

    def low_nodes(self) -> list[str]:
        """The nodes the base level runs low."""
        return [n.node for n in self.nodes if n.dtype != "float32"]

    def evaluate(self, fp32: set):
        """Build with the ``fp32`` nodes in fp32; (error on the calibration inputs, executable)."""
        key = frozenset(fp32)
        if key not in self._tried:
            exe = compile_plan(
                self.mod, self.level, self.target, self.dtype, self.params, self.plan_dtypes(fp32)
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
