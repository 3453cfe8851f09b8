"""meta_schedule glue for the bf16 CPU kernels: a design space whose tiles tuning chooses.

Each point of the space is a :class:`CPUMatmulBF16.Config` (register tile, GEMV tile, AMX cache
blocks) chosen by a traced ``sample_categorical`` decision and applied by
:func:`.bf16_matmul.schedule_matmul` (or, for attention's merged scores and softmax, by
:func:`.bf16_softmax.schedule`). The value steers Python-level decisions (padding,
packing, kernel choice), which the recorded trace then holds as plain primitives, so mutating the
decision of a trace (``replay-trace``, ``evolutionary``) changes nothing. Two ways to search it:

- :func:`bf16_matmul_space`: one design space that samples the choice on every call; search it
  with ``strategy="replay-func"``, which re-runs the schedule function for every candidate::

      ms.tir_integration.tune_tir(func, target, work_dir, max_trials_global=16,
                                  space=bf16_matmul_space(target), strategy="replay-func")

- :func:`bf16_matmul_spaces`: one fully decided design space per distinct choice (the way
  ``tvmamp.tune`` uses it, each measured once by ``tvmamp.tuning.grid_search.EnumerateSpaces``).

Tuned records are applied by ``MetaScheduleApplyDatabase`` like any other; tvmamp's llvm target
then runs :class:`.bf16_passes.SplitPreproc` on them, so weights are still packed at compile
time.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging

import tvm
from tvm import s_tir, tirx
from tvm.s_tir import meta_schedule as ms
from tvm.s_tir.schedule import ScheduleError
from tvm.target import Target

from . import bf16_amx as amx
from . import bf16_softmax
from .bf16_common import has_amx_bf16, is_bf16_matmul
from .bf16_matmul import (
    CPUMatmulBF16,
    find_gemm,
    make_plan,
    plan_cores,
    schedule_matmul,
    use_amx,
)
from .common import NotApplicable
from .matmul_analysis import normalize

logger = logging.getLogger("tvmamp.schedules")
COMPONENT = "tvmamp.schedules.cpu.bf16_matmul_space"

# vdpbf16ps register tiles (tile_i rows x vectors_j 16-lane vectors, at most 28 accumulators).
REGISTER_TILES: tuple[tuple[int, int], ...] = ((8, 2), (6, 4), (4, 4), (12, 2), (14, 2), (4, 6))
# Column vectors of the GEMV tile (rows <= gemv_rows: batch 1 streams the weight once).
GEMV_VECTORS: tuple[int, ...] = (2, 4, 8)
# AMX cache blocks: columns whose packed weight slice stays in L2 (None: the automatic blocks of
# :func:`.bf16_amx.make_plan`, the default), reduction values per call.
AMX_N_BLOCKS: tuple[int | None, ...] = (None, 128, 256, 512, 1024)
AMX_K_BLOCKS: tuple[int, ...] = (1024, 2048, 4096)
# AMX from 2 rows (padded to 32). The default keeps GEMMs of fewer than 8 rows on vdpbf16ps:
# on Emerald Rapids, AMX and vdpbf16ps ran 4 x 1024 x 4096 at the same speed, and AMX ran 8 to 24
# rows 1.9-6x faster. Which wins at 2-7 rows is measured by tuning. One row (a GEMV) streams
# the weight once and stays on vdpbf16ps.
AMX_FEW_ROWS = 2


def tuning_choices(target: Target) -> tuple[CPUMatmulBF16.Config, ...]:
    """Return the configurations tuning chooses from on ``target``, the default one first.

    AMX cache blocks come first where the target has AMX-BF16 (the kernel used for 8 rows or
    more), with one choice that uses AMX from 2 rows; then the vdpbf16ps register tiles
    (fewer rows, or no AMX), then the GEMV tiles.
    """
    base = CPUMatmulBF16.Config()
    amx_on = has_amx_bf16(target)
    choices = [base]
    if amx_on:
        choices += [
            dataclasses.replace(base, amx_n_block=n, amx_k_block=k)
            for n in AMX_N_BLOCKS
            for k in AMX_K_BLOCKS
        ]
        choices.append(dataclasses.replace(base, amx_min_rows=AMX_FEW_ROWS))
    choices += [
        dataclasses.replace(base, tile_i=i, vectors_j=j, amx=False, wide_tile=None)
        for i, j in REGISTER_TILES
    ]
    choices += [dataclasses.replace(base, gemv_vectors_j=v) for v in GEMV_VECTORS]
    return tuple(c for i, c in enumerate(choices) if c not in choices[:i])  # equal ones collapse


def space_version(target: Target) -> str:
    """A digest of :func:`tuning_choices` on ``target``: a tuning record holds the index of its
    configuration in that list, so records replay as the tuned kernels only while it is equal."""
    text = repr(tuning_choices(target)).encode()
    return hashlib.sha256(text).hexdigest()[:8]


def plan_key(extents: list[int], target: Target, config: CPUMatmulBF16.Config) -> tuple:
    """The kernel ``config`` gives a normalised ``[S, I, J, K]`` gemm (equal keys: same code)."""
    if use_amx(target, extents, config):
        plan = amx.plan_for(target, extents, config.amx_n_block, config.amx_k_block)
        return ("amx", plan.n_block, plan.k_block, plan.k_padded, plan.row_chunks)
    plan = make_plan(extents, config, cores=plan_cores(target, extents))
    return ("vdpbf16ps", plan.tile_i, plan.tile_j)


def _gemm_rule(sch: s_tir.Schedule) -> tuple:
    """``(gemm block, schedule function, plan_key function)`` of the bf16 kernel ``sch`` holds:
    a merged scores-and-softmax kernel (:mod:`.bf16_softmax`) or a GEMM; Nones for neither."""
    main = bf16_softmax.merged_gemm(sch)
    if main is not None:
        return main, bf16_softmax.schedule, bf16_softmax.plan_key
    main = find_gemm(sch)
    if main is None or not is_bf16_matmul(sch.get(main)):
        return None, None, None
    return main, schedule_matmul, plan_key


def _normalised(func: tirx.PrimFunc) -> tuple:
    """``([S, I, J, K], plan_key function)`` of the bf16 gemm in ``func`` as its rule normalises
    it; ``(None, None)`` when it holds none."""
    sch = s_tir.Schedule(func)
    main, _, key = _gemm_rule(sch)
    if main is None:
        return None, None
    try:
        normalize(sch, main)
    except ScheduleError:
        return None, None
    return [int(iv.dom.extent) for iv in sch.get(main).iter_vars], key


def gemm_extents(func: tirx.PrimFunc) -> list[int] | None:
    """``[S, I, J, K]`` of the bf16 gemm in ``func`` as the rule normalises it (None: none)."""
    return _normalised(func)[0]


def distinct_choices(func: tirx.PrimFunc, target: Target, choices=None) -> tuple:
    """The ``choices`` (default :func:`tuning_choices`) that give ``func`` different kernels."""
    choices = tuning_choices(target) if choices is None else tuple(choices)
    extents, key = _normalised(func)
    if extents is None:
        raise ValueError(f"{COMPONENT}: {_NOT_BF16}")
    by_key = {}
    for config in choices:
        by_key.setdefault(key(extents, target, config), config)
    return tuple(by_key.values())


def is_bf16_gemm(func: tirx.PrimFunc, target: Target) -> bool:
    """Return whether a default bf16 rule schedules ``func`` on ``target`` (so the space can):
    the GEMM rule, or the rule of merged scores and softmax."""
    rules = (CPUMatmulBF16(), bf16_softmax.CPUGemmSoftmaxBF16())
    return any(rule.apply(func, target, False) is not None for rule in rules)


_NOT_BF16 = (
    "the function is not a bf16 x bf16 -> fp32 matmul with static shapes on a target with "
    "avx512_bf16; use the default meta_schedule space for it"
)


def sample_config(sch: s_tir.Schedule, choices, decision: int | None = None):
    """Draw one configuration with a traced ``sample_categorical`` (fixed by ``decision``)."""
    probs = [1.0 / len(choices)] * len(choices)
    index = sch.sample_categorical(list(range(len(choices))), probs, decision=decision)
    return choices[int(sch.get(index))]


def _apply(sch: s_tir.Schedule, target: Target, config) -> s_tir.Schedule:
    main, schedule, _ = _gemm_rule(sch)
    if main is None:
        raise ValueError(f"{COMPONENT}: {_NOT_BF16}")
    schedule(sch, main, target, config)
    return sch


def _current(target: Target | None) -> Target:
    target = target or Target.current()
    if target is None:
        raise ValueError(f"{COMPONENT}: give a target or enter one")
    return target


def bf16_matmul_space(target: Target | None = None, choices=None) -> ms.SpaceGenerator:
    """Return a space generator that samples one configuration per call (for ``replay-func``).

    Parameters
    ----------
    target : Target, optional
        The target to schedule for (default: the current target).
    choices : sequence of CPUMatmulBF16.Config, optional
        The configurations to sample from (default: :func:`tuning_choices`).
    """
    target = _current(target)
    choices = tuning_choices(target) if choices is None else tuple(choices)

    def schedule(sch: s_tir.Schedule) -> s_tir.Schedule:
        return _apply(sch, target, sample_config(sch, choices))

    return ms.space_generator.ScheduleFn(schedule, sch_rules=[], postprocs=[], mutator_probs={})


def bf16_matmul_spaces(target: Target | None = None, choices=None) -> ms.SpaceGenerator:
    """Return a space generator with one decided design space per distinct configuration.

    Configurations that give the same kernel for the function's shape are generated once;
    one that fails to schedule it is left out (and logged). Each design space's trace holds
    its ``sample_categorical`` decision, so a tuning record says which configuration it is.
    """
    target = _current(target)

    def schedule(sch: s_tir.Schedule) -> list[s_tir.Schedule]:
        configs = distinct_choices(sch.mod["main"], target, choices)
        spaces = []
        for index in range(len(configs)):
            space = sch.copy()
            try:
                spaces.append(_apply(space, target, sample_config(space, configs, index)))
            except (ScheduleError, NotApplicable, tvm.error.InternalError) as err:
                logger.info("bf16_matmul_spaces: left out %s: %s", configs[index], err)
        if not spaces:
            raise ValueError(f"{COMPONENT}: no configuration schedules the function")
        return spaces

    return ms.space_generator.ScheduleFn(schedule, sch_rules=[], postprocs=[], mutator_probs={})
