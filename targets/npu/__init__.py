"""NPUs through BYOC: the reference fp16 NPU "tvmamp_npu" (target "npu") and register_npu.

An NPU is data (an :class:`NpuDescriptor`: dtypes, ops, fused patterns, shape limits) plus a
codegen registered as ``relax.ext.<name>``. ``tvmamp.build(mod, level="O2", target="npu")``
runs the AMP pass with the NPU's limits (what it cannot run stays fp32 on the host), partitions
with ``FuseOpsByPattern`` / ``MergeCompositeFunctions`` / ``RunCodegen``, and compiles the rest
for the host CPU with tvmamp's CPU schedules. :func:`partition_report` says what ran where.
"""

from __future__ import annotations

from .codegen import generate_source, make_codegen
from .descriptor import KNOWN_FUSED, KNOWN_OPS, TVMAMP_NPU, NpuDescriptor
from .entry import NPUS, NpuTargetEntry, partition_report_for, register_npu
from .patterns import pattern_table
from .report import PartitionReport, Placement


def partition_report(exe) -> PartitionReport:
    """Where each op of a built (or converted) NPU model runs, and why ops stayed on the host.

    Parameters
    ----------
    exe : tvmamp.Executable or tvmamp.Converted
        Built or converted for an NPU target (its target keys name the NPU).
    """
    names = [str(k) for k in exe.target.keys if str(k) in NPUS]
    if not names:
        raise ValueError(
            f"tvmamp.targets.npu.partition_report: target {exe.target} is not an NPU target; "
            f"registered NPUs: {', '.join(sorted(NPUS))}"
        )
    return partition_report_for(NPUS[names[0]], exe.policy, exe.mod)


ENTRY = register_npu("npu", TVMAMP_NPU)

__all__ = [
    "KNOWN_FUSED",
    "KNOWN_OPS",
    "NPUS",
    "TVMAMP_NPU",
    "NpuDescriptor",
    "NpuTargetEntry",
    "PartitionReport",
    "Placement",
    "generate_source",
    "make_codegen",
    "partition_report",
    "pattern_table",
    "register_npu",
]
