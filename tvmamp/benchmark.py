"""Timing and error helpers shared by the demo, the CLI and bench/."""

from __future__ import annotations

import statistics
import time

import numpy as np
import tvm

# Calls before timing, for at least this long: a vCPU that was idle takes a few hundred
# milliseconds of work to be scheduled at full speed again (SimpleNet at two threads: the first
# 7 calls took 46 ms, the rest 26 ms), and thread pools spin up their workers.
WARMUP_S = 0.3
# Untimed calls before each timed sample of an interleaved comparison (paired_medians): when the
# threads of two runtimes together exceed the cores, the idle pool of the runtime timed just
# before still spin-waits on them. At two threads on two vCPUs, SimpleNet batch 1 took 5.3 ms
# right after torch and 0.10 ms on its own.
SETTLE_S = 0.05


def warm_up(fns, seconds: float = WARMUP_S) -> None:
    """Call each of ``fns`` in turn, at least once, until ``seconds`` have passed."""
    end = time.perf_counter() + seconds
    while True:
        for fn in fns:
            fn()
        if time.perf_counter() >= end:
            return


def median_latency_ms(exe, inputs, repeat: int = 10, min_repeat_ms: int = 0) -> float:
    """Median wall time of one call of ``main`` in milliseconds (TVM's time_evaluator), after
    :func:`warm_up`."""
    args = [tvm.runtime.tensor(np.asarray(x), exe.device) for x in inputs]
    main = exe.vm["main"]
    warm_up([lambda: main(*args)])
    timer = exe.vm.time_evaluator(
        "main", exe.device, number=1, repeat=repeat, min_repeat_ms=min_repeat_ms
    )
    return float(np.median(timer(*args).results) * 1e3)


def max_rel_error(out, ref) -> float:
    """The normwise relative error ``max|out - ref| / max|ref|``, in float64.

    One number for a whole output, as the demo, the CLI and bench/ report it: the largest
    absolute error divided by the largest reference magnitude (the infinity norms of the error
    and of the reference). It is not an elementwise relative error: an element much smaller than
    the largest, such as most of a softmax's probabilities, may be wrong by many times its own
    size while this number stays small. Tests check outputs elementwise instead
    (``|out - ref| <= atol + rtol * |ref|``). Tuples are compared field by field and the largest
    error is returned; a reference that is all zeros divides by 1.
    """
    if isinstance(ref, tuple):
        return max(max_rel_error(o, r) for o, r in zip(out, ref))
    out = np.asarray(out, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    scale = float(np.abs(ref).max()) or 1.0
    return float(np.abs(out - ref).max() / scale)


def paired_medians(fns, repeat: int = 20, number: int = 1, settle_s: float = None) -> list[float]:
    """Time ``fns`` interleaved, so machine noise hits them alike; median seconds per call each.

    Each of ``repeat`` rounds times ``number`` calls of every function in turn, after
    :func:`warm_up` (every function called in turn for 0.3 s, at least once). Before its timed
    calls in a round, each function runs untimed for ``settle_s`` (default :data:`SETTLE_S`), so
    that the thread pool of the function timed before it (torch's OpenMP threads spin-wait
    after each parallel region) has gone idle and no longer holds the cores.
    """
    settle_s = SETTLE_S if settle_s is None else settle_s
    warm_up(fns)
    samples = [[] for _ in fns]
    for _ in range(repeat):
        for fn, out in zip(fns, samples):
            warm_up([fn], settle_s)
            start = time.perf_counter()
            for _ in range(number):
                fn()
            out.append((time.perf_counter() - start) / number)
    return [statistics.median(s) for s in samples]
