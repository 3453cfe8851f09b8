"""tvmamp.build: policy -> AMP pass -> target phases -> schedules -> Relax VM executable."""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import tvm
from tvm import relax

from tvmamp.policy import LEVELS, Policy, check_dtype, check_level
from tvmamp.relay_passes import AutoMixedPrecision
from tvmamp.targets import resolve_target

from .executable import Executable

# Functions ``hook(converted: Converted) -> tvm.IRModule`` run on every converted module before it
# is lowered (instrumentation such as the tensor checker registers here while it is enabled).
# With no hook registered the compiled module is exactly the uninstrumented one.
BUILD_HOOKS: list[Callable] = []


@dataclasses.dataclass
class Converted:
    """The result of :func:`convert`: the mixed-precision module and what produced it."""

    mod: tvm.IRModule
    report: object
    policy: Policy
    target: tvm.target.Target
    entry: object


def as_module(mod, component: str = "tvmamp.build") -> tvm.IRModule:
    """Accept an IRModule or a relax.Function (as ``main``); anything else is a TypeError."""
    if isinstance(mod, tvm.IRModule):
        if not any(isinstance(f, relax.Function) for _, f in mod.functions_items()):
            raise TypeError(f"{component}: the IRModule has no Relax function to compile")
        return mod
    if isinstance(mod, relax.Function):
        return tvm.IRModule({"main": mod.with_attr("global_symbol", "main")})
    raise TypeError(
        f"{component}: expected a tvm.IRModule or relax.Function, got {type(mod).__name__}; "
        "import PyTorch or ONNX models with tvmamp.from_torch / tvmamp.from_onnx first"
    )


def bind_params(mod: tvm.IRModule, params: Mapping | None, func_name: str = "main"):
    """Bind named parameters of ``func_name`` as constants.

    Returns the new module and a dict constant -> parameter name, which the AMP pass uses so
    that per-node patterns can still match parameter names.
    """
    if not params:
        return mod, {}
    func = mod[func_name]
    by_name = {p.name: p for p in func.params}
    unknown = sorted(set(params) - set(by_name))
    if unknown:
        raise ValueError(
            f"tvmamp.build: params {unknown} are not inputs of {func_name}; "
            f"its inputs are {sorted(by_name)}"
        )
    constants = {}
    for name, value in params.items():
        array = value.numpy() if isinstance(value, tvm.runtime.Tensor) else np.asarray(value)
        _check_param(name, array, by_name[name].ty)
        constants[name] = relax.const(array, str(by_name[name].ty.dtype))
    mod = tvm.IRModule(dict(mod.functions_items()), attrs=mod.attrs)
    mod[func_name] = func.bind_params(constants)
    return mod, {c: name for name, c in constants.items()}


def _check_param(name, array, ty):
    from .executable import static_shape, tensor_dtype_of

    want = tensor_dtype_of(ty)
    if want is not None and str(array.dtype) != want:
        raise TypeError(f"tvmamp.build: param {name!r} has dtype {array.dtype}, expected {want}")
    shape = static_shape(ty)
    if shape is not None and tuple(array.shape) != shape:
        raise ValueError(f"tvmamp.build: param {name!r} has shape {array.shape}, expected {shape}")


def convert(
    mod,
    level: str = "O1",
    target="llvm",
    dtype: str | None = None,
    params: Mapping | None = None,
    custom_white_list: Sequence[str] | None = None,
    custom_black_list: Sequence[str] | None = None,
    custom_fp32_nodes: Sequence[str] | None = None,
    custom_low_nodes: Sequence[str] | None = None,
    keep_io_types: bool = True,
    accumulate_dtype: str = "float32",
    node_dtypes: Mapping[str, str] | None = None,
):
    """Run only the AMP conversion (no lowering); see :func:`build` for the parameters.

    Returns
    -------
    Converted
        ``.mod`` the converted Relax module, ``.report`` the AmpReport, ``.policy``,
        ``.target`` (a tvm Target) and ``.entry`` (its tvmamp TargetEntry).
    """
    mod = as_module(mod)
    check_level(level, "tvmamp.build")
    tvm_target, entry = resolve_target(target)
    dtype = check_dtype(dtype or entry.default_dtype(tvm_target), "tvmamp.build")
    if level != "O0":
        entry.check(tvm_target, dtype)
    policy = Policy.for_level(
        level,
        dtype,
        custom_white_list=custom_white_list,
        custom_black_list=custom_black_list,
        custom_fp32_nodes=custom_fp32_nodes,
        custom_low_nodes=custom_low_nodes,
        unsupported_low_ops=entry.unsupported_low_ops(tvm_target, dtype),
        accumulate_dtype=accumulate_dtype,
        node_dtypes=dict(node_dtypes) if node_dtypes else None,
    )
    mod, constant_names = bind_params(mod, params)
    amp = AutoMixedPrecision(policy, keep_io_types=keep_io_types, constant_names=constant_names)
    converted = amp(mod)
    relax.analysis.well_formed(converted)
    return Converted(converted, amp.report, policy, tvm_target, entry)


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
    plan=None,
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
    if level == AUTO_SEARCH:
        plan = _auto_search(mod, target, dtype, params, plan, calib_inputs, budget)
        level = None
    elif level is not None and level not in LEVELS:
        raise ValueError(
            f"tvmamp.build: level {level!r} is not one of {', '.join(LEVELS)} or {AUTO_SEARCH}"
        )
    elif calib_inputs is not None or budget is not None:
        raise ValueError(
            f"tvmamp.build: calib_inputs and budget are only used with level={AUTO_SEARCH!r}, "
            f"not level={level!r}"
        )
    if plan is not None:
        level, dtype, node_dtypes = _apply_plan(plan, mod, level, dtype, node_dtypes)
    converted = convert(
        mod,
        level or "O1",
        target,
        dtype,
        params,
        custom_white_list,
        custom_black_list,
        custom_fp32_nodes,
        custom_low_nodes,
        keep_io_types,
        accumulate_dtype,
        node_dtypes,
    )
    exe = compile_converted(converted, tuning_log, tuning_log_override)
    exe.plan = plan
    return exe


AUTO_SEARCH = "auto-search"


def _auto_search(mod, target, dtype, params, plan, calib_inputs, budget):
    """The plan of ``level="auto-search"``: search_precision on the calibration inputs."""
    from tvmamp.search import search_precision

    if plan is not None:
        raise ValueError(
            f"tvmamp.build: level={AUTO_SEARCH!r} searches a plan; do not pass plan= as well"
        )
    if calib_inputs is None:
        raise ValueError(
            f"tvmamp.build: level={AUTO_SEARCH!r} needs calib_inputs= (a list of calibration "
            "samples, each an array or a tuple of arrays); or choose one of " + ", ".join(LEVELS)
        )
    return search_precision(mod, calib_inputs, target, dtype, budget, params)


def _apply_plan(plan, mod, level, dtype, node_dtypes):
    """Level, dtype and node dtypes from a precision plan, refusing contradictions."""
    from tvmamp.search import PrecisionPlan

    if not isinstance(plan, PrecisionPlan):
        raise TypeError(f"tvmamp.build: plan must be a tvmamp.PrecisionPlan, got {plan!r}")
    plan.check_model(as_module(mod))
    for name, given, planned in (("level", level, plan.base_level), ("dtype", dtype, plan.dtype)):
        if given is not None and given != planned:
            raise ValueError(
                f"tvmamp.build: {name} {given!r} contradicts the plan's {name} {planned!r}; "
                f"leave {name} unset to use the plan"
            )
    if node_dtypes:
        raise ValueError("tvmamp.build: give either plan or node_dtypes, not both")
    return plan.base_level, plan.dtype, plan.node_dtypes


def compile_converted(
    converted: Converted, tuning_log=None, tuning_log_override: bool = False
) -> Executable:
    """Lower a converted module for its target (build hooks, then the target phases).

    A ``tuning_log`` is checked against the target, level and dtype (refused on a mismatch
    unless ``tuning_log_override``); its notes (kernels left to the default schedules, records
    dropped because the default was faster) are kept on ``exe.notes``.
    """
    mod = converted.mod
    for hook in BUILD_HOOKS:
        mod = hook(dataclasses.replace(converted, mod=mod))
    database, notes = None, []
    if tuning_log is not None:
        from tvmamp.tuning import load_tuning_log

        database, notes = load_tuning_log(tuning_log, converted, tuning_log_override)
    pipeline = _pipeline(converted.target, converted.entry, converted.policy, database)
    with database if database is not None else contextlib.nullcontext(), _pass_context(converted):
        vm_exec = tvm.compile(mod, target=converted.target, relax_pipeline=pipeline)
    exe = Executable(
        vm_exec, converted.target, converted.mod, converted.report, converted.policy, notes
    )
    report = getattr(converted.entry, "partition_report", None)
    exe.partition = report(converted.target, converted.policy, converted.mod) if report else None
    return exe


def _pass_context(converted: Converted) -> tvm.transform.PassContext:
    """The caller's PassContext plus the target entry's options (cp.async on sm_80+)."""
    current = tvm.transform.PassContext.current()
    config = {**dict(current.config), **converted.entry.pass_config(converted.target)}
    return tvm.transform.PassContext(
        opt_level=current.opt_level,
        required_pass=current.required_pass,
        disabled_pass=current.disabled_pass,
        instruments=current.instruments,
        config=config,
    )


def front_phases(target, entry, policy) -> list:
    """Phases 1 and 2 (partition, dispatch, legalize, fuse): the kernels tuning sees."""
    return [
        # Phase 1. target partitioning (BYOC) and library dispatch
        *entry.partition_passes(target, policy),
        relax.backend.DispatchSampling(),
        relax.backend.DispatchSortScan(),
        # Phase 2. legalize to TIR and fuse
        *legalize_and_fuse(),
    ]


def legalize_and_fuse() -> list:
    """Phase 2 of the pipeline: legalize Relax ops to TIR, fold constants, fuse the kernels."""
    return [
        relax.transform.LegalizeOps(),
        relax.transform.AnnotateTIROpPattern(),
        relax.transform.FoldConstant(),
        relax.transform.FuseOps(),
        relax.transform.FuseTIR(),
    ]


def _pipeline(target, entry, policy, database):
    """The phases, in order, as in mlc-llm's pipeline: each a list of passes."""

    @tvm.transform.module_pass(opt_level=0, name="tvmamp.Pipeline")
    def pipeline(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        with target:
            phases = [
                *front_phases(target, entry, policy),
                # Phase 3. tuned kernels from the log, then default schedules for the rest
                *([relax.transform.MetaScheduleApplyDatabase()] if database is not None else []),
                *entry.schedule_passes(target),
                # Phase 4. lower dataflow and finalise for the VM
                relax.transform.RewriteDataflowReshape(),
                relax.transform.ToNonDataflow(),
                relax.transform.RemovePurityChecking(),
                relax.transform.CallTIRRewrite(),
                relax.transform.StaticPlanBlockMemory(),
                relax.transform.LowerAllocTensor(),
                relax.transform.KillAfterLastUse(),
                relax.transform.LowerRuntimeBuiltin(),
                relax.transform.ComputePrimValue(),
                relax.transform.VMShapeLower(),
                relax.transform.AttachGlobalSymbol(),
                # Phase 5. the target's last word (the CPU feature guard)
                *entry.finalize_passes(target),
            ]
            return tvm.transform.Sequential(phases)(mod)

    return pipeline
