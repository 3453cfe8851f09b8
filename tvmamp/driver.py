"""The driver: ``tvmamp.build``, from a model and options to an executable.

It resolves the level (a precision plan, or ``level="auto-search"``, which searches one), runs the
conversion (:mod:`tvmamp.conversion`), opens a tuning log (:mod:`tvmamp.tuning.loader`) and
compiles through the pipeline (:mod:`tvmamp.pipeline`). It is the top of the core: the
conversion, the pipeline and the features built on them (search, tuning, debugging, training)
never import it; the command line calls it.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence

from tvmamp.conversion import COMPONENT, as_module, convert
from tvmamp.executable import Executable
from tvmamp.pipeline import compile_converted
from tvmamp.policy import LEVELS
from tvmamp.search import PrecisionPlan, search_precision
from tvmamp.tuning.loader import open_tuning_log

AUTO_SEARCH = "auto-search"


@dataclasses.dataclass(frozen=True)
class ResolvedLevel:
    """What a build converts with, after plans and ``auto-search`` are resolved.

    Attributes
    ----------
    level : str
        One of ``tvmamp.LEVELS``.
    dtype : str or None
        The low dtype (None: the target's default).
    node_dtypes : dict or None
        Exact per-node dtypes (a plan's, or the caller's).
    plan : tvmamp.PrecisionPlan or None
        The plan applied (given, or searched for ``auto-search``).
    """

    level: str
    dtype: str | None
    node_dtypes: Mapping[str, str] | None
    plan: PrecisionPlan | None


def resolve_plan(
    mod,
    level: str | None = None,
    dtype: str | None = None,
    node_dtypes: Mapping[str, str] | None = None,
    plan: PrecisionPlan | None = None,
    *,
    target="llvm",
    params: Mapping | None = None,
    calib_inputs: Sequence | None = None,
    budget=None,
) -> ResolvedLevel:
    """The level, dtype and node dtypes to convert with: given, from ``plan``, or searched.

    ``level=None`` is O1, or the plan's level. ``level="auto-search"`` runs
    :func:`tvmamp.search_precision` on ``calib_inputs`` and ``budget`` (for ``target``,
    ``dtype`` and ``params``) and applies its plan. A plan fixes the level, dtype and every
    node's dtype: a plan for another model, a contradicting level or dtype, or ``node_dtypes``
    given as well are refused.

    Raises
    ------
    ValueError
        A bad level, a contradiction with the plan, or ``calib_inputs``/``budget`` without
        ``auto-search`` (or ``auto-search`` without ``calib_inputs``).
    TypeError
        ``plan`` is not a PrecisionPlan.
    """
    if level == AUTO_SEARCH:
        plan = _auto_search(mod, target, dtype, params, plan, calib_inputs, budget)
        level = None
    elif level is not None and level not in LEVELS:
        raise ValueError(
            f"{COMPONENT}: level {level!r} is not one of {', '.join(LEVELS)} or {AUTO_SEARCH}"
        )
    elif calib_inputs is not None or budget is not None:
        raise ValueError(
            f"{COMPONENT}: calib_inputs and budget are only used with level={AUTO_SEARCH!r}, "
            f"not level={level!r}"
        )
    if plan is not None:
        level, dtype, node_dtypes = _from_plan(plan, mod, level, dtype, node_dtypes)
    return ResolvedLevel(level or "O1", dtype, node_dtypes, plan)


def _auto_search(mod, target, dtype, params, plan, calib_inputs, budget) -> PrecisionPlan:
    """The plan of ``level="auto-search"``: search_precision on the calibration inputs."""
    if plan is not None:
        raise ValueError(
            f"{COMPONENT}: level={AUTO_SEARCH!r} searches a plan; do not pass plan= as well"
        )
    if calib_inputs is None:
        raise ValueError(
            f"{COMPONENT}: level={AUTO_SEARCH!r} needs calib_inputs= (a list of calibration "
            "samples, each an array or a tuple of arrays); or choose one of " + ", ".join(LEVELS)
        )
    return search_precision(mod, calib_inputs, target, dtype, budget, params)


def _from_plan(plan, mod, level, dtype, node_dtypes):
    """Level, dtype and node dtypes from a precision plan, refusing contradictions."""
    if not isinstance(plan, PrecisionPlan):
        raise TypeError(f"{COMPONENT}: plan must be a tvmamp.PrecisionPlan, got {plan!r}")
    plan.check_model(as_module(mod))
    for name, given, planned in (("level", level, plan.base_level), ("dtype", dtype, plan.dtype)):
        if given is not None and given != planned:
            raise ValueError(
                f"{COMPONENT}: {name} {given!r} contradicts the plan's {name} {planned!r}; "
                f"leave {name} unset to use the plan"
            )
    if node_dtypes:
        raise ValueError(f"{COMPONENT}: give either plan or node_dtypes, not both")
    return plan.base_level, plan.dtype, plan.node_dtypes


def compile_with_log(
    converted, tuning_log: str | os.PathLike | None = None, tuning_log_override: bool = False
) -> Executable:
    """Compile ``converted`` through the pipeline, with the kernels of ``tuning_log`` if given.

    The log is checked against the target, level and dtype (refused on a mismatch unless
    ``tuning_log_override``), and its records are replayed on the kernels of the lowered module;
    its notes (kernels left to the default schedules, records dropped because the default was
    faster) are kept on ``exe.notes``.
    """
    if tuning_log is None:
        return compile_converted(converted)
    log = open_tuning_log(tuning_log, converted, tuning_log_override)
    return compile_converted(converted, log.database, log.check_kernels)


def build(
    mod,
    level: str | None = None,
    target="llvm",
    dtype: str | None = None,
    params: Mapping | None = None,
    custom_white_list: Sequence[str] | None = None,
    custom_black_list: Sequence[str] | None = None,
    keep_io_types: bool = True,
    tuning_log: str | os.PathLike | None = None,
    *,
    custom_fp32_nodes: Sequence[str] | None = None,
    custom_low_nodes: Sequence[str] | None = None,
    accumulate_dtype: str = "float32",
    node_dtypes: Mapping[str, str] | None = None,
    plan: PrecisionPlan | None = None,
    tuning_log_override: bool = False,
    calib_inputs: Sequence | None = None,
    budget=None,
) -> Executable:
    """Compile a Relax model with automatic mixed precision.

    Parameters
    ----------
    mod : tvm.IRModule or relax.Function
        The fp32 model (from TVMScript, ``relax.frontend``, ``from_torch`` or ``from_onnx``).
    level : str
        "O0", "O1", "O2", "O3", "OD" or "auto" (see :mod:`tvmamp.policy`); default "O1", or the
        plan's level when ``plan`` is given. "auto-search" runs
        :func:`tvmamp.search_precision` on ``calib_inputs`` and ``budget`` first and builds its
        plan (``exe.plan``).
    target : str, dict or tvm.target.Target
        "llvm", "llvm -mcpu=znver4", "cuda", "cuda -arch=sm_80", "nvidia/a100", a JSON dict...
    dtype : str, optional
        "float16" or "bfloat16"; by default bf16 on CPUs with avx512_bf16, fp16 elsewhere.
        "float32" only at level O0, which converts nothing (the same as leaving it out).
    params : dict, optional
        Values for inputs of ``main``, bound as constants (converted low at compile time).
    custom_white_list, custom_black_list : list of str, optional
        Op names (Relax, Paddle, MindSpore or PyTorch spellings) to force low or fp32.
    keep_io_types : bool
        Keep the model's inputs and outputs in their original dtypes.
    tuning_log : path, optional
        A tuning log directory from ``tvmamp.tune``; its kernels replace default schedules where
        they were measured faster. A log for another target, level or dtype is refused.
    tuning_log_override : bool
        Apply a tuning log made for another target, level or dtype anyway.
    custom_fp32_nodes, custom_low_nodes : list of str, optional
        Glob patterns on binding or parameter names, e.g. ``["head*"]``.
    accumulate_dtype : str
        ``out_dtype`` of low matmul/conv.
    node_dtypes : dict, optional
        Exact per-node dtypes, node id (as in ``exe.stats.nodes``) -> "float32" or "low".
    plan : tvmamp.PrecisionPlan, optional
        A plan from :func:`tvmamp.search_precision`, applied exactly (level, dtype and every
        node's dtype come from it). A plan made for another model is refused.
    calib_inputs : list, optional
        Calibration samples for ``level="auto-search"`` (as for ``search_precision``).
    budget : tvmamp.ErrorBudget, optional
        The error budget for ``level="auto-search"`` (default: max relative error 5e-3).

    Returns
    -------
    Executable
    """
    resolved = resolve_plan(
        mod,
        level,
        dtype,
        node_dtypes,
        plan,
        target=target,
        params=params,
        calib_inputs=calib_inputs,
        budget=budget,
    )
    converted = convert(
        mod,
        resolved.level,
        target,
        resolved.dtype,
        params,
        custom_white_list,
        custom_black_list,
        custom_fp32_nodes,
        custom_low_nodes,
        keep_io_types,
        accumulate_dtype,
        resolved.node_dtypes,
    )
    exe = compile_with_log(converted, tuning_log, tuning_log_override)
    exe.plan = resolved.plan
    return exe
