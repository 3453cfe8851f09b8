"""Schedules for tvmamp: dlight rules per target family."""

from .cpu import (
    CPUConv2d,
    CPUElementwise,
    CPUMatmul,
    CPUMatmulBF16,
    CPUMatmulFP16,
    cpu_schedule_passes,
    default_cpu_rules,
)

__all__ = [
    "CPUConv2d",
    "CPUElementwise",
    "CPUMatmul",
    "CPUMatmulBF16",
    "CPUMatmulFP16",
    "cpu_schedule_passes",
    "default_cpu_rules",
]
