"""One tuning session: TVM's builder, runner, XGBoost cost model and JSON database, task by task."""

from __future__ import annotations

import os

from tvm.s_tir import meta_schedule as ms
from tvm.s_tir.meta_schedule.runner import RunnerResult

from .baseline import measure_default
from .callbacks import RecordAndReport, SkipMeasuredBuilder, module_key
from .grid_search import decision_of, grid_context
from .intrinsics import register_log_intrinsics
from .progress import Progress

# Searches stop early when a task cannot produce new candidates; a resumed task whose search
# keeps proposing candidates measured before gets this many rounds to reach its budget.
MAX_ROUNDS = 3


def open_database(work_dir: str, component: str = "tvmamp.tune"):
    """meta_schedule's JSONDatabase on ``work_dir`` (created if absent), errors made readable."""
    register_log_intrinsics(work_dir)  # TVM replays every record's trace when it opens the log
    try:
        return ms.database.JSONDatabase(work_dir=work_dir, allow_missing=True)
    except Exception as err:  # TVM raises its own error types for unreadable records
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(
            f"{component}: TVM could not read the tuning log {work_dir!r}: {first}. "
            "Delete the log and tune again"
        ) from None


class Session:
    """Builder, runner, cost model and database shared by all tasks of one ``tune`` call."""

    def __init__(self, work_dir, target, entry, rpc, options, initializer):
        self.work_dir = work_dir
        self.target = target
        self.entry = entry
        self.options = options
        self.database = open_database(work_dir)
        self.measured: set = set()
        workers = os.cpu_count() or 1
        self.local_builder = ms.builder.LocalBuilder(
            max_workers=workers, initializer=initializer, f_build=entry.meta_schedule_build
        )
        self.builder = SkipMeasuredBuilder(self.local_builder, self.measured)
        config = options.evaluator_config
        self.runner = rpc.runner(config) if rpc else ms.runner.LocalRunner(evaluator_config=config)
        self.cost_model = ms.cost_model.XGBModel(num_tuning_cores=workers)

    def run(self, pending, total: int, on_default) -> int:
        """Tune each ``(task, result so far)`` up to its budget; returns new trials measured.

        Each task's default schedule is timed too, once per log, and handed to ``on_default``.
        """
        progress = Progress(total, self.options.progress)
        try:
            for task, so_far in pending:
                ctx, callback = self._prepare(task, progress)
                best = so_far.best_ms / 1e3 if so_far.best_ms is not None else None
                progress.start_task(task.name, best)
                self._tune(ctx, task.trials, callback)
                if not so_far.default_timed:
                    secs = measure_default(
                        task, self.target, self.entry, self.local_builder, self.runner
                    )
                    on_default(task, secs)
        finally:
            progress.close()
        return progress.new_trials

    def _prepare(self, task, progress) -> tuple:
        """The task's TuneContext, told what the log measured before, and its measure callback.

        The cost model only guides the evolutionary search: a target's own space is enumerated,
        so its tasks neither train nor use it.
        """
        done: set = set()  # the enumerated space's decisions measured so far
        ctx = make_context(task, self.target, self.options, done)
        if task.space_generator is not None:
            done.update(decision_of(r.trace) for r in self._records(ctx))
            return ctx, RecordAndReport(self.database, None, progress)
        self._warm_up(ctx)
        return ctx, RecordAndReport(self.database, self.cost_model, progress)

    def _records(self, ctx) -> list:
        workload = self.database.commit_workload(ctx.mod)
        return [r for r in self.database.get_all_tuning_records() if r.workload.same_as(workload)]

    def _warm_up(self, ctx) -> None:
        """Teach the cost model the log's earlier records and remember what they measured."""
        records = self._records(ctx)
        if not records:
            return
        candidates = [r.as_measure_candidate() for r in records]
        self.measured.update(module_key(c.sch.mod) for c in candidates)
        self.cost_model.update(ctx, candidates, [_as_result(r) for r in records])

    def _tune(self, ctx, budget: int, callback) -> None:
        for _ in range(MAX_ROUNDS):
            left = budget - len(self._records(ctx))
            if left <= 0:
                return
            before = len(self.database)
            ms.tune_tasks(
                tasks=[ctx],
                task_weights=[1.0],
                work_dir=self.work_dir,
                max_trials_global=left,
                max_trials_per_task=left,
                num_trials_per_iter=min(self.options.num_trials_per_iter, left),
                builder=self.builder,
                runner=self.runner,
                database=self.database,
                cost_model=self.cost_model,
                measure_callbacks=[callback, ms.measure_callback.RemoveBuildArtifact()],
                task_scheduler=ms.task_scheduler.RoundRobin(),
            )
            if len(self.database) == before:
                return  # the search found nothing new to measure


def make_context(task, target, options, done: set | None = None) -> ms.TuneContext:
    """meta_schedule's TuneContext for one task, in the task's design space.

    Tasks in their target's own space (``task.space_generator``, e.g. the bf16 GEMM space of
    CPUs with avx512_bf16) get its configurations, each measured once (``done``: the decisions
    measured before, not proposed again); the others TVM's post-order-apply space with
    evolutionary search.
    """
    if task.space_generator is not None:
        return grid_context(task, target, options, done)
    population = options.population_size or min(512, max(64, 8 * task.trials))
    strategy = ms.search_strategy.EvolutionarySearch(population_size=population)
    return ms.TuneContext(
        mod=task.mod,
        target=target,
        space_generator="post-order-apply",
        search_strategy=strategy,
        task_name=task.name,
        rand_state=options.seed if options.seed is not None else -1,
    ).clone()


def _as_result(record) -> RunnerResult:
    secs = [float(s) for s in record.run_secs] if record.run_secs else []
    if not secs or min(secs) >= 1e9:
        return RunnerResult(None, "failed in an earlier run")
    return RunnerResult(secs, None)
