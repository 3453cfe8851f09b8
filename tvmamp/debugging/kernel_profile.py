"""Per-kernel profile of a built model: time, share, calls, shapes and achieved rate vs peak.

TVM 0.27's Relax VM has no ``profile=True``, so each kernel call is timed through VM
instrumentation (``vm.set_instrument``): a Python callback takes a timestamp before and after
every call the VM makes, builtins (``vm.builtin.*``) left out. The callback costs a few
microseconds per call, so the figures of tiny kernels are upper bounds.

Each kernel's FLOPs come from its PrimFunc (:mod:`tvmamp.debugging.costs`) and its bytes
from its runtime arguments (every tensor read or written once, the least traffic it can have).
Its arithmetic intensity against the machine's balance (:mod:`tvmamp.debugging.peaks`) puts it
in a class, compute-bound or memory-bound (the roofline), and its rate is rated against that
class's peak: GFLOP/s against the compute peak of its input dtype, or GB/s against the copy
bandwidth. A kernel below ``threshold`` (10%) of its peak is flagged: a naive kernel cannot
hide.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import tvm
import tvm_ffi

from tvmamp.executable import aligned_input

from .costs import KernelCosts, replay_kernel_costs
from .peaks import Peaks, measure_peaks, runs_on_host

COMPONENT = "tvmamp.debugging.profile"
THRESHOLD = 0.10


@dataclasses.dataclass(frozen=True)
class _Arg:
    """A runtime argument as recorded at a call: a tensor's shape and dtype, or an integer."""

    shape: tuple = ()
    dtype: str = ""
    value: int | None = None

    @property
    def nbytes(self) -> int:
        if not self.dtype:
            return 0
        size = 1
        for dim in self.shape:
            size *= int(dim)
        kind = tvm.runtime.DataType(self.dtype)
        return size * kind.bits * kind.lanes // 8


def _arg(value) -> _Arg:
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return _Arg(tuple(int(d) for d in value.shape), str(value.dtype))
    return _Arg(value=value if isinstance(value, int) else None)


@dataclasses.dataclass
class KernelRecord:
    """One kernel of a profile (figures for one call of the model).

    Attributes
    ----------
    name : str
        The kernel (PrimFunc) name the VM calls.
    ms : float
        Time summed over its calls in one model call (median over the rounds).
    share : float
        Its fraction of the summed kernel time.
    calls : int
        Calls per model call.
    shapes, dtypes : list
        Its tensor arguments' shapes and dtypes at its first call (outputs last).
    flops : int or None
        FLOPs over its calls, from its PrimFunc (None: unknown, e.g. no TIR for it).
    bytes : int
        Bytes of its tensor arguments over its calls.
    bound : str or None
        "compute" or "memory" (the roofline class), None when there is nothing to rate.
    gflops, gbs : float or None
        Achieved GFLOP/s and GB/s.
    peak : float or None
        The peak of its class: GFLOP/s (compute) or GB/s (memory).
    efficiency : float or None
        Achieved rate over ``peak``.
    flagged : bool
        Whether ``efficiency`` is below the profile's threshold.
    """

    name: str
    ms: float
    share: float
    calls: int
    shapes: list
    dtypes: list
    flops: int | None
    bytes: int
    bound: str | None = None
    gflops: float | None = None
    gbs: float | None = None
    peak: float | None = None
    efficiency: float | None = None
    flagged: bool = False


@dataclasses.dataclass
class Profile:
    """The kernels of one model call, slowest first, with the peaks they are rated against."""

    records: list
    peaks: Peaks
    threshold: float
    rounds: int

    @property
    def total_ms(self) -> float:
        """Summed kernel time of one model call."""
        return sum(r.ms for r in self.records)

    @property
    def flagged(self) -> list:
        """The kernels below ``threshold`` of their peak."""
        return [r for r in self.records if r.flagged]

    def as_dict(self) -> dict:
        """Plain data for JSON: totals, peaks and one dict per kernel."""
        return dict(
            total_ms=self.total_ms,
            rounds=self.rounds,
            threshold=self.threshold,
            peaks=dataclasses.asdict(self.peaks),
            kernels=[dataclasses.asdict(r) for r in self.records],
        )

    def table(self) -> str:
        """The profile as a text table (see :func:`format_table`)."""
        return format_table(self)

    def __str__(self) -> str:
        return self.table()


def time_kernels(vm, args, rounds: int = 3) -> dict:
    """Per-kernel seconds, calls and argument records of one ``main`` call, by VM instrumentation.

    Returns ``{name: (median seconds over rounds, calls per round, [args of each call])}`` in
    first-call order; the arguments are recorded in the first round, before the timestamp.
    """
    runs, calls, starts = [], {}, {}

    def instrument(func, name, before, ret, *call_args):
        # a Relax function the VM calls (a VM closure: an If's branch, a decoder's step) is no
        # kernel, and its time is its kernels' time again
        if name.startswith("vm.builtin") or not isinstance(func, tvm_ffi.Function):
            return 0
        if before:
            if not runs:
                calls.setdefault(name, []).append([_arg(a) for a in call_args])
            starts[name] = time.perf_counter()
        else:
            totals[name] = totals.get(name, 0.0) + time.perf_counter() - starts[name]
        return 0

    vm["main"](*args)  # warm-up, uninstrumented
    vm.set_instrument(tvm.runtime.convert(instrument))
    try:
        for _ in range(rounds):
            totals: dict[str, float] = {}
            vm["main"](*args)
            runs.append(totals)
    finally:
        vm.set_instrument(None)
    return {
        name: (statistics.median(r.get(name, 0.0) for r in runs), len(recorded), recorded)
        for name, recorded in calls.items()
    }


def _kernel_dtype(dtypes) -> str:
    """The low float dtype among a kernel's arguments (its compute peak), else float32."""
    for low in ("bfloat16", "float16"):
        if low in dtypes:
            return low
    return "float32"


def _flops(cost, recorded) -> int | None:
    """FLOPs over a kernel's calls, each call's shape variables bound from its arguments."""
    if cost is None:
        return None
    per_call = [cost.flops_for([a.value if not a.dtype else a for a in c]) for c in recorded]
    return None if None in per_call else sum(per_call)


def _record(name, seconds, calls, recorded, cost, peaks: Peaks, threshold) -> KernelRecord:
    """A kernel's record, rated against the peak of its roofline class."""
    tensors = [a for a in recorded[0] if a.dtype]
    flops = _flops(cost, recorded)
    nbytes = sum(a.nbytes for c in recorded for a in c)
    rec = KernelRecord(
        name=name,
        ms=seconds * 1e3,
        share=0.0,
        calls=calls,
        shapes=[list(a.shape) for a in tensors],
        dtypes=[a.dtype for a in tensors],
        flops=flops,
        bytes=nbytes,
    )
    if seconds <= 0 or (not flops and not nbytes):
        return rec  # nothing to rate: no tensors and no arithmetic (a guard, a no-op)
    rec.gflops = flops / seconds / 1e9 if flops is not None else None
    rec.gbs = nbytes / seconds / 1e9
    compute_peak = peaks.compute_peak(_kernel_dtype(rec.dtypes))
    compute = bool(flops) and (not nbytes or flops / nbytes >= compute_peak / peaks.gbs)
    rec.bound = "compute" if compute else "memory"
    rec.peak = compute_peak if compute else peaks.gbs
    rec.efficiency = (rec.gflops if compute else rec.gbs) / rec.peak
    rec.flagged = rec.efficiency < threshold
    return rec


def profile(
    exe,
    inputs,
    *,
    rounds: int = 3,
    costs: KernelCosts | None = None,
    peaks: Peaks | None = None,
    threshold: float = THRESHOLD,
) -> Profile:
    """Time every kernel of one ``main`` call of ``exe`` and rate it against the machine's peak.

    Parameters
    ----------
    exe : tvmamp.Executable
        A model built for a CPU target (llvm ...).
    inputs : list
        ``main``'s inputs: numpy arrays, DLPack or TVM tensors (copied when not aligned).
    rounds : int
        Instrumented calls; each kernel's time is the median (after one uninstrumented call).
    costs : KernelCosts, optional
        From :func:`tvmamp.debugging.kernel_cost_recording` around the build; by default the
        kernels are counted again from ``exe.mod`` (phases 1-2 of the pipeline).
    peaks : Peaks, optional
        The peaks to rate against; by default measured once per process
        (:func:`tvmamp.debugging.measure_peaks`).
    threshold : float
        Kernels below this fraction of their class's peak are flagged.

    Returns
    -------
    Profile
        The kernels, slowest first.
    """
    _check(exe, rounds, threshold)
    peaks = peaks if peaks is not None else measure_peaks(exe.target)
    costs = costs if costs is not None else replay_kernel_costs(exe)
    args = [aligned_input(x, exe.device) for x in inputs]
    timed = time_kernels(exe.vm, args, rounds)
    records = [
        _record(name, sec, calls, recorded, costs.lookup(name), peaks, threshold)
        for name, (sec, calls, recorded) in timed.items()
    ]
    total = sum(r.ms for r in records) or 1.0
    for r in records:
        r.share = r.ms / total
    records.sort(key=lambda r: -r.ms)
    return Profile(records, peaks, threshold, rounds)


def _check(exe, rounds, threshold) -> None:
    if not hasattr(exe, "vm") or not hasattr(exe, "target"):
        raise TypeError(f"{COMPONENT}: expected a tvmamp Executable, got {type(exe).__name__}")
    if not runs_on_host(exe.target):
        raise ValueError(
            f"{COMPONENT}: target {str(exe.target)!r} is not supported; kernels are timed on "
            "the host, which needs a CPU target (llvm ...)"
        )
    if not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"{COMPONENT}: rounds {rounds!r} is not a positive integer")
    if not 0 <= threshold <= 1:
        raise ValueError(f"{COMPONENT}: threshold {threshold!r} is not a fraction in [0, 1]")


def _rate(value) -> str:
    return "-" if value is None else f"{value:.1f}"


def _shapes(rec: KernelRecord) -> str:
    short = {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "int64": "i64"}
    return " ".join(
        f"{short.get(d, d)}[{'x'.join(map(str, s))}]" for s, d in zip(rec.shapes, rec.dtypes)
    )


def format_table(prof: Profile) -> str:
    """Kernels slowest first: time, share, calls, rate, class, % of peak, argument shapes."""
    width = max([len("kernel"), *(len(r.name) for r in prof.records)])
    head = (
        f"{'kernel':<{width}} {'ms':>9} {'share':>6} {'calls':>5} {'GFLOP/s':>8} {'GB/s':>7} "
        f"{'bound':>7} {'% peak':>7}  arguments (first call)"
    )
    lines = [prof.peaks.describe(), "", head, "-" * len(head)]
    for r in prof.records:
        pct = "-" if r.efficiency is None else f"{100 * r.efficiency:.1f}%"
        mark = " <" if r.flagged else ""
        lines.append(
            f"{r.name:<{width}} {r.ms:>9.3f} {100 * r.share:>5.1f}% {r.calls:>5} "
            f"{_rate(r.gflops):>8} {_rate(r.gbs):>7} {r.bound or '-':>7} "
            f"{pct:>7}{mark:<2} {_shapes(r)}"
        )
    lines.append("-" * len(head))
    flagged = prof.flagged
    lines.append(
        f"total {prof.total_ms:.3f} ms in {len(prof.records)} kernels (one model call, median "
        f"of {prof.rounds} instrumented calls); {len(flagged)} below "
        f"{100 * prof.threshold:.0f}% of their peak (marked <), "
        f"{100 * sum(r.share for r in flagged):.1f}% of the time"
    )
    return "\n".join(lines)
