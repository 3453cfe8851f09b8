"""The LLVM (CPU) target: host CPU detection, bf16 support checks and default CPU schedules."""

from __future__ import annotations

import difflib
import functools
import os
import platform
import warnings

import tvm
from tvm.target import codegen

from .cpu_features import (
    AMD_ONLY,
    cpu_level_features,
    cpuinfo_flags,
    cpuinfo_vendor,
    host_cpu_features,
    physical_cores,
    vendor_levels,
)
from .cpu_guard import guard_passes
from .llvm_lowering import register_math_lowering, tir_pipeline
from .registry import DEFAULT_SPACE, DesignSpace, TargetEntry, register_target

BF16_WARNING = (
    "tvmamp: target {cpu!r} has no avx512_bf16; bf16 will be widened to fp32 in software and "
    "will likely be slower than fp32. Use dtype='float16' for halved memory traffic, or O0."
)


def _host_flags() -> set[str]:
    """The /proc/cpuinfo flags (empty without /proc/cpuinfo); tests skip on them."""
    return cpuinfo_flags() or set()


@functools.lru_cache(maxsize=1)
def host_cpu() -> str:
    """The best LLVM ``mcpu`` for this machine.

    TVM's ``mcpu=native`` silently becomes generic in this LLVM, and LLVM's own host detection
    can name an older CPU under virtualisation, so we pick the newest known CPU whose features
    (:data:`cpu_features.FEATURES`) are all present on this host (``host_cpu_features``, read
    from ``/proc/cpuinfo``), among the models of the host's vendor
    (:data:`cpu_features.CPU_LEVEL_VENDORS`). Code built for it passes the CPU feature guard on
    this host.
    """
    host = host_cpu_features()
    system = codegen.llvm_get_system_cpu()
    if host is None:
        return system
    levels = vendor_levels(cpuinfo_vendor())
    for cpu in (system, *levels):
        if _cpu_fits(cpu, host) and _covers(cpu, host, system, levels):
            return cpu
    return system


def _cpu_fits(cpu: str, host: frozenset[str]) -> bool:
    """Whether ``host`` has every feature of ``cpu`` but AMD's own extensions, which
    :func:`host_cpu_mattr` turns off where the host lacks them."""
    return set(cpu_level_features(cpu)) - set(AMD_ONLY) <= host


def host_cpu_mattr() -> list[str]:
    """``-sse4a`` and the like: AMD's own extensions that :func:`host_cpu`'s model has and this
    host does not report (an AMD guest whose hypervisor hides sse4a keeps its znver model, and
    its code passes the CPU feature guard)."""
    host = host_cpu_features()
    if host is None:
        return []
    return [f"-{f}" for f in cpu_level_features(host_cpu()) if f in AMD_ONLY and f not in host]


def _covers(cpu: str, host: frozenset[str], system: str, levels: tuple[str, ...]) -> bool:
    """The system CPU is taken only if no candidate of ``levels`` offers more of the host's
    features."""
    if cpu != system:
        return True
    fitting = (len(cpu_level_features(c)) for c in levels if _cpu_fits(c, host))
    return len(cpu_level_features(system)) >= max(fitting, default=0)


def _user_threads() -> int | None:
    """The thread count the user gave TVM's runtime (``TVM_NUM_THREADS``, else
    ``OMP_NUM_THREADS``, as the runtime reads them), or None."""
    for name in ("TVM_NUM_THREADS", "OMP_NUM_THREADS"):
        value = os.environ.get(name, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    return None


def _num_cores() -> int:
    """The default ``num-cores`` of CPU targets: the runtime's thread count."""
    return _user_threads() or physical_cores()


def set_default_threads() -> int:
    """Make TVM's runtime use every physical core unless the user chose a thread count.

    TVM's thread pool reads ``TVM_NUM_THREADS`` (else ``OMP_NUM_THREADS``) when it starts, and
    without either takes half the logical CPUs on x86: one of the two vCPUs of a VM whose vCPUs
    are cores. Called when this module is imported (with tvmamp); the CPU targets'
    ``num-cores`` matches. Returns the thread count the runtime will use.
    """
    user = _user_threads()
    if user is not None:
        return user
    cores = physical_cores()
    os.environ["TVM_NUM_THREADS"] = str(cores)
    return cores


def make_target(options: dict) -> tvm.target.Target:
    """Build an llvm target from ``-key=value`` options (or a target dict's entries).

    Without ``mcpu`` (or with ``native``) the CPU is this machine's (:func:`host_cpu`), unless
    ``mtriple`` names another architecture (a cross build, for that triple's generic CPU).
    ``num-cores`` defaults to the runtime's thread count.
    """
    spec = {"kind": "llvm", "num-cores": _num_cores()}
    for key, value in options.items():
        spec[key] = _cores(value) if key == "num-cores" else value
    _check_triple(spec.get("mtriple"))
    if spec.get("mcpu", "native") == "native":
        if _is_host_arch(spec.get("mtriple")):
            spec["mcpu"] = host_cpu()
            off = host_cpu_mattr()
            if off:
                given = spec.get("mattr", [])
                spec["mattr"] = [*(given.split(",") if isinstance(given, str) else given), *off]
        else:
            spec.pop("mcpu", None)
    if "mattr" in spec and isinstance(spec["mattr"], str):
        spec["mattr"] = spec["mattr"].split(",")
    try:
        target = tvm.target.Target(spec)
    except Exception as err:  # TVM's own error types vary by failure
        raise ValueError(f"tvmamp: TVM rejected llvm target options {options!r}: {err}") from None
    _check_cpu(target)
    return target


def _cores(value) -> int:
    """A ``num-cores`` option as a positive int (ValueError naming it otherwise)."""
    try:
        cores = int(value)
    except (TypeError, ValueError):
        cores = 0
    if cores < 1 or str(value).strip() in ("", "true"):
        raise ValueError(
            f"tvmamp: num-cores={value!r} is not a positive number of cores "
            "(give e.g. -num-cores=4, or leave it out for the runtime's thread count)"
        )
    return cores


# LLVM architectures known under other names in triples
_ARCH_ALIASES = {"amd64": "x86_64", "x86": "i386", "i486": "i386", "i586": "i386", "i686": "i386"}


def _check_triple(triple: str | None) -> None:
    """Refuse an ``mtriple`` whose architecture LLVM has no backend for: TVM's CPU list lookup
    segfaulted on ``-mtriple=garbage``."""
    if not triple:
        return
    arch = str(triple).split("-", 1)[0].lower()
    arch = _ARCH_ALIASES.get(arch, arch)
    known = [str(t) for t in codegen.llvm_get_targets()]
    # versioned names (armv7a, thumbv7em, riscv64gc) start with their backend's
    if not any(arch.startswith(name) for name in known):
        raise ValueError(
            f"tvmamp: mtriple={triple!r} names no architecture LLVM can build for (its "
            f"architecture {arch!r} is not one of {', '.join(known)}); e.g. "
            "-mtriple=x86_64-linux-gnu or aarch64-linux-gnu"
        )


def _is_host_arch(triple: str | None) -> bool:
    """Whether an ``mtriple`` (None: not given) is for this machine's architecture."""
    if not triple:
        return True
    host = platform.machine().lower().replace("amd64", "x86_64")
    return str(triple).split("-", 1)[0].replace("amd64", "x86_64") == host


def _check_cpu(target: tvm.target.Target) -> None:
    """Refuse an ``mcpu`` that LLVM does not know: LLVM only warns and compiles for a generic
    CPU, so the default dtype silently became float16 and no vector unit was used."""
    cpu = str(target.attrs.get("mcpu", "generic"))
    known = [str(c) for c in codegen.llvm_get_cpu_archlist(target)]
    if cpu == "generic" or not known or cpu in known:
        return
    close = difflib.get_close_matches(cpu, known, n=3)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    raise ValueError(
        f"tvmamp: LLVM does not know the CPU mcpu={cpu!r}{hint} (x86 examples: znver4, "
        "sapphirerapids, skylake-avx512, x86-64-v3; or leave mcpu out for this machine's CPU)"
    )


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
    """The LLVM target's graph rewrites, in order:

    - a range check on the run-time indices of every unchecked ``take`` (an embedding's
      token ids), which raises ``IndexError`` where TVM would read past the table
      (``relay_passes/take_bounds.py``);
    - ``relax.nn.attention`` (onnxruntime's fused ``Attention``) as the GEMMs and softmax
      it stands for, which the kernels below take (``relay_passes/attention_ops.py``);
    - a zero pad of a convolution's spatial axes folded into the convolution's padding
      (``relay_passes/pad_into_conv.py``);
    - 1-D convolutions as 2-D ones of height 1, 3-D ones as 2-D ones over depth windows; a
      convolution over a symbolic length, height or width as an im2col gather and a GEMM
      (``relay_passes/conv_as_gemm.py``);
    - a sequence cut into many slices (an unrolled GRU's steps) as one split, so that the
      steps share one kernel; a split feeding only elementwise ops (an LSTM's gates) as slices
      that fuse with them; a group norm as an instance norm of the tensor viewed by groups;
    - a transpose of a matmul's input rows (torch's batch-first attention) moved into the
      copies after the matmul (``relay_passes/row_layout.py``);
    - strided transposed convs as sub-pixel convs (no multiply-adds on the zeros of a dilated
      input), except the bf16 ones that the conv-to-GEMM pass runs as a GEMM plus col2im;
    - with avx512_bf16: bf16 convolutions as im2col + GEMM on NHWC rows (the bf16 GEMM
      kernels; not on Intel without AMX, :func:`convs_to_gemm`), and ``x @ W.T`` on a
      run-time bf16 weight (a training step) reading ``W`` in place;
    - with avx512_bf16: the symbolic rows of a bf16 matmul (a MoE expert's tokens, a dynamic
      sequence) padded to whole row tiles, which the bf16 GEMM kernel needs to read them in
      place (``relay_passes/symbolic_rows.py``);
    - low-precision NCHW depthwise convs left (not on rows) reading their fp32 input without a
      cast kernel;
    - with avx512_bf16: attention over a ragged number of keys (Whisper's 1500) padded to
      whole vectors of keys, which the merged scores-and-softmax kernel needs, where its
      scores are too large to stay in the cache (``relay_passes/attention_keys.py``);
    - last, exp/erf/tanh/sigmoid/silu/gelu/softmax as vectorised polynomial kernels (fp32 too:
      within 8 ulp, where TVM's libm calls run one scalar element at a time); last, so that
      the activations between convs are still ops the rows rewrite follows."""
    from tvmamp.relay_passes.attention_keys import PadAttentionKeys
    from tvmamp.relay_passes.attention_ops import DecomposeAttention
    from tvmamp.relay_passes.conv1d_as_conv2d import Conv1dAsConv2d
    from tvmamp.relay_passes.conv2d_to_gemm import Conv2dToGemm
    from tvmamp.relay_passes.conv3d_as_conv2d import Conv3dAsConv2d
    from tvmamp.relay_passes.conv_as_gemm import ConvAsGemm
    from tvmamp.relay_passes.conv_transpose import ConvTransposeToSubPixel
    from tvmamp.relay_passes.decode_step import SpecializeDecodeStep
    from tvmamp.relay_passes.depthwise_planes import DepthwisePlanes
    from tvmamp.relay_passes.fast_math import FastMath
    from tvmamp.relay_passes.group_norm_as_instance_norm import GroupNormAsInstanceNorm
    from tvmamp.relay_passes.pad_into_conv import FoldPadIntoConv
    from tvmamp.relay_passes.row_layout import SinkRowLayoutBelowMatmul
    from tvmamp.relay_passes.slices_to_split import SlicesToSplit
    from tvmamp.relay_passes.split_to_slices import SplitToSlices
    from tvmamp.relay_passes.symbolic_rows import PadSymbolicRows
    from tvmamp.relay_passes.take_bounds import GuardTakeIndices
    from tvmamp.relay_passes.weight_transpose import FuseWeightTranspose
    from tvmamp.schedules.cpu.bf16_common import bf16_dot_at_half_rate
    from tvmamp.schedules.cpu.bf16_matmul import CPUMatmulBF16
    from tvmamp.schedules.cpu.bf16_softmax import merges_columns

    tile = CPUMatmulBF16.Config().tile_i
    gemm = None
    if has_bf16(target) and convs_to_gemm(target):
        # convs over a symbolic batch or image size: the GEMM over symbolic rows runs on
        # vdpbf16ps, not AMX, so where vdpbf16ps runs at half the fp32 rate (Intel) the direct
        # conv's FMAs (ConvAsGemm's GEMMs, for symbolic image sizes) win
        gemm = Conv2dToGemm("bfloat16", row_tile=None if bf16_dot_at_half_rate(target) else tile)
    first = [
        SpecializeDecodeStep(),
        GuardTakeIndices(),
        DecomposeAttention(),
        FoldPadIntoConv(),
        Conv1dAsConv2d(),
        ConvAsGemm(tile, leave=gemm.rewrites if gemm is not None else None),  # gemm's on rows
        Conv3dAsConv2d(),
        SlicesToSplit(),
        SplitToSlices(),
    ]
    first += [GroupNormAsInstanceNorm(), SinkRowLayoutBelowMatmul()]
    if not has_bf16(target):
        return [*first, ConvTransposeToSubPixel(), DepthwisePlanes(), FastMath()]
    symbolic = PadSymbolicRows(tile)
    if gemm is not None:
        sub_pixel = ConvTransposeToSubPixel(leave=gemm.rewrites)  # what gemm runs on rows
        rows = [sub_pixel, gemm, FuseWeightTranspose(), symbolic, DepthwisePlanes()]
    else:
        rows = [ConvTransposeToSubPixel(), FuseWeightTranspose(), symbolic, DepthwisePlanes()]
    keys = PadAttentionKeys(lambda extents: merges_columns(target, extents))
    # FastMath last: activations are still ops on the rows
    return [*first, *rows, keys, FastMath()]


def convs_to_gemm(target: tvm.target.Target) -> bool:
    """Whether bf16 convs become im2col + GEMM on rows: with avx512_bf16, except on a CPU
    without AMX whose ``vdpbf16ps`` runs at half the fp32 FMA rate (Intel's), where the conv
    GEMM, its gather fused, would run on ``vdpbf16ps``; the direct conv's fp32 FMAs are faster."""
    from tvmamp.schedules.cpu.bf16_common import bf16_dot_at_half_rate, has_amx_bf16

    return has_bf16(target) and (has_amx_bf16(target) or not bf16_dot_at_half_rate(target))


def legalize_rules(_target: tvm.target.Target) -> dict:
    """Instance and layer norms, and fp32 row sums, means and variances, over trailing axes,
    legalized with sums of whole vectors and a tail, which the CPU row-reduction rule
    vectorises, and a variance that does not cancel (``relay_passes/row_norms.py``)."""
    from tvmamp.relay_passes.row_norms import LEGALIZE_MAP

    return dict(LEGALIZE_MAP)


def fusion_passes(target: tvm.target.Target) -> list:
    """With avx512_bf16: attention's scores kernel merged with its softmax, where the bf16 CPU
    rule schedules the pair as one (``schedules/cpu/bf16_softmax.py``); then the head split's
    copies merged into each other and into the packing of the GEMMs that read them as ``B``
    (``relay_passes/gemm_layout.py``)."""
    from tvmamp.relay_passes.gemm_layout import FuseLayoutIntoGemm
    from tvmamp.relay_passes.gemm_softmax import FuseGemmSoftmax
    from tvmamp.schedules.cpu.bf16_softmax import schedules, schedules_gemm

    if not has_bf16(target):
        return []
    return [
        FuseGemmSoftmax(lambda kernel: schedules(target, kernel)),
        FuseLayoutIntoGemm(lambda kernel: schedules_gemm(target, kernel)),
    ]


def intrinsic_families(target: tvm.target.Target) -> tuple[str, ...]:
    """The ``tvm.s_tir.tensor_intrin`` family of the target's CPU, from its triple."""
    triple = str(target.attrs.get("mtriple", ""))
    if triple.startswith(("aarch64", "arm")):
        return ("arm_cpu",)
    return ("riscv_cpu",) if triple.startswith("riscv") else ("x86",)


BF16_SPACE = "bf16-gemm"


def design_space(mod: tvm.IRModule, target: tvm.target.Target) -> DesignSpace:
    """tvmamp's vdpbf16ps/AMX space for the kernels its default bf16 rules schedule.

    That is a static bf16 x bf16 -> fp32 matmul, dense or batch-matmul on a CPU with
    avx512_bf16, or attention's merged scores and softmax (``schedules/cpu/bf16_softmax.py``);
    its distinct configurations are few, so each is measured once. Other kernels get
    meta_schedule's own space.
    """
    from tvmamp.schedules.cpu import has_avx512bf16
    from tvmamp.schedules.cpu.bf16_tuning import (
        bf16_matmul_spaces,
        distinct_choices,
        is_bf16_gemm,
        space_version,
    )

    func = mod["main"]
    if not has_avx512bf16(target) or not is_bf16_gemm(func, target):
        return DEFAULT_SPACE
    name = f"{BF16_SPACE}:{space_version(target)}"  # a log from another version is not replayed
    return DesignSpace(name, len(distinct_choices(func, target)), bf16_matmul_spaces)


def register_log_intrinsics(records_text: str) -> None:
    """Register the vdpbf16ps and AMX intrinsics that a tuning log's traces name.

    tvmamp's bf16 kernels register their intrinsics lazily, so a fresh process must register
    them before TVM replays the log's traces.
    """
    if "tvmamp_" not in records_text:
        return
    from tvmamp.schedules.x86 import amx_intrin, bf16_intrin

    bf16_intrin.register()
    for cols, k, scope in sorted(set(amx_intrin.NAME_PATTERN.findall(records_text))):
        amx_intrin.amx_intrin(int(k), scope, int(cols) // amx_intrin.COLS)


ENTRY = register_target(
    TargetEntry(
        name="llvm",
        make_target=make_target,
        default_dtype=default_dtype,
        check=check,
        schedule_passes=schedule_passes,
        partition_passes=partition_passes,
        legalize_rules=legalize_rules,
        fusion_passes=fusion_passes,
        finalize_passes=guard_passes,
        intrinsic_families=intrinsic_families,
        design_space=design_space,
        register_log_intrinsics=register_log_intrinsics,
        tir_pipeline=tir_pipeline,
        meta_schedule_build="tvmamp.meta_schedule.llvm_build",
    )
)

register_math_lowering()
# Before TVM's thread pool starts (it starts on the first parallel kernel): every physical core.
set_default_threads()
