"""The bf16 GEMM tasks' search: tvmamp's vdpbf16ps/AMX space, each configuration measured once."""

from __future__ import annotations

import tvm
from tvm import relax, s_tir, tirx
from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms
from tvm.s_tir.meta_schedule.arg_info import ArgInfo
from tvm.s_tir.meta_schedule.search_strategy import MeasureCandidate, PySearchStrategy

# Task.space values: the design space a task is searched in.
DEFAULT_SPACE = "post-order-apply"
BF16_SPACE = "bf16-gemm"


def classify(mod, target) -> tuple[str, int | None]:
    """``(space, size)`` of a task: the bf16 space and its distinct configurations, or default.

    A kernel goes to the bf16 space when tvmamp's default bf16 rule schedules it on ``target``
    (a static bf16 x bf16 -> fp32 matmul, dense or batch-matmul on a CPU with avx512_bf16).
    """
    from tvmamp.schedules.cpu_bf16_common import has_avx512bf16
    from tvmamp.schedules.cpu_bf16_tuning import distinct_choices, is_bf16_gemm

    if target.kind.name != "llvm" or not has_avx512bf16(target):
        return DEFAULT_SPACE, None
    func = mod["main"]
    if not is_bf16_gemm(func, target):
        return DEFAULT_SPACE, None
    return BF16_SPACE, len(distinct_choices(func, target))


@derived_object
class EnumerateSpaces(PySearchStrategy):
    """Measure each design space once, in order: a grid search over a small, decided space.

    ``ReplayFunc`` samples a design space per trial with replacement (duplicates are measured
    again, and a schedule function that raises stops the whole run); the bf16 space has at most
    a few dozen distinct kernels, so enumerating them measures every one exactly once. A space
    is known by its ``sample_categorical`` decision (deterministic for a kernel and target;
    structural hashes are not, as a JSON round trip turns annotation ``True`` into ``1``):
    those in ``done`` (earlier runs, earlier rounds) are skipped, and handed-out ones added.
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
    """The first ``sample_categorical`` decision of a trace (the bf16 configuration's index)."""
    for inst in trace.insts:
        if inst.kind.name == "SampleCategorical":
            return int(trace.decisions[inst])
    return None


def bf16_context(task, target, options, done: set | None = None) -> ms.TuneContext:
    """meta_schedule's TuneContext for a bf16 GEMM task: tvmamp's space, enumerated.

    ``done``: decisions measured before (see :class:`EnumerateSpaces`); the set is shared.
    """
    from tvmamp.schedules.cpu_bf16_tuning import bf16_matmul_spaces

    return ms.TuneContext(
        mod=task.mod,
        target=target,
        space_generator=bf16_matmul_spaces(target),
        search_strategy=EnumerateSpaces(done),
        task_name=task.name,
        rand_state=options.seed if options.seed is not None else -1,
    )


# The block annotation meta_schedule's builder and runner strip (the weight is passed packed).
PREPROC = "meta_schedule.layout_rewrite_preproc"


def measured_args(mod: tvm.IRModule) -> list:
    """The arguments the kernel is timed with: its weights already packed (as at run time)."""
    return ArgInfo.from_entry_func(for_measuring(mod), remove_preproc=True)


def for_measuring(mod: tvm.IRModule) -> tvm.IRModule:
    """``mod`` with its padded weight packing split out, else ``mod`` itself.

    meta_schedule's builder and runner drop the weight-packing blocks and pass the packed
    weight instead, but TVM's RemoveWeightLayoutRewriteBlock only accepts a block that copies
    (it fails on the guarded copy that pads a ragged weight). The build splits such blocks out
    with Relax's ``SplitLayoutRewritePreproc``, so the kernel is timed as the build runs it.
    """
    if not _has_guarded_preproc(mod):
        return mod
    func = mod["main"]
    *inputs, output = func.params
    bb = relax.BlockBuilder()
    args = [relax.Var(f"arg{i}", _tensor_type(b)) for i, b in enumerate(inputs)]
    with bb.function("main", args):
        kernel = bb.add_func(func.with_attr("global_symbol", "main"), "main_kernel")
        with bb.dataflow():
            out = bb.emit_output(relax.call_tir(kernel, args, _tensor_type(output)))
        bb.emit_func_output(out)
    split = relax.transform.SplitLayoutRewritePreproc()(bb.get())
    (name,) = [gv for gv, f in split.functions_items() if gv.name_hint.endswith("_prepacked")]
    return tvm.IRModule({"main": split[name].with_attr("global_symbol", "main")})


def _tensor_type(buffer) -> relax.TensorType:
    return relax.TensorType([int(x) for x in buffer.shape], str(buffer.dtype))


def _has_guarded_preproc(mod: tvm.IRModule) -> bool:
    from tvmamp.schedules.cpu_bf16_common import root_blocks

    sch = s_tir.Schedule(mod)
    for block_rv in root_blocks(sch):
        block = sch.get(block_rv)
        body = block.body
        if PREPROC in block.annotations and not (
            isinstance(body, tirx.BufferStore) and isinstance(body.value, tvm.ir.expr.TensorLoad)
        ):
            return True
    return False
