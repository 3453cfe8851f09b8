"""The LLVM (CPU) target: host CPU detection, bf16 support checks and default CPU schedules."""

from __future__ import annotations

import functools
import os
import warnings

import tvm
from tvm.target import codegen

from . import TargetEntry, register_target

# LLVM feature name -> /proc/cpuinfo flag. A candidate CPU is usable only if every one of these
# features it has is also on the host, so we never emit instructions the host lacks.
_FEATURE_FLAGS = {
    "avx2": "avx2",
    "fma": "fma",
    "f16c": "f16c",
    "avx512f": "avx512f",
    "avx512bw": "avx512bw",
    "avx512vl": "avx512vl",
    "avx512vnni": "avx512_vnni",
    "avx512bf16": "avx512_bf16",
    "avx512fp16": "avx512_fp16",
    "amx-bf16": "amx_bf16",
    "amx-fp16": "amx_fp16",
}

# Newest first: the first whose features the host has wins.
_CANDIDATE_CPUS = (
    "graniterapids",
    "sapphirerapids",
    "znver5",
    "znver4",
    "cooperlake",
    "icelake-server",
    "skylake-avx512",
    "znver3",
    "znver2",
    "haswell",
    "x86-64-v2",
)

BF16_WARNING = (
    "tvmamp: target {cpu!r} has no avx512_bf16; bf16 will be widened to fp32 in software and "
    "will likely be slower than fp32. Use dtype='float16' for halved memory traffic, or O0."
)


def _host_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


@functools.lru_cache(maxsize=1)
def host_cpu() -> str:
    """The best LLVM ``mcpu`` for this machine.

    TVM's ``mcpu=native`` silently becomes generic in this LLVM, and LLVM's own host detection
    can name an older CPU under virtualisation, so we pick the newest known CPU whose features
    are all present in ``/proc/cpuinfo``.
    """
    flags = _host_flags()
    system = codegen.llvm_get_system_cpu()
    if not flags:
        return system
    for cpu in (system, *_CANDIDATE_CPUS):
        if _cpu_fits(cpu, flags) and _covers(cpu, flags, system):
            return cpu
    return system


def _cpu_features(cpu: str) -> set[str]:
    target = tvm.target.Target({"kind": "llvm", "mcpu": cpu})
    return {f for f in _FEATURE_FLAGS if codegen.llvm_cpu_has_features([f], target)}


def _cpu_fits(cpu: str, flags: set[str]) -> bool:
    return all(_FEATURE_FLAGS[f] in flags for f in _cpu_features(cpu))


def _covers(cpu: str, flags: set[str], system: str) -> bool:
    """The system CPU is taken only if no candidate offers more of the host's features."""
    if cpu != system:
        return True
    best = max((len(_cpu_features(c)) for c in _CANDIDATE_CPUS if _cpu_fits(c, flags)), default=0)
    return len(_cpu_features(system)) >= best


def _num_cores() -> int:
    env = os.environ.get("TVM_NUM_THREADS")
    return int(env) if env and env.isdigit() else (os.cpu_count() or 1)


def make_target(options: dict) -> tvm.target.Target:
    """Build an llvm target dict from ``-key=value`` options, resolving the host CPU."""
    spec = {"kind": "llvm", "num-cores": _num_cores()}
    for key, value in options.items():
        spec[key] = int(value) if key == "num-cores" else value
    if spec.get("mcpu", "native") == "native":
        spec["mcpu"] = host_cpu()
    if "mattr" in spec and isinstance(spec["mattr"], str):
        spec["mattr"] = spec["mattr"].split(",")
    try:
        return tvm.target.Target(spec)
    except Exception as err:  # TVM's own error types vary by failure
        raise ValueError(f"tvmamp: TVM rejected llvm target options {options!r}: {err}") from None


def has_bf16(target: tvm.target.Target) -> bool:
    """Whether the target's CPU executes bf16 dot products (avx512_bf16)."""
    return bool(codegen.llvm_cpu_has_features(["avx512bf16"], target))


def default_dtype(target: tvm.target.Target) -> str:
    """bf16 where the CPU has avx512_bf16, fp16 (stored low, computed in fp32) elsewhere."""
    return "bfloat16" if has_bf16(target) else "float16"


def check(target: tvm.target.Target, dtype: str) -> None:
    """Warn when bf16 has no hardware support: users expect a speed-up and would not get one."""
    if dtype == "bfloat16" and not has_bf16(target):
        warnings.warn(BF16_WARNING.format(cpu=target.attrs.get("mcpu", "generic")), stacklevel=3)


def schedule_passes(target: tvm.target.Target) -> list:
    """dlight default schedules for CPUs, then the bf16 weight packing folded at compile time."""
    from tvmamp.schedules.cpu import cpu_schedule_passes

    return cpu_schedule_passes(target)


def partition_passes(target: tvm.target.Target, _policy) -> list:
    """Low exp/erf/tanh/gelu/softmax get vectorised fast kernels; with avx512_bf16, bf16
    convolutions become im2col + GEMM to run on the bf16 GEMM kernels."""
    from tvmamp.relay_passes.conv2d_to_gemm import Conv2dToGemm
    from tvmamp.relay_passes.fast_math import LowPrecisionFastMath

    return [LowPrecisionFastMath(), *([Conv2dToGemm("bfloat16")] if has_bf16(target) else [])]


ENTRY = register_target(
    TargetEntry(
        name="llvm",
        make_target=make_target,
        default_dtype=default_dtype,
        check=check,
        schedule_passes=schedule_passes,
        partition_passes=partition_passes,
    )
)
