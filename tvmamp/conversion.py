"""Conversion (``tvmamp.convert``): the policy for a level, dtype and target, then the AMP pass."""

from __future__ import annotations

import collections
import dataclasses
import warnings
from collections.abc import Mapping, Sequence

import tvm
from tvm import relax

from tvmamp.policy import LOW_DTYPES, Policy, check_dtype, check_level
from tvmamp.relay_passes import AutoMixedPrecision
from tvmamp.relay_passes.fold_batch_norm import FoldBatchNorm
from tvmamp.relay_passes.layer_norm import FuseLayerNorm
from tvmamp.relay_passes.matmul_broadcast import SimplifyMatmulBroadcast
from tvmamp.relay_passes.rms_norm import FuseRMSNorm
from tvmamp.relay_passes.take_to_slice import TakeToSlice
from tvmamp.targets import resolve_target
from tvmamp.tensors import check_array

COMPONENT = "tvmamp.build"


@dataclasses.dataclass
class Converted:
    """The result of :func:`convert`: the mixed-precision module and what produced it."""

    mod: tvm.IRModule
    report: object
    policy: Policy
    target: tvm.target.Target
    entry: object


def as_module(mod, component: str = COMPONENT) -> tvm.IRModule:
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
    that per-node patterns can still match parameter names. Each value is checked against the
    parameter's dtype and static shape.
    """
    if not params:
        return mod, {}
    func = mod[func_name]
    by_name = {p.name: p for p in func.params}
    unknown = sorted(set(params) - set(by_name))
    if unknown:
        raise ValueError(
            f"{COMPONENT}: params {unknown} are not inputs of {func_name}; "
            f"its inputs are {sorted(by_name)}"
        )
    constants = {}
    for name, value in params.items():
        ty = by_name[name].ty
        constants[name] = relax.const(check_array(value, name, ty, COMPONENT), str(ty.dtype))
    mod = tvm.IRModule(dict(mod.functions_items()), attrs=mod.attrs)
    mod[func_name] = func.bind_params(constants)
    return mod, {c: name for name, c in constants.items()}


def target_policy(
    level: str,
    dtype: str | None,
    target,
    component: str = COMPONENT,
    check_hardware: bool = True,
    **custom,
):
    """The policy of ``level`` for ``target``, with the user's lists and the target's limits.

    The one place a policy is made from user options: :func:`convert` and
    ``tvmamp.get_white_list``/``get_black_list`` both call it.

    Parameters
    ----------
    level, dtype, target
        As for :func:`tvmamp.build`; ``dtype=None`` is the target's default low dtype, and so
        is ``"float32"`` at O0 (it converts nothing; other levels refuse it).
    component : str
        The component named in error messages.
    check_hardware : bool
        Run the target entry's hardware checks (warnings, or errors for a dtype the device
        cannot run) for levels other than O0.
    **custom
        Keyword arguments of :meth:`Policy.for_level` (custom lists, node rules, accumulation).

    Returns
    -------
    policy : Policy
    target : tvm.target.Target
    entry : tvmamp.targets.TargetEntry
    """
    check_level(level, component)
    if dtype == "float32":  # "no low dtype": O0 converts nothing, any other level needs one
        if level != "O0":
            raise ValueError(
                f"{component}: dtype 'float32' is only meaningful at level O0, which converts "
                f"nothing; at {level} the dtype is one of {', '.join(LOW_DTYPES)}"
            )
        dtype = None
    tvm_target, entry = resolve_target(target)
    dtype = check_dtype(dtype or entry.default_dtype(tvm_target), component)
    if check_hardware and level != "O0":
        entry.check(tvm_target, dtype)
    unsupported = entry.unsupported_low_ops(tvm_target, dtype)
    policy = Policy.for_level(
        level, dtype, unsupported_low_ops=unsupported, fp32_feeds=entry.fp32_feeds, **custom
    )
    return policy, tvm_target, entry


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
) -> Converted:
    """Run only the AMP conversion (no lowering); see :func:`tvmamp.build` for the parameters.

    Returns
    -------
    Converted
        ``.mod`` the converted Relax module, ``.report`` the AmpReport, ``.policy``,
        ``.target`` (a tvm Target) and ``.entry`` (its tvmamp TargetEntry).
    """
    mod = as_module(mod)
    policy, tvm_target, entry = target_policy(
        level,
        dtype,
        target,
        custom_white_list=custom_white_list,
        custom_black_list=custom_black_list,
        custom_fp32_nodes=custom_fp32_nodes,
        custom_low_nodes=custom_low_nodes,
        accumulate_dtype=accumulate_dtype,
        node_dtypes=dict(node_dtypes) if node_dtypes else None,
    )
    if level != "O0":
        _warn_unconverted(mod, level, policy.low_dtype)
    mod, constant_names = bind_params(mod, params)
    mod = TakeToSlice()(mod)  # x[i] is a slice, not an embedding lookup (black list)
    mod = SimplifyMatmulBroadcast()(mod)  # before FoldConstant can copy a weight per batch
    mod = FuseRMSNorm()(mod)  # written-out RMSNorms run as one fp32 (black list) op
    mod = FuseLayerNorm()(mod)  # and written-out LayerNorms over the last axis
    mod = FoldBatchNorm(constant_names)(mod)  # inference batch norms into their convs' weights
    amp = AutoMixedPrecision(policy, keep_io_types=keep_io_types, constant_names=constant_names)
    converted = amp(mod)
    relax.analysis.well_formed(converted)
    return Converted(converted, amp.report, policy, tvm_target, entry)


def _warn_unconverted(mod: tvm.IRModule, level: str, low_dtype: str) -> None:
    """Warn of the ops AMP does not lower as asked, counted in one walk: float64 ops stay
    float64 (AMP converts float32 computations only), and a float16 model's ops run in
    bfloat16 when that is the low dtype, 3 mantissa bits fewer than the model was written for
    (a helper measured 6x torch fp16's error on such a model)."""
    counts = collections.Counter()

    def visit(expr):
        if isinstance(expr, relax.Call) and isinstance(expr.ty, relax.TensorType):
            counts[str(expr.ty.dtype)] += 1

    for func in mod.functions.values():
        if isinstance(func, relax.Function):
            relax.analysis.post_order_visit(func, visit)
    if counts["float64"]:
        warnings.warn(
            f"tvmamp.convert: {counts['float64']} ops of the model compute in float64, which "
            "AMP leaves as it is (it converts float32 computations); import the float32 model "
            "(model.float(), float32 inputs) to have them converted",
            stacklevel=3,
        )
    if low_dtype == "bfloat16" and counts["float16"]:
        warnings.warn(
            f"tvmamp.convert: {counts['float16']} ops of the model compute in float16; at "
            f"{level} with dtype 'bfloat16' they run in bfloat16, which keeps 3 fewer mantissa "
            "bits. Pass dtype='float16' to keep float16, or import the float32 model",
            stacklevel=3,
        )
