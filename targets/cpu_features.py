"""x86 CPU features: which ISA extensions an LLVM target's code may use, and which this host has.

One table, read by three users: the LLVM target entry (which CPU ``"llvm"`` resolves to), the
CPU feature guard compiled into exported libraries (CPUID bits, in C), and the checks in Python
(``Executable``, ``tvmamp run``). A feature is listed only if LLVM may emit its instructions
from the code TVM generates; CPU tuning flags and system instructions are left out.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import os

import tvm
from tvm.target import codegen

# XCR0 state components the OS must enable before the registers can be used.
YMM_STATE = 0x6  # SSE + AVX (ymm upper halves)
ZMM_STATE = 0xE6  # + opmask, zmm0-15 upper halves, zmm16-31
TMM_STATE = 0x60000  # AMX tile config and tile data


@dataclasses.dataclass(frozen=True)
class CpuFeature:
    """An ISA extension: its LLVM name, /proc/cpuinfo flag and CPUID bit."""

    name: str
    flag: str
    leaf: int
    subleaf: int
    register: int  # 0 eax, 1 ebx, 2 ecx, 3 edx
    bit: int
    xcr0: int = 0


EAX, EBX, ECX, EDX = range(4)
EXT = 0x80000001

FEATURES: tuple[CpuFeature, ...] = (
    CpuFeature("sse3", "pni", 1, 0, ECX, 0),
    CpuFeature("ssse3", "ssse3", 1, 0, ECX, 9),
    CpuFeature("fma", "fma", 1, 0, ECX, 12, YMM_STATE),
    CpuFeature("cx16", "cx16", 1, 0, ECX, 13),
    CpuFeature("sse4.1", "sse4_1", 1, 0, ECX, 19),
    CpuFeature("sse4.2", "sse4_2", 1, 0, ECX, 20),
    CpuFeature("movbe", "movbe", 1, 0, ECX, 22),
    CpuFeature("popcnt", "popcnt", 1, 0, ECX, 23),
    CpuFeature("avx", "avx", 1, 0, ECX, 28, YMM_STATE),
    CpuFeature("f16c", "f16c", 1, 0, ECX, 29, YMM_STATE),
    CpuFeature("bmi", "bmi1", 7, 0, EBX, 3),
    CpuFeature("avx2", "avx2", 7, 0, EBX, 5, YMM_STATE),
    CpuFeature("bmi2", "bmi2", 7, 0, EBX, 8),
    CpuFeature("avx512f", "avx512f", 7, 0, EBX, 16, ZMM_STATE),
    CpuFeature("avx512dq", "avx512dq", 7, 0, EBX, 17, ZMM_STATE),
    CpuFeature("avx512ifma", "avx512ifma", 7, 0, EBX, 21, ZMM_STATE),
    CpuFeature("avx512cd", "avx512cd", 7, 0, EBX, 28, ZMM_STATE),
    CpuFeature("avx512bw", "avx512bw", 7, 0, EBX, 30, ZMM_STATE),
    CpuFeature("avx512vl", "avx512vl", 7, 0, EBX, 31, ZMM_STATE),
    CpuFeature("avx512vbmi", "avx512vbmi", 7, 0, ECX, 1, ZMM_STATE),
    CpuFeature("avx512vbmi2", "avx512_vbmi2", 7, 0, ECX, 6, ZMM_STATE),
    CpuFeature("gfni", "gfni", 7, 0, ECX, 8),
    CpuFeature("avx512vnni", "avx512_vnni", 7, 0, ECX, 11, ZMM_STATE),
    CpuFeature("avx512bitalg", "avx512_bitalg", 7, 0, ECX, 12, ZMM_STATE),
    CpuFeature("avx512vpopcntdq", "avx512_vpopcntdq", 7, 0, ECX, 14, ZMM_STATE),
    CpuFeature("amx-bf16", "amx_bf16", 7, 0, EDX, 22, TMM_STATE),
    CpuFeature("avx512fp16", "avx512_fp16", 7, 0, EDX, 23, ZMM_STATE),
    CpuFeature("amx-tile", "amx_tile", 7, 0, EDX, 24, TMM_STATE),
    CpuFeature("amx-int8", "amx_int8", 7, 0, EDX, 25, TMM_STATE),
    CpuFeature("avxvnni", "avx_vnni", 7, 1, EAX, 4, YMM_STATE),
    CpuFeature("avx512bf16", "avx512_bf16", 7, 1, EAX, 5, ZMM_STATE),
    CpuFeature("amx-fp16", "amx_fp16", 7, 1, EAX, 21, TMM_STATE),
    CpuFeature("avxifma", "avx_ifma", 7, 1, EAX, 23, YMM_STATE),
    CpuFeature("avxvnniint8", "avx_vnni_int8", 7, 1, EDX, 4, YMM_STATE),
    CpuFeature("avxneconvert", "avx_ne_convert", 7, 1, EDX, 5, YMM_STATE),
    CpuFeature("amx-complex", "amx_complex", 7, 1, EDX, 8, TMM_STATE),
    CpuFeature("avxvnniint16", "avx_vnni_int16", 7, 1, EDX, 10, YMM_STATE),
    CpuFeature("sahf", "lahf_lm", EXT, 0, ECX, 0),
    CpuFeature("lzcnt", "abm", EXT, 0, ECX, 5),
    CpuFeature("prfchw", "3dnowprefetch", EXT, 0, ECX, 8),
    # AMD's own extensions, which no Intel CPU has. LLVM's znver models use sse4a's insertq for
    # byte shuffles: a torch attention's bool-mask kernel built for znver4 held it and stopped an
    # Emerald Rapids with SIGILL (2026-11-28). xop, fma4 and tbm are the bdver models'.
    CpuFeature("sse4a", "sse4a", EXT, 0, ECX, 6),
    CpuFeature("xop", "xop", EXT, 0, ECX, 11, YMM_STATE),
    CpuFeature("fma4", "fma4", EXT, 0, ECX, 16, YMM_STATE),
    CpuFeature("tbm", "tbm", EXT, 0, ECX, 21),
)
FEATURE_NAMES = tuple(f.name for f in FEATURES)
# AMD's own extensions: a host CPU model may be taken without them (``-mattr=-sse4a``), where a
# hypervisor hides them from an AMD guest (targets/llvm.host_cpu).
AMD_ONLY = ("sse4a", "xop", "fma4", "tbm")

# CPU levels, newest first, for "rebuild for this machine": the first whose features the host has.
CPU_LEVELS = (
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
    "x86-64-v3",
    "x86-64-v2",
    "x86-64",
)
INTEL, AMD = "GenuineIntel", "AuthenticAMD"
# The vendor of each vendor-specific model of CPU_LEVELS (the x86-64 levels are neutral). A host
# is given its own vendor's models only: LLVM's znver models tune for AMD's pipelines, and the
# bf16 rules choose kernels by vendor (schedules/cpu/bf16_common.bf16_dot_at_half_rate). (An
# Intel Xeon whose AMX the hypervisor hides had every feature of znver5 until AMD's sse4a
# joined FEATURES.)
CPU_LEVEL_VENDORS = {
    **dict.fromkeys(("graniterapids", "sapphirerapids", "cooperlake", "icelake-server"), INTEL),
    **dict.fromkeys(("skylake-avx512", "haswell"), INTEL),
    **dict.fromkeys(("znver5", "znver4", "znver3", "znver2"), AMD),
}

GUARD_MESSAGE = (
    "tvmamp: this code was compiled for target '{target}', which uses CPU features this machine "
    "lacks: {missing}. Running it would stop the process with an illegal instruction (SIGILL). "
    "Rebuild it for this machine (target 'llvm -mcpu={suggest}') or for a CPU subset all your "
    "machines share, such as 'llvm -mcpu=x86-64-v3' (AVX2); see docs/DEPLOYMENT.md"
)


def _cpuinfo_field(key: str) -> str | None:
    """The value of the first ``key`` line of /proc/cpuinfo; None without it."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name.strip() == key:
                    return value.strip()
    except OSError:
        return None
    return None


def cpuinfo_flags() -> set[str] | None:
    """The ``flags`` line of /proc/cpuinfo (the kernel hides what the OS cannot run); None if
    there is no /proc/cpuinfo."""
    flags = _cpuinfo_field("flags")
    return None if flags is None else set(flags.split())


def cpuinfo_vendor() -> str | None:
    """The ``vendor_id`` of /proc/cpuinfo (:data:`INTEL`, :data:`AMD`, ...); None without it."""
    return _cpuinfo_field("vendor_id")


def vendor_levels(vendor: str | None) -> tuple[str, ...]:
    """:data:`CPU_LEVELS` without the models of vendors other than ``vendor`` (all for None)."""
    if vendor is None:
        return CPU_LEVELS
    return tuple(c for c in CPU_LEVELS if CPU_LEVEL_VENDORS.get(c, vendor) == vendor)


def physical_cores() -> int:
    """Cores (not SMT threads) this process may run on, from /proc/cpuinfo and its affinity.

    TVM's runtime, left to itself, takes half the logical CPUs of an x86 host (it assumes two
    hardware threads per core), which leaves half of a VM whose vCPUs are whole cores idle.
    Falls back to ``os.cpu_count()`` where /proc/cpuinfo has no topology.
    """
    allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    cores, processor, package = set(), None, "0"
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = (part.strip() for part in line.partition(":"))
                if key == "processor":
                    processor = int(value)
                elif key == "physical id":
                    package = value
                elif key == "core id" and (allowed is None or processor in allowed):
                    cores.add((package, value))
    except (OSError, ValueError):
        cores = set()
    return len(cores) or len(allowed or ()) or os.cpu_count() or 1


def _amx_permitted() -> bool:
    """Linux hands AMX tile state to a process only on request (``arch_prctl``, kernel 5.16+)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return False
    arch_prctl, req_xcomp_perm, xfeature_xtiledata = 158, 0x1023, 18
    return libc.syscall(arch_prctl, req_xcomp_perm, xfeature_xtiledata) == 0


@functools.lru_cache(maxsize=1)
def host_cpu_features() -> frozenset[str] | None:
    """The LLVM names of the :data:`FEATURES` this machine can run, or None when unknown.

    Read from /proc/cpuinfo (Linux reports only what the CPU has and the OS enabled); the AMX
    features also need this process's permission, which is requested here once.
    """
    flags = cpuinfo_flags()
    if flags is None:
        return None
    have = {f.name for f in FEATURES if f.flag in flags}
    if any(f.xcr0 == TMM_STATE for f in FEATURES if f.name in have) and not _amx_permitted():
        have -= {f.name for f in FEATURES if f.xcr0 == TMM_STATE}
    return frozenset(have)


@functools.lru_cache(maxsize=256)
def _llvm_features(target_json: str) -> tuple[str, ...]:
    enabled = codegen.llvm_get_cpu_features(tvm.target.Target(target_json))
    return tuple(name for name in FEATURE_NAMES if name in enabled)


def target_cpu_features(target: tvm.target.Target) -> tuple[str, ...]:
    """The :data:`FEATURES` the code compiled for an llvm ``target`` may use (its mcpu and
    mattr), in table order; () for other target kinds."""
    if target.kind.name != "llvm":
        return ()
    return _llvm_features(str(target))


def cpu_level_features(cpu: str) -> tuple[str, ...]:
    """The :data:`FEATURES` of LLVM's CPU model ``cpu`` (e.g. "znver4")."""
    return _llvm_features(str(tvm.target.Target({"kind": "llvm", "mcpu": cpu})))


def suggest_cpu(host: frozenset[str], vendor: str | None = None) -> str:
    """The newest of :data:`CPU_LEVELS` of ``vendor`` (any vendor for None) whose features are
    all in ``host``."""
    for cpu in vendor_levels(vendor):
        if set(cpu_level_features(cpu)) <= host:
            return cpu
    return "x86-64"


def describe_target(target: tvm.target.Target) -> str:
    """The target as a tvmamp target string: ``llvm -mcpu=znver4 -mattr=+avx512f``."""
    words = [target.kind.name]
    mcpu = target.attrs.get("mcpu")
    if mcpu:
        words.append(f"-mcpu={mcpu}")
    mattr = target.attrs.get("mattr")
    if mattr:
        words.append("-mattr=" + ",".join(str(a) for a in mattr))
    return " ".join(words)


def missing_message(target: str, missing, host: frozenset[str]) -> str:
    """The guard's error message (the C guard in exported libraries prints the same)."""
    return GUARD_MESSAGE.format(
        target=target, missing=", ".join(missing), suggest=suggest_cpu(host, cpuinfo_vendor())
    )


def missing_cpu_features(features, host: frozenset[str] | None = None) -> tuple[str, ...]:
    """Those of ``features`` (LLVM names) the host lacks; () when the host is unknown."""
    host = host_cpu_features() if host is None else host
    if host is None:
        return ()
    return tuple(name for name in features if name not in host)


def check_cpu_features(target: tvm.target.Target | str, features=None) -> None:
    """Raise RuntimeError (the guard's message) if this host lacks a feature the code needs.

    ``target`` is a tvm Target (its features are read from LLVM) or, with ``features``, the
    target string recorded in an exported library.
    """
    if features is None:
        features = target_cpu_features(target)
        target = describe_target(target)
    missing = missing_cpu_features(features)
    if missing:
        raise RuntimeError(missing_message(target, missing, host_cpu_features()))


__all__ = [
    "CPU_LEVELS",
    "FEATURES",
    "CpuFeature",
    "check_cpu_features",
    "cpu_level_features",
    "describe_target",
    "host_cpu_features",
    "missing_cpu_features",
    "suggest_cpu",
    "target_cpu_features",
]
