"""The default (untuned) tvmamp schedule rules for CPU (``llvm``) targets."""

from __future__ import annotations

from tvm.s_tir import dlight as dl
from tvm.target import Target

from .cpu_conv import CPUConv2d
from .cpu_elementwise import CPUElementwise
from .cpu_matmul import CPUMatmul
from .guard import Guarded

__all__ = ["CPUConv2d", "CPUElementwise", "CPUMatmul", "default_cpu_rules"]


def default_cpu_rules(target: Target) -> list[dl.ScheduleRule]:
    """Return the default schedule rules for ``target``, most specific first.

    Parameters
    ----------
    target : Target
        An ``llvm`` target; its ``mcpu``/``mattr`` pick the SIMD width and its
        ``num-cores`` whether loops run in parallel.

    Returns
    -------
    rules : list[tvm.s_tir.dlight.ScheduleRule]
        Matmul, conv2d, injective, then TVM's ``dlight.cpu`` GEMV and Reduction; use them as
        ``dl.ApplyDefaultSchedule(*rules)`` under ``with target:``.

    Raises
    ------
    ValueError
        When ``target`` is not an ``llvm`` target.
    """
    if target.kind.name != "llvm":
        raise ValueError(
            f"tvmamp.schedules.default_cpu_rules: target kind {target.kind.name!r} is not 'llvm'"
        )
    rules = [CPUMatmul(), CPUConv2d(), CPUElementwise(), dl.cpu.GEMV(), dl.cpu.Reduction()]
    return [Guarded(rule) for rule in rules]
