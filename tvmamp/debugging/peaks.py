"""The machine's peaks for the kernel profile, measured once per process with two built kernels.

- **Compute**: an fp32 multiply-add loop on 12 independent vector accumulators held in
  registers (one vector FMA each, no loads in the loop), run on every runtime thread.
- **Memory**: a vectorised copy of 128 MiB to another 128 MiB (far beyond the caches), counted
  as read plus written bytes, as STREAM's copy counts them.

Both are built for the profiled model's target, so they use the vector width its kernels may
use, and run on the TVM runtime's threads. Low-precision kernels on CPUs with a faster dot
product are held to a higher compute peak: the fp32 figure times the factor of
:data:`LOW_PEAK_FACTORS` for the first CPU feature of the target that has one.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import tvm
from tvm.script import tirx as T

from tvmamp.targets import resolve_target
from tvmamp.targets.cpu_features import target_cpu_features
from tvmamp.targets.llvm_lowering import tir_pipeline

ACCUMULATORS = 12  # independent FMAs in flight: latency 4 x 2 units, with room to spare
FMA_STEPS = 200_000
COPY_FLOATS = 1 << 25  # 128 MiB per buffer
# dtype -> ((LLVM CPU feature, factor over the fp32 FMA peak, why), ...): first match applies.
LOW_PEAK_FACTORS = {
    "bfloat16": (
        (
            "amx-bf16",
            16,
            "AMX TDPBF16PS: 512 bf16 multiply-adds per cycle and core (16 x 16 x 32 per 16 "
            "cycles), against 32 for two 512-bit fp32 FMA units (2900 against 176 GFLOP/s "
            "measured on Emerald Rapids)",
        ),
        (
            "avx512bf16",
            2,
            "vdpbf16ps: two bf16 multiply-adds per fp32 lane (530 against 270 GFLOP/s "
            "measured on Zen5)",
        ),
    ),
}


@dataclasses.dataclass(frozen=True)
class Peaks:
    """Peak rates the profile compares each kernel with.

    Attributes
    ----------
    gflops : float
        fp32 multiply-add peak, GFLOP/s, over ``threads`` threads.
    gbs : float
        Memory copy bandwidth, GB/s (read + written bytes).
    threads : int
        Runtime threads the peaks were measured with.
    source : str
        Where the figures come from (shown with the profile).
    low_factors : dict
        dtype -> (factor over ``gflops``, reason) for the dtypes with a faster compute peak.
    """

    gflops: float
    gbs: float
    threads: int
    source: str
    low_factors: dict = dataclasses.field(default_factory=dict)

    def compute_peak(self, dtype: str) -> float:
        """The compute peak (GFLOP/s) of a kernel whose inputs are ``dtype``."""
        factor = self.low_factors.get(dtype, (1, ""))[0]
        return self.gflops * factor

    def describe(self) -> str:
        """One paragraph for the profile's header."""
        lines = [
            f"peaks ({self.source}): fp32 FMA {self.gflops:.1f} GFLOP/s, memory copy "
            f"{self.gbs:.1f} GB/s, {self.threads} thread(s)"
        ]
        for dtype, (factor, why) in self.low_factors.items():
            lines.append(f"  {dtype} compute peak = {factor}x fp32 ({why})")
        return "\n".join(lines)


def _fma_func(threads: int, lanes: int, steps: int):
    @T.prim_func
    def fma(a: T.Buffer((threads, ACCUMULATORS, lanes), "float32"), x: T.Buffer((2, lanes))):
        T.func_attr({"global_symbol": "fma", "tirx.noalias": True})
        for p in T.parallel(threads):
            acc = T.alloc_buffer((ACCUMULATORS, lanes), "float32", scope="local")
            for r in T.unroll(ACCUMULATORS):
                for v in T.vectorized(lanes):
                    acc[r, v] = a[p, r, v]
            for _ in range(steps):
                for r in T.unroll(ACCUMULATORS):
                    for v in T.vectorized(lanes):
                        acc[r, v] = acc[r, v] * x[0, v] + x[1, v]
            for r in T.unroll(ACCUMULATORS):
                for v in T.vectorized(lanes):
                    a[p, r, v] = acc[r, v]

    return fma


def _copy_func(threads: int, lanes: int, floats: int):
    chunk = floats // threads // lanes

    @T.prim_func
    def copy(a: T.Buffer((threads, chunk, lanes)), b: T.Buffer((threads, chunk, lanes))):
        T.func_attr({"global_symbol": "copy", "tirx.noalias": True})
        for p in T.parallel(threads):
            for i in range(chunk):
                for v in T.vectorized(lanes):
                    b[p, i, v] = a[p, i, v]

    return copy


def low_peak_factors(features) -> dict:
    """dtype -> (factor over the fp32 FMA peak, why) for a CPU with LLVM ``features``."""
    low = {}
    for dtype, table in LOW_PEAK_FACTORS.items():
        match = next(((f, why) for feat, f, why in table if feat in features), None)
        if match is not None:
            low[dtype] = match
    return low


def _build(func, target: tvm.target.Target) -> tvm.runtime.Module:
    """Compile a peak kernel with tvmamp's TIR pipeline, as tvmamp.build compiles kernels.

    TVM's default pipeline puts the accumulators of a parallel loop on the heap
    (:mod:`tvmamp.targets.llvm_lowering`), which halved the two-thread FMA peak.
    """
    return tvm.compile(func, target=target, tir_pipeline=tir_pipeline(target)).mod


def _best_seconds(lib, name: str, args) -> float:
    lib[name](*args)  # touch the pages and warm up before timing
    timer = lib.time_evaluator(name, tvm.cpu(), number=1, repeat=5)
    return min(timer(*args).results)


@functools.lru_cache(maxsize=8)
def _measure(target_json: str, threads: int) -> Peaks:
    target = tvm.target.Target(target_json)
    features = set(target_cpu_features(target))
    lanes = 16 if "avx512f" in features else 8
    dev = tvm.cpu()
    fma = _build(_fma_func(threads, lanes, FMA_STEPS), target)
    acc = tvm.runtime.tensor(np.ones((threads, ACCUMULATORS, lanes), "float32"), dev)
    coef = tvm.runtime.tensor(np.full((2, lanes), 0.5, "float32"), dev)
    seconds = _best_seconds(fma, "fma", (acc, coef))
    gflops = 2 * threads * ACCUMULATORS * lanes * FMA_STEPS / seconds / 1e9
    copy = _build(_copy_func(threads, lanes, COPY_FLOATS), target)
    shape = (threads, COPY_FLOATS // threads // lanes, lanes)
    src, dst = (tvm.runtime.empty(shape, "float32", dev) for _ in range(2))
    seconds = _best_seconds(copy, "copy", (src, dst))
    gbs = 2 * 4 * int(np.prod(shape)) / seconds / 1e9
    low = low_peak_factors(features)
    source = f"measured here with built fp32 FMA and copy kernels, {lanes}-lane vectors"
    return Peaks(gflops, gbs, threads, source, low)


def runs_on_host(target) -> bool:
    """Whether the code built for ``target`` runs on this machine's CPU (the target entry's
    device is the host), so that its kernels can be timed and the peak kernels run there."""
    target, entry = resolve_target(target)
    return entry.device(target).dlpack_device_type() == tvm.cpu().dlpack_device_type()


def measure_peaks(target: tvm.target.Target, threads: int | None = None) -> Peaks:
    """The machine's peaks for code built for the CPU ``target`` (measured once per process).

    Parameters
    ----------
    target : tvm.target.Target
        A CPU target (its code runs on the host): the peak kernels are built for it.
    threads : int, optional
        Threads to run them on; default the TVM runtime's thread count.
    """
    if not runs_on_host(target):
        raise ValueError(
            f"tvmamp.debugging.profile: peaks can be measured for CPU targets only, not "
            f"{str(target)!r}; pass peaks=Peaks(...) for other devices"
        )
    threads = threads or tvm.runtime.num_threads()
    return _measure(str(target), threads)
