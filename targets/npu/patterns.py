"""The BYOC pattern table of an NPU: (name, pattern, annotations, check) from its descriptor."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from tvm.relax.backend.utils import has_leaking_intermediate_variables
from tvm.relax.dpl import is_op, wildcard

from tvmamp.policy import Category, Policy

from .checks import OP_REASONS, bias_reason, elementwise_reason, shape_of, tensor_reason
from .descriptor import NpuDescriptor


@dataclasses.dataclass(frozen=True)
class Spec:
    """How one pattern is built: its core op, right operand form, bias axis and activation."""

    core: str
    dense: bool = False
    bias_axis: int | None = None  # channel axis of the bias, counted from the end
    act: str | None = None


SPECS = {
    "dense_bias_relu": Spec("relax.matmul", True, -1, "relax.nn.relu"),
    "dense_bias_gelu": Spec("relax.matmul", True, -1, "relax.nn.gelu"),
    "dense_bias": Spec("relax.matmul", True, -1),
    "matmul_bias_relu": Spec("relax.matmul", False, -1, "relax.nn.relu"),
    "matmul_bias_gelu": Spec("relax.matmul", False, -1, "relax.nn.gelu"),
    "matmul_bias": Spec("relax.matmul", False, -1),
    "conv2d_bias_relu": Spec("relax.nn.conv2d", False, -3, "relax.nn.relu"),
    "conv2d_bias": Spec("relax.nn.conv2d", False, -3),
    "conv2d_relu": Spec("relax.nn.conv2d", False, None, "relax.nn.relu"),
    "dense": Spec("relax.matmul", True),
    "matmul": Spec("relax.matmul"),
    "conv2d": Spec("relax.nn.conv2d"),
    "max_pool2d": Spec("relax.nn.max_pool2d"),
    "add": Spec("relax.add"),
    "multiply": Spec("relax.multiply"),
    "relu": Spec("relax.nn.relu"),
}

# Single ops -> the pattern names that offload them alone, in priority order.
SINGLE = {
    "relax.matmul": ("dense", "matmul"),
    "relax.nn.conv2d": ("conv2d",),
    "relax.nn.max_pool2d": ("max_pool2d",),
    "relax.add": ("add",),
    "relax.multiply": ("multiply",),
    "relax.nn.relu": ("relu",),
}


def build_pattern(spec: Spec):
    """The dataflow pattern of ``spec`` and its annotations ("core", "add", "bias", "act")."""
    arity = 1 if spec.core in ("relax.nn.relu", "relax.nn.max_pool2d") else 2
    args = [wildcard() for _ in range(arity)]
    if spec.dense:
        args[1] = is_op("relax.permute_dims")(wildcard())
    core = is_op(spec.core)(*args)
    annotations = {"core": core, "permute": args[1]} if spec.dense else {"core": core}
    root = core
    if spec.bias_axis is not None:
        bias = wildcard()
        root = is_op("relax.add")(is_op("relax.astype")(core) | core, bias)
        annotations.update(add=root, bias=bias)
    if spec.act is not None:
        if spec.bias_axis is None:  # the accumulator is cast to fp16 before the activation
            root = is_op("relax.astype")(core) | core
        root = is_op(spec.act)(root)
        annotations["act"] = root
    return root, annotations


def pattern_names(desc: NpuDescriptor) -> list[str]:
    """Fused patterns first (longest first, as listed), then the single ops."""
    return [*desc.fused, *(name for op in desc.ops for name in SINGLE[op])]


def match_reason(desc: NpuDescriptor, policy: Policy | None, spec: Spec, annotated) -> str | None:
    """Why a match of ``spec`` cannot be offloaded (None when it can)."""
    calls = [annotated[k] for k in ("core", "add", "act") if k in annotated]
    if policy is not None:
        black = [c.op.name for c in calls if policy.category(c.op.name) is Category.BLACK]
        if black:
            return f"{', '.join(black)} is on the policy's black list"
    core = annotated["core"]
    reason = OP_REASONS[spec.core](desc, core)
    if reason is None and spec.dense:
        reason = _transpose_reason(annotated["permute"])
    if reason is None and "add" in annotated:
        axis_len = shape_of(core)[spec.bias_axis]
        reason = tensor_reason(desc, annotated["add"]) or bias_reason(
            desc, annotated["bias"], axis_len, spec.bias_axis
        )
        if reason is None and shape_of(annotated["add"]) != shape_of(core):
            reason = "the bias add changes the output shape"
    if reason is None and "act" in annotated:
        reason = elementwise_reason(desc, annotated["act"])
    return reason


def _transpose_reason(permute) -> str | None:
    rank = len(shape_of(permute) or ())
    axes = permute.attrs.axes
    swap = list(range(rank - 2)) + [rank - 1, rank - 2]
    if axes is not None and [int(a) for a in axes] != swap:
        return f"permute_dims axes {[int(a) for a in axes]} are not a transpose of the last two"
    return None


def _check(desc: NpuDescriptor, policy: Policy | None, spec: Spec) -> Callable:
    def check(context) -> bool:
        if has_leaking_intermediate_variables(context):
            return False
        return match_reason(desc, policy, spec, context.annotated_expr) is None

    return check


def pattern_table(desc: NpuDescriptor, policy: Policy | None = None) -> list[tuple]:
    """``(name, pattern, annotations, check)`` tuples for ``FuseOpsByPattern``, best first."""
    table = []
    for name in pattern_names(desc):
        spec = SPECS[name]
        root, annotations = build_pattern(spec)
        table.append((f"{desc.name}.{name}", root, annotations, _check(desc, policy, spec)))
    return table
