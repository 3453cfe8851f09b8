"""NPU target entries: the AMP limits, BYOC partition passes and host schedules of an NPU."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import tvm
from tvm import relax

from tvmamp.policy import DEFAULT_CATEGORIES, Category, Policy

from .. import llvm as host
from ..registry import TargetEntry, register_target
from .codegen import make_codegen
from .descriptor import DATA_MOVEMENT_OPS, NpuDescriptor
from .fallback import HostFallback
from .patterns import pattern_table
from .report import PartitionReport, analyze

COMPUTE = (Category.WHITE, Category.FOLLOW, Category.PROMOTE)

# Descriptor name -> descriptor, for finding the NPU of a built target (its keys name it).
NPUS: dict[str, NpuDescriptor] = {}


@dataclasses.dataclass(frozen=True)
class NpuTargetEntry(TargetEntry):
    """A TargetEntry that also knows its NPU descriptor and can report a partition."""

    descriptor: NpuDescriptor | None = None

    def partition_report(self, target, policy: Policy, mod: tvm.IRModule) -> PartitionReport:
        """The partition a build of the converted ``mod`` makes (no codegen is run)."""
        return partition_report_for(self.descriptor, policy, mod)


def check_dtype(desc: NpuDescriptor, dtype: str) -> None:
    """A low dtype the NPU cannot compute in is an error, not a silent host fallback."""
    if dtype not in desc.dtypes:
        raise ValueError(
            f"tvmamp.targets.npu: {desc.name} supports only {', '.join(desc.dtypes)}; "
            f"dtype {dtype!r} was requested. Use dtype={desc.dtypes[0]!r}, or target 'llvm' "
            f"to run {dtype} on the host CPU"
        )


def unsupported_ops(desc: NpuDescriptor) -> tuple[str, ...]:
    """Float compute ops the NPU cannot run: they stay fp32 on the host (data movement aside)."""
    keep = set(desc.runnable_ops()) | set(DATA_MOVEMENT_OPS)
    return tuple(
        sorted(op for op, c in DEFAULT_CATEGORIES.items() if c in COMPUTE and op not in keep)
    )


def partition_report_for(desc: NpuDescriptor, policy: Policy | None, mod) -> PartitionReport:
    """Run the pattern table on a converted module and report where each op would run."""
    with tvm.transform.PassContext(opt_level=0):
        fused = _fuse(desc, policy)(mod)
    return analyze(fused, desc, policy)


def _fuse(desc: NpuDescriptor, policy: Policy | None) -> tvm.transform.Pass:
    return relax.transform.FuseOpsByPattern(
        pattern_table(desc, policy),
        bind_constants=False,
        annotate_codegen=not desc.merge_regions,
    )


def partition_passes(desc: NpuDescriptor, policy: Policy) -> list:
    """BYOC: patterns, host fallback to fp32, merge neighbouring regions, then codegen."""
    merge = [relax.transform.MergeCompositeFunctions()] if desc.merge_regions else []
    return [
        _fuse(desc, policy),
        HostFallback(desc, policy),
        *merge,
        relax.transform.RunCodegen(),
    ]


def _make_target(desc: NpuDescriptor, options: dict) -> tvm.target.Target:
    """The host llvm target (its options), with the NPU's name added to its keys."""
    spec = dict(host.make_target(dict(options)).export())
    spec["keys"] = [desc.name, *spec.get("keys", ("cpu",))]
    spec.pop("tag", None)
    return tvm.target.Target(spec)


def make_entry(name: str, desc: NpuDescriptor) -> NpuTargetEntry:
    """The TargetEntry of an NPU: host target, schedules and tuning; NPU dtypes, partitioning."""

    def unsupported_low_ops(target, dtype):
        check_dtype(desc, dtype)  # also at O0, where the entry's check is not called
        return unsupported_ops(desc)

    return NpuTargetEntry(
        name=name,
        make_target=lambda options: _make_target(desc, options),
        default_dtype=lambda target: desc.dtypes[0],
        check=lambda target, dtype: check_dtype(desc, dtype),
        schedule_passes=host.schedule_passes,
        finalize_passes=host.guard_passes,
        intrinsic_families=host.intrinsic_families,
        design_space=host.design_space,
        register_log_intrinsics=host.register_log_intrinsics,
        tir_pipeline=host.tir_pipeline,
        meta_schedule_build=host.ENTRY.meta_schedule_build,
        unsupported_low_ops=unsupported_low_ops,
        # The NPU computes in its low dtypes only: an op O2 kept fp32 to save a round trip
        # would leave a fused conv/dense composite for the host.
        fp32_feeds=False,
        partition_passes=lambda target, policy: partition_passes(desc, policy),
        descriptor=desc,
    )


def register_npu(
    name: str,
    descriptor: NpuDescriptor,
    codegen: Callable | None = None,
    *,
    override: bool = False,
) -> NpuTargetEntry:
    """Register an NPU as tvmamp target ``name`` (``tvmamp.build(mod, target=name)``).

    Parameters
    ----------
    name : str
        The target name users write ("npu", "my_npu -num-cores=1").
    descriptor : NpuDescriptor
        The NPU's limits; ``descriptor.name`` names its codegen (``relax.ext.<name>``).
    codegen : callable, optional
        ``(functions, options, constant_names) -> [runtime.Module]``; by default the reference
        C++ codegen, which needs an fp16 descriptor.
    override : bool
        Replace an NPU or target already registered under these names.
    """
    if not isinstance(descriptor, NpuDescriptor):
        raise TypeError(
            f"tvmamp.register_npu: descriptor must be an NpuDescriptor, got {descriptor!r}"
        )
    if codegen is None and descriptor.dtypes != ("float16",):
        raise ValueError(
            f"tvmamp.register_npu: the reference codegen runs float16 only; {descriptor.name} "
            f"declares {descriptor.dtypes}. Pass your own codegen"
        )
    if descriptor.name in NPUS and not override and NPUS[descriptor.name] != descriptor:
        raise ValueError(f"tvmamp.register_npu: NPU {descriptor.name!r} is already registered")
    entry = register_target(make_entry(name, descriptor), override=override)
    tvm.register_global_func(
        f"relax.ext.{descriptor.name}", codegen or make_codegen(descriptor.name), override=True
    )
    NPUS[descriptor.name] = descriptor
    return entry
