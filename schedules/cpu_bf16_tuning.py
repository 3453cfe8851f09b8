"""meta_schedule glue for the bf16 CPU kernels: a design space whose tiles tuning chooses.

The space runs :func:`.cpu_bf16_matmul.schedule_matmul` with a :class:`CPUMatmulBF16.Config`
drawn by ``sample_categorical`` from :data:`TILE_CHOICES`. The sampled value steers Python-level
decisions (padding, packing), so the space must be searched with ``ReplayFunc``, which re-runs
the schedule function for every candidate::

    from tvm.s_tir import meta_schedule as ms
    ms.tir_integration.tune_tir(func, target, work_dir, max_trials_global=16,
                                space=bf16_matmul_space(), strategy="replay-func")

Tuned records are applied by ``MetaScheduleApplyDatabase`` like any other; tvmamp's llvm target
then runs :class:`.cpu_bf16_passes.SplitPreproc` on them too.
"""

from __future__ import annotations

import dataclasses

from tvm import s_tir
from tvm.s_tir import meta_schedule as ms
from tvm.target import Target

from .cpu_bf16_common import is_bf16_matmul
from .cpu_bf16_matmul import CPUMatmulBF16, schedule_matmul
from .cpu_matmul_analysis import find_matmul_block

# (tile_i, vectors_j, amx): register tiles of at most 28 zmm accumulators, or the AMX kernel.
TILE_CHOICES: tuple[tuple[int, int, bool], ...] = (
    (8, 2, False),
    (6, 4, False),
    (4, 4, False),
    (12, 2, False),
    (14, 2, False),
    (8, 2, True),
)


def sample_config(sch: s_tir.Schedule, choices=TILE_CHOICES) -> CPUMatmulBF16.Config:
    """Draw one tile configuration with a traced ``sample_categorical`` decision."""
    probs = [1.0 / len(choices)] * len(choices)
    index = int(sch.get(sch.sample_categorical(list(range(len(choices))), probs)))
    tile_i, vectors_j, amx = choices[index]
    return dataclasses.replace(CPUMatmulBF16.Config(), tile_i=tile_i, vectors_j=vectors_j, amx=amx)


def _schedule_fn(target: Target, choices):
    def schedule(sch: s_tir.Schedule) -> s_tir.Schedule:
        main = find_matmul_block(sch)
        if main is None or not is_bf16_matmul(sch.get(main)):
            raise ValueError(
                "tvmamp.schedules.bf16_matmul_space: the function is not a bf16 x bf16 -> fp32 "
                "matmul; use the default meta_schedule space for it"
            )
        schedule_matmul(sch, main, target, sample_config(sch, choices))
        return sch

    return schedule


def bf16_matmul_space(target: Target | None = None, choices=TILE_CHOICES) -> ms.SpaceGenerator:
    """Return a meta_schedule space generator over the bf16 kernels' tile configurations.

    Parameters
    ----------
    target : Target, optional
        The target to schedule for (default: the current target).
    choices : tuple of (tile_i, vectors_j, amx)
        The configurations to sample from.
    """
    target = target or Target.current()
    if target is None:
        raise ValueError("tvmamp.schedules.bf16_matmul_space: give a target or enter one")
    return ms.space_generator.ScheduleFn(
        _schedule_fn(target, choices), sch_rules=[], postprocs=[], mutator_probs={}
    )
