"""The CUDA target: arch parsing, named GPUs, compute-capability checks, tensor-core phases."""

from __future__ import annotations

import json
import re
import warnings

import tvm

from tvmamp.schedules.cuda import compute_capability, default_cuda_rules

from .registry import LLVM_SOURCES, SourceFormat, TargetEntry, register_target

# Short names users write -> TVM target tags.
GPU_TAGS = {
    "nvidia/a100": "nvidia/nvidia-a100",
    "nvidia/h100": "nvidia/nvidia-h100",
    "nvidia/v100": "nvidia/nvidia-v100",
    "nvidia/t4": "nvidia/nvidia-t4",
    "nvidia/rtx4090": "nvidia/geforce-rtx-4090",
}

AMP_CC_WARNING = (
    "AMP only support NVIDIA GPU with Compute Capability 7.0 or higher, current GPU is: {arch}"
)


def _local_arch() -> str | None:
    dev = tvm.cuda(0)
    if not dev.exist:
        return None
    return "sm_" + dev.compute_version.replace(".", "")


def make_target(options: dict) -> tvm.target.Target:
    """A cuda target from options; a named GPU ("nvidia/a100") or the local GPU's arch."""
    tag = options.pop("tag", None)
    if tag is not None:
        full = GPU_TAGS.get(tag, tag)
        if full not in tvm.target.list_tags():
            known = ", ".join(sorted(GPU_TAGS))
            raise ValueError(f"tvmamp: unknown GPU {tag!r}; known names: {known}")
        spec = dict(tvm.target.Target(full).export())
    else:
        spec = {"kind": "cuda"}
    spec.update(options)
    if "arch" not in spec:
        spec["arch"] = _local_arch() or "sm_80"
    if not re.fullmatch(r"sm_\d+[a-z]?", str(spec["arch"])):
        raise ValueError(f"tvmamp: CUDA arch {spec['arch']!r} is not of the form sm_XY (sm_80)")
    spec.setdefault("host", {"kind": "llvm"})
    return tvm.target.Target(spec)


def default_dtype(target: tvm.target.Target) -> str:
    """fp16 on CUDA (tensor cores from sm_70)."""
    return "float16"


def check(target: tvm.target.Target, dtype: str) -> None:
    """Paddle's warning below sm_70; bf16 needs sm_80."""
    cc = compute_capability(target)
    arch = target.attrs.get("arch")
    if cc < 70:
        warnings.warn(AMP_CC_WARNING.format(arch=arch), stacklevel=3)
    if dtype == "bfloat16" and cc < 80:
        raise ValueError(
            f"tvmamp: bfloat16 needs compute capability 8.0 (sm_80) or higher; target arch is "
            f"{arch}. Use dtype='float16' or a newer GPU."
        )


def schedule_passes(target: tvm.target.Target) -> list:
    """tvmamp's tensor-core rule first, then TVM's dlight GPU rules for everything else."""
    from tvm.s_tir import dlight as dl

    return [dl.ApplyDefaultSchedule(*default_cuda_rules(target))]


def partition_passes(target: tvm.target.Target, policy) -> list:
    """Layout and padding for tensor cores: NHWC conv2d, M/N/K and channels padded to 8 or 16.

    Both passes touch only ops whose inputs are in the policy's low dtype, so O0 and fp32 ops
    are compiled as they are.
    """
    from tvmamp.relay_passes.nhwc_layout import ConvertConvToNHWC
    from tvmamp.relay_passes.tensor_core_padding import TensorCorePadding, tensor_core_multiple

    low = (policy.low_dtype,)
    multiple = tensor_core_multiple(compute_capability(target))
    return [ConvertConvToNHWC(dtypes=low), TensorCorePadding(multiple, dtypes=low)]


def pass_config(target: tvm.target.Target) -> dict:
    """PassContext options for CUDA builds: cp.async global -> shared copies from sm_80.

    The tensor-core rule pipelines its shared-memory copies; with ``tirx.use_async_copy`` TVM
    turns them into ``cp.async`` (Ampere's asynchronous copy). ``tvmamp.build`` applies these
    options through the target entry's ``pass_config``.
    """
    return {"tirx.use_async_copy": compute_capability(target) >= 80}


# GPU limits meta_schedule's CUDA rules need and plain "cuda -arch=sm_XY" targets lack: the
# values every NVIDIA GPU since sm_30 supports (48 KB is the most without opt-in shared memory).
GPU_LIMITS = {"max_threads_per_block": 1024, "max_shared_memory_per_block": 49152}


def tuning_target(target: tvm.target.Target) -> tuple[tvm.target.Target, list[str]]:
    """The target meta_schedule tunes for: ``target`` plus GPU limits it may lack, and a note."""
    spec = json.loads(str(target))
    missing = {k: v for k, v in GPU_LIMITS.items() if k not in spec}
    if not missing:
        return target, []
    spec.update(missing)
    assumed = ", ".join(f"{k}={v}" for k, v in missing.items())
    note = f"tuned assuming {assumed}; name the GPU (e.g. nvidia/a100) for its exact limits"
    return tvm.target.Target(spec), [note]


def intrinsic_families(target: tvm.target.Target) -> tuple[str, ...]:
    """TVM's CUDA tensor intrinsics; none below sm_75, where meta_schedule's rules use none."""
    return () if compute_capability(target) < 75 else ("cuda",)


def cuda_to_ptx(target: tvm.target.Target, source: str) -> str:
    """PTX of the CUDA source, compiled by nvcc for the target's arch (no GPU needed)."""
    from tvm.support import nvcc

    arch = str(target.attrs.get("arch", "sm_80"))
    with target:  # nvcc reads the compute version from the current target
        ptx = nvcc.compile_cuda(source, "ptx", arch, compiler="nvcc")
    return ptx if isinstance(ptx, str) else bytes(ptx).decode()


# Host code (LLVM), the kernels' CUDA source and their PTX.
SOURCES = {
    **LLVM_SOURCES,
    "cuda": SourceFormat("cuda", "cuda"),
    "ptx": SourceFormat("cuda", "cuda", convert=cuda_to_ptx),
}


ENTRY = register_target(
    TargetEntry(
        name="cuda",
        make_target=make_target,
        default_dtype=default_dtype,
        check=check,
        schedule_passes=schedule_passes,
        partition_passes=partition_passes,
        pass_config=pass_config,
        source_formats=SOURCES,
        tuning_target=tuning_target,
        intrinsic_families=intrinsic_families,
    )
)
