"""HostFallback: NPU ops the pattern checks rejected run on the host in fp32, not fp16.

The AMP policy sends every op the NPU knows to fp16 because it cannot see shapes; after
partitioning, the calls that stayed on the host (a conv with 3 input channels, a matmul with
N = 10) are rewritten to compute in fp32. A value cast down from fp32 is read from its fp32
original, and a widened result is cast to fp16 once, for the consumers that still want fp16.
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.ir.expr import Constant

from tvmamp.policy import Policy
from tvmamp.relay_passes.bindings import rebuilt_conv
from tvmamp.tensors import tensor_dtype

from .descriptor import NpuDescriptor


def wants_fallback(desc: NpuDescriptor, policy: Policy, call) -> bool:
    """Whether a host call is an NPU op that the AMP pass made low for the NPU."""
    if policy.level in ("O0", "O3") or not isinstance(call, relax.Call):
        return False
    if not isinstance(call.op, tvm.ir.Op) or call.op.name not in desc.runnable_ops():
        return False
    return any(tensor_dtype(a) in desc.dtypes for a in call.args)


@relax.expr_functor.mutator
class _Widen(relax.PyExprMutator):
    def __init__(self, mod, desc, policy):
        super().__init__(mod)
        self.desc = desc
        self.policy = policy
        self.wide = {}  # fp16 var -> the fp32 var it was cast from (or widened into)
        self.in_dataflow = False

    def visit_dataflow_block_(self, block):
        self.in_dataflow, self.wide = True, {}  # dataflow vars do not outlive their block
        result = super().visit_dataflow_block_(block)
        self.in_dataflow, self.wide = False, {}
        return result

    def visit_var_binding_(self, binding):
        value = self.visit_expr(binding.value)
        if not wants_fallback(self.desc, self.policy, value):
            super().visit_var_binding_(binding)
            if _is_cast(value, "float32", "float16"):
                self.wide[self.visit_expr(binding.var)] = value.args[0]
            return
        is_output = self.in_dataflow and not isinstance(binding.var, relax.DataflowVar)
        wide = _fp32_call(value, [self._widen(a) for a in value.args])
        if tensor_dtype(binding.var) == "float32":
            new = self._emit(wide, is_output)
        else:
            wide = self.builder_.emit(wide)
            new = self._emit(relax.op.astype(wide, tensor_dtype(binding.var)), is_output)
            self.wide[new] = wide
        self.set_var_remap(binding.var, new)

    def _emit(self, expr, is_output):
        return self.builder_.emit_output(expr) if is_output else self.builder_.emit(expr)

    def _widen(self, arg):
        if tensor_dtype(arg) not in self.desc.dtypes:
            return arg
        if arg in self.wide:
            return self.wide[arg]
        if isinstance(arg, Constant):
            return relax.const(arg.value.numpy().astype("float32"), "float32")
        self.wide[arg] = self.builder_.emit(relax.op.astype(arg, "float32"))
        return self.wide[arg]


def _is_cast(value, src: str, dst: str) -> bool:
    return (
        isinstance(value, relax.Call)
        and isinstance(value.op, tvm.ir.Op)
        and value.op.name == "relax.astype"
        and tensor_dtype(value.args[0]) == src
        and tensor_dtype(value) == dst
    )


def _fp32_call(call, args):
    """``call`` with fp32 operands; matmul and conv2d accumulate and return fp32."""
    attrs = call.attrs
    if call.op.name == "relax.matmul":
        return relax.op.matmul(*args, out_dtype="float32")
    if call.op.name == "relax.nn.conv2d":
        return rebuilt_conv(call, *args, out_dtype="float32")
    return relax.Call(call.op, args, attrs)


@tvm.transform.module_pass(opt_level=0, name="tvmamp.npu.HostFallback")
class HostFallback:
    """Rewrite rejected NPU-op calls left on the host to fp32 (not at O0 or O3)."""

    def __init__(self, desc: NpuDescriptor, policy: Policy):
        self.desc = desc
        self.policy = policy

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        """Widen host calls in every function that is not a partitioned region."""
        mutator = _Widen(mod, self.desc, self.policy)
        for gvar, func in mod.functions_items():
            if not isinstance(func, relax.Function) or _is_region(func):
                continue
            new = relax.analysis.remove_all_unused(mutator.visit_expr(func))
            mutator.builder_.update_func(gvar, new)
        return mutator.builder_.get()


def _is_region(func) -> bool:
    attrs = func.attrs or {}
    return "Codegen" in attrs or "Composite" in attrs
