"""Grid search over a target's decided design space: each configuration measured once."""

from __future__ import annotations

from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms
from tvm.s_tir.meta_schedule.search_strategy import MeasureCandidate, PySearchStrategy

from .packed_weights import measured_args


@derived_object
class EnumerateSpaces(PySearchStrategy):
    """Measure each design space once, in order: a grid search over a small, decided space.

    ``ReplayFunc`` samples a design space per trial with replacement (duplicates are measured
    again, and a schedule function that raises stops the whole run); a target's own space (the
    bf16 GEMM space of CPUs with avx512_bf16) has at most a few dozen distinct kernels, so
    enumerating them measures every one exactly once. A space is known by its
    ``sample_categorical`` decision (deterministic for a kernel and target; structural hashes
    are not, as a JSON round trip turns annotation ``True`` into ``1``): those in ``done``
    (earlier runs, earlier rounds) are skipped, and handed-out ones added.
    """

    def __init__(self, done: set | None = None):
        super().__init__()
        self.done = done if done is not None else set()
        self.pending: list = []
        self.batch = 1

    def _initialize_with_tune_context(self, context) -> None:
        """Nothing to take from the context: the design spaces come in ``pre_tuning``."""

    def pre_tuning(self, max_trials, num_trials_per_iter, design_spaces, database, cost_model):
        """Queue the first ``max_trials`` design spaces not measured before."""
        fresh = [s for s in design_spaces if decision_of(s.trace) not in self.done]
        self.pending = list(fresh[: max(int(max_trials), 0)])
        self.batch = max(int(num_trials_per_iter), 1)

    def post_tuning(self) -> None:
        """Forget the queue."""
        self.pending = []

    def generate_measure_candidates(self):
        """The next batch of queued design spaces, None when all were handed out."""
        if not self.pending:
            return None
        batch, self.pending = self.pending[: self.batch], self.pending[self.batch :]
        self.done.update(decision_of(sch.trace) for sch in batch)
        return [MeasureCandidate(sch, measured_args(sch.mod)) for sch in batch]

    def notify_runner_results(self, measure_candidates, results) -> None:
        """Results change nothing: every queued space is measured anyway."""

    def clone(self):
        """A fresh strategy sharing the ``done`` set."""
        return EnumerateSpaces(self.done)


def decision_of(trace) -> int | None:
    """The first ``sample_categorical`` decision of a trace (the configuration's index)."""
    for inst in trace.insts:
        if inst.kind.name == "SampleCategorical":
            return int(trace.decisions[inst])
    return None


def grid_context(task, target, options, done: set | None = None) -> ms.TuneContext:
    """meta_schedule's TuneContext for a task in its target's own space, enumerated.

    ``task.space_generator`` (from the target entry's ``design_space``) makes the space;
    ``done``: decisions measured before (see :class:`EnumerateSpaces`); the set is shared.
    """
    return ms.TuneContext(
        mod=task.mod,
        target=target,
        space_generator=task.space_generator(target),
        search_strategy=EnumerateSpaces(done),
        task_name=task.name,
        rand_state=options.seed if options.seed is not None else -1,
    )
