"""The partition report: which ops run on the NPU, which stay on the host, and why."""

from __future__ import annotations

import collections
import dataclasses

import tvm
from tvm import relax

from tvmamp.policy import Category, Policy
from tvmamp.tensors import tensor_dtype

from .checks import op_reason
from .descriptor import DATA_MOVEMENT_OPS, NpuDescriptor
from .fallback import wants_fallback


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where one binding of the model runs."""

    name: str  # the Relax binding
    op: str  # the pattern ("tvmamp_npu.dense_bias_relu") or the Relax op on the host
    device: str  # the NPU's name or "host"
    dtype: str  # the dtype it computes in
    reason: str = ""  # why it stayed on the host


@dataclasses.dataclass(frozen=True)
class PartitionReport:
    """What partitioning did; ``str(report)`` is a table."""

    npu: str
    placements: tuple = ()

    @property
    def on_npu(self) -> tuple[Placement, ...]:
        """Bindings offloaded to the NPU."""
        return tuple(p for p in self.placements if p.device != "host")

    @property
    def on_host(self) -> tuple[Placement, ...]:
        """Compute ops left on the host, with the reason."""
        return tuple(p for p in self.placements if p.device == "host")

    def patterns(self) -> dict[str, int]:
        """Offloaded pattern name (without the NPU prefix) -> count."""
        return dict(collections.Counter(p.op.split(".", 1)[1] for p in self.on_npu))

    def __str__(self) -> str:
        lines = [
            f"partition for {self.npu}: {len(self.on_npu)} on the NPU, "
            f"{len(self.on_host)} on the host"
        ]
        for p in self.placements:
            why = f"  ({p.reason})" if p.reason else ""
            lines.append(f"  {p.device:<12} {p.dtype:<8} {p.name:<10} {p.op}{why}")
        return "\n".join(lines)


def host_reason(desc: NpuDescriptor, policy: Policy | None, call: relax.Call) -> str:
    """Why a call that no pattern took stays on the host."""
    name = call.op.name
    if policy is not None and policy.category(name) is Category.BLACK and name in desc.ops:
        return f"{name} is on the policy's black list"
    if name in DATA_MOVEMENT_OPS:
        return "data movement stays on the host (exact in any dtype)"
    if name in desc.runnable_ops() and name not in desc.ops:
        return f"{name} runs on {desc.name} only inside a fused pattern"
    return op_reason(desc, call) or "no pattern of the NPU matched"


def analyze(mod: tvm.IRModule, desc: NpuDescriptor, policy: Policy | None) -> PartitionReport:
    """Report on a module after ``FuseOpsByPattern`` (casts are not listed)."""
    placements = []
    for _, func in mod.functions_items():
        if not isinstance(func, relax.Function) or "Composite" in (func.attrs or {}):
            continue
        if "Codegen" in (func.attrs or {}):
            continue
        for block in func.body.blocks:
            for binding in block.bindings:
                placement = _place(mod, desc, policy, binding)
                if placement is not None:
                    placements.append(placement)
    return PartitionReport(desc.name, tuple(placements))


def _place(mod, desc, policy, binding) -> Placement | None:
    value, name = binding.value, binding.var.name
    if not isinstance(value, relax.Call):
        return None
    if isinstance(value.op, relax.GlobalVar):
        func = mod[value.op]
        attrs = func.attrs or {}
        if "Codegen" in attrs:  # annotate_codegen=True wraps the composite in a region
            func = _inner_composite(func)
            attrs = func.attrs or {}
        if "Composite" in attrs:
            return Placement(name, str(attrs["Composite"]), desc.name, tensor_dtype(binding.var))
        return None
    if not isinstance(value.op, tvm.ir.Op) or value.op.name == "relax.astype":
        return None
    fallback = policy is not None and wants_fallback(desc, policy, value)
    dtype = "float32" if fallback else (tensor_dtype(binding.var) or "-")
    return Placement(name, value.op.name, "host", dtype, host_reason(desc, policy, value))


def _inner_composite(func: relax.Function) -> relax.Function:
    for block in func.body.blocks:
        for binding in block.bindings:
            if isinstance(binding.value, relax.Function):
                return binding.value
    return func
