"""Reading the primitive functions ``FuseOps`` groups, for the passes that merge them.

Between ``FuseOps`` and ``FuseTIR`` each kernel is a Relax function marked ``Primitive`` whose
body is one dataflow block of ``call_tir`` calls of legalized PrimFuncs. The merges of
:mod:`.gemm_softmax` and :mod:`.gemm_layout` read those calls, the PrimFuncs' op patterns, and
the PrimFunc ``FuseTIR`` would make of a merged function (for the target's schedule to accept or
decline).
"""

from __future__ import annotations

import tvm
from tvm import relax, s_tir, tirx

# relax.transform.AnnotateTIROpPattern's kinds (TVM's OpPatternKind).
ELEMWISE = 0
BROADCAST = 1
INJECTIVE = 2
COMM_REDUCE = 3
OUT_ELEMWISE_FUSABLE = 4

_CALL_TIR = tvm.ir.Op.get("relax.call_tir")


def primitive_calls(func: relax.Function) -> list[relax.Call] | None:
    """The ``call_tir`` values of a primitive function of one dataflow block, in order."""
    if len(func.body.blocks) != 1:
        return None
    values = [b.value for b in func.body.blocks[0].bindings]
    return values if all(isinstance(v, relax.Call) and v.op == _CALL_TIR for v in values) else None


def prim_func(mod: tvm.IRModule, call: relax.Call) -> tirx.PrimFunc | None:
    """The PrimFunc a ``call_tir`` calls, or None."""
    func = mod[call.args[0]]
    return func if isinstance(func, tirx.PrimFunc) else None


def op_pattern(func: tirx.PrimFunc | None) -> int | None:
    """The ``op_pattern`` attribute ``AnnotateTIROpPattern`` gave ``func``, or None."""
    value = func.attrs.get("op_pattern") if func is not None and func.attrs is not None else None
    return None if value is None else int(value)


def all_within(mod: tvm.IRModule, calls: list[relax.Call], kind: int) -> bool:
    """Whether every PrimFunc ``calls`` call has an op pattern of at most ``kind``."""
    patterns = [op_pattern(prim_func(mod, c)) for c in calls]
    return all(p is not None and p <= kind for p in patterns)


def is_bf16_gemm(func: tirx.PrimFunc) -> bool:
    """One reduction block reading two bf16 buffers into fp32 (a legalized matmul)."""
    sch = s_tir.Schedule(func)
    blocks = [sch.get(b) for b in sch.get_child_blocks(sch.get_sblock("root"))]
    if len(blocks) != 1:
        return False
    (block,) = blocks
    reads = [str(r.source.dtype) for r in block.reads]
    reduces = any(iv.iter_type == tirx.IterVar.CommReduce for iv in block.iter_vars)
    return reduces and reads == ["bfloat16"] * 2 and str(block.writes[0].source.dtype) == "float32"


def bf16_gemm_calls(mod: tvm.IRModule, calls: list[relax.Call]) -> list[relax.Call]:
    """The calls among ``calls`` of a legalized bf16 matmul (:func:`is_bf16_gemm`)."""
    gemms = [c for c in calls if op_pattern(prim_func(mod, c)) == OUT_ELEMWISE_FUSABLE]
    return [c for c in gemms if is_bf16_gemm(prim_func(mod, c))]


def merged_function(
    name: str, producer: relax.Function, consumer: relax.Function, index: int = 0
) -> relax.Function:
    """One primitive function: ``consumer``'s body with its parameter ``index`` computed by
    ``producer``'s body, whose parameters take that parameter's place."""
    builder = relax.BlockBuilder()
    own = [relax.Var(p.name, p.ty) for p in producer.params]
    others = [relax.Var(p.name, p.ty) for p in consumer.params]
    params = [*others[:index], *own, *others[index + 1 :]]
    remap = dict(zip(producer.params, own, strict=True))
    remap.update(zip(consumer.params, others, strict=True))
    with builder.function(name, params, attrs={"Primitive": True}, private=True):
        with builder.dataflow():
            for func in (producer, consumer):
                if func is consumer:
                    remap[consumer.params[index]] = remap[producer.body.body]
                for binding in func.body.blocks[0].bindings:
                    call = binding.value
                    args = [remap.get(a, a) for a in call.args[1].fields]
                    new = relax.call_tir(call.args[0], args, out_ty=call.ty_args[0])
                    last = binding.var.same_as(consumer.body.body)
                    emit = builder.emit_output if last else builder.emit
                    remap[binding.var] = emit(new, binding.var.name)
        builder.emit_func_output(remap[consumer.body.body])
    return builder.get()[name]


def fused_kernel(mod: tvm.IRModule, func: relax.Function, name: str) -> tirx.PrimFunc:
    """The PrimFunc ``FuseTIR`` makes of the primitive function ``func`` (named ``name``)."""
    prim_funcs = {g: f for g, f in mod.functions_items() if isinstance(f, tirx.PrimFunc)}
    builder = relax.BlockBuilder(tvm.IRModule(prim_funcs))
    gvar = builder.add_func(func, name)
    params = [relax.Var(p.name, p.ty) for p in func.params]
    with builder.function("main", params):
        with builder.dataflow():
            out = builder.emit_output(relax.Call(gvar, params))
        builder.emit_func_output(out)
    fused = relax.transform.FuseTIR()(builder.get())
    return next(f for g, f in fused.functions_items() if g.name_hint == name)


__all__ = [
    "BROADCAST",
    "ELEMWISE",
    "INJECTIVE",
    "OUT_ELEMWISE_FUSABLE",
    "all_within",
    "bf16_gemm_calls",
    "fused_kernel",
    "is_bf16_gemm",
    "merged_function",
    "op_pattern",
    "prim_func",
    "primitive_calls",
]
