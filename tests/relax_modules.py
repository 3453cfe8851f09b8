"""Small Relax modules the tests build ops into (imported by name, like ``tolerances``)."""

from __future__ import annotations

import tvm
from tvm import relax


def op_names(mod: tvm.IRModule) -> list[str]:
    """The names of the ops ``main`` of ``mod`` calls, in post order (``relax.call_tir`` for
    a kernel)."""
    names = []
    relax.analysis.post_order_visit(
        mod["main"],
        lambda e: names.append(e.op.name) if isinstance(e, relax.Call) else None,
    )
    return names


def unary_module(op, shape, dtype: str = "float32") -> tvm.IRModule:
    """``main(x) = op(x)`` for one input ``x`` of ``shape`` and ``dtype``."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(shape, dtype))
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(op(x))
        bb.emit_func_output(out)
    return bb.get()


def depthwise_model(case):
    """A seeded depthwise conv + bias + ReLU in torch, and the same as Relax with constants.

    ``case`` is ``(input NCHW shape, kernel, stride, padding, dilation)``; returns
    ``(torch module, tvm.IRModule)``.
    """
    import torch

    shape, k, s, p, d = case
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(shape[1], shape[1], k, s, p, dilation=d, groups=shape[1])
    model = torch.nn.Sequential(conv, torch.nn.ReLU()).eval()
    weight = relax.const(conv.weight.detach().numpy())
    bias = relax.const(conv.bias.detach().numpy().reshape(1, -1, 1, 1))
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(shape, "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(
                relax.op.nn.conv2d(x, weight, strides=s, padding=p, dilation=d, groups=shape[1])
            )
            out = bb.emit_output(relax.op.nn.relu(relax.op.add(y, bias)))
        bb.emit_func_output(out)
    return model, bb.get()


def scheduled_kernels(mod, level: str, target, params=None) -> dict:
    """The PrimFuncs of ``mod`` built at ``level`` for ``target``, after the default CPU
    schedules (name -> scheduled PrimFunc)."""
    import tvmamp
    from tvmamp.pipeline import run_front_phases, schedule_passes

    converted = tvmamp.convert(mod, level, target, params=params)
    front = run_front_phases(converted)
    with target:
        scheduled = tvm.transform.Sequential(schedule_passes(target, converted.entry))(front)
    return {
        gvar.name_hint: func
        for gvar, func in scheduled.functions_items()
        if isinstance(func, tvm.tirx.PrimFunc)
    }
