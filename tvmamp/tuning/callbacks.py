"""meta_schedule hooks for tvmamp.tune: skip candidates measured before, record, show progress."""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm.ir.utils import derived_object
from tvm.s_tir.meta_schedule.builder import BuilderInput, BuilderResult, PyBuilder
from tvm.s_tir.meta_schedule.database import TuningRecord
from tvm.s_tir.meta_schedule.measure_callback import PyMeasureCallback

# The builder error that marks a candidate an earlier run of the same log already measured.
MEASURED_BEFORE = "tvmamp: measured in an earlier run of this log; not measured again"


def module_key(mod: tvm.IRModule) -> int:
    """The structural hash meta_schedule's search uses to tell candidates apart."""
    return tvm_ffi.structural_hash(mod)


@derived_object
class SkipMeasuredBuilder(PyBuilder):
    """Builds with ``inner``, except candidates whose scheduled module was measured before.

    meta_schedule's evolutionary search forgets, between runs, which candidates it measured
    (its own TODO says so), so a resumed run would re-measure the best of the earlier ones.
    """

    def __init__(self, inner, measured: set):
        super().__init__()
        self.inner = inner
        self.measured = measured

    def build(self, build_inputs):
        from .packed_weights import for_measuring

        fresh = [i for i, x in enumerate(build_inputs) if module_key(x.mod) not in self.measured]
        inputs = [build_inputs[i] for i in fresh]
        inputs = [BuilderInput(for_measuring(x.mod), x.target, x.params) for x in inputs]
        built = self.inner.build(inputs) if inputs else []
        results = [BuilderResult(None, MEASURED_BEFORE) for _ in build_inputs]
        for i, result in zip(fresh, built):
            results[i] = result
        return results


def median_secs(runner_result) -> float | None:
    """The median run time of a measurement in seconds, None if it failed."""
    if runner_result.error_msg is not None or not runner_result.run_secs:
        return None
    secs = sorted(float(s) for s in runner_result.run_secs)
    return secs[len(secs) // 2]


@derived_object
class RecordAndReport(PyMeasureCallback):
    """Commits measured candidates to the log, trains the cost model and moves the progress bar.

    It replaces meta_schedule's AddToDatabase and UpdateCostModel so that candidates skipped
    by :class:`SkipMeasuredBuilder` are neither logged again nor taught to the cost model as
    failures. Failed candidates are logged as meta_schedule logs them (1e10 s), never timed.
    ``cost_model=None`` trains none (tasks whose search does not use it).
    """

    def __init__(self, database, cost_model, progress):
        super().__init__()
        self.database = database
        self.cost_model = cost_model
        self.progress = progress

    def apply(self, task_scheduler, task_id, measure_candidates, builder_results, runner_results):
        ctx = task_scheduler.tasks_[task_id].ctx
        keep = [i for i, b in enumerate(builder_results) if b.error_msg != MEASURED_BEFORE]
        workload = self.database.commit_workload(ctx.mod)
        for i in keep:
            secs = median_secs(runner_results[i])
            run_secs = [float(s) for s in runner_results[i].run_secs] if secs else [1e10]
            candidate = measure_candidates[i]
            self.database.commit_tuning_record(
                TuningRecord(
                    candidate.sch.trace, workload, run_secs, ctx.target, candidate.args_info
                )
            )
        if self.cost_model is not None:
            cands = [measure_candidates[i] for i in keep]
            self.cost_model.update(ctx, cands, [runner_results[i] for i in keep])
        self.progress.measured([median_secs(runner_results[i]) for i in keep])
