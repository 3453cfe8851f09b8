"""Checks of one Relax call against an NPU descriptor: each returns why it cannot run, or None."""

from __future__ import annotations

from tvm import relax

from tvmamp.tensors import static_shape, tensor_dtype

from .descriptor import NpuDescriptor


def shape_of(expr) -> tuple[int, ...] | None:
    """The static shape of a tensor-typed expression, or None (dynamic or not a tensor)."""
    return static_shape(getattr(expr, "ty", None))


def tensor_reason(desc: NpuDescriptor, call: relax.Call, accumulates: bool = False) -> str | None:
    """Dtypes and shapes of a call's tensor inputs and output: static, rank and dtype limits."""
    out_dtypes = desc.accumulate_dtypes if accumulates else desc.dtypes
    for role, expr, allowed in [
        *(("input", arg, desc.dtypes) for arg in call.args),
        ("output", call, out_dtypes),
    ]:
        shape, dtype = shape_of(expr), tensor_dtype(expr)
        if shape is None:
            return f"{role} has no static tensor shape"
        if len(shape) > desc.max_rank:
            return f"{role} rank {len(shape)} > {desc.max_rank}"
        if dtype not in allowed:
            return f"{role} dtype {dtype} (the NPU takes {'/'.join(allowed)})"
    return None


def _multiple(what: str, value: int, multiple: int) -> str | None:
    return None if value % multiple == 0 else f"{what} {value} is not a multiple of {multiple}"


def matmul_reason(desc: NpuDescriptor, call: relax.Call) -> str | None:
    """Matmul: rank >= 2 operands, a 2-D or same-batch right operand, K and N multiples."""
    reason = tensor_reason(desc, call, accumulates=True)
    if reason:
        return reason
    a, b = shape_of(call.args[0]), shape_of(call.args[1])
    if len(a) < 2 or len(b) < 2:
        return "matmul operands must have rank >= 2"
    if len(b) > 2 and b[:-2] != a[:-2]:
        return f"batch dims of {b} do not match {a} (the NPU does not broadcast batches)"
    return _multiple("K", a[-1], desc.channel_multiple) or _multiple(
        "N", b[-1], desc.channel_multiple
    )


def _window_reason(desc, attrs, layout_attr: str, window) -> str | None:
    layout = str(getattr(attrs, layout_attr))
    if layout != desc.data_layout or str(attrs.out_layout) != desc.data_layout:
        return f"layout {layout}/{attrs.out_layout} (the NPU takes {desc.data_layout})"
    if max(int(d) for d in attrs.dilation) > desc.max_dilation:
        return f"dilation {tuple(int(d) for d in attrs.dilation)} > {desc.max_dilation}"
    if max(window) > desc.max_kernel:
        return f"window {tuple(window)} larger than {desc.max_kernel}"
    return None


def conv2d_reason(desc: NpuDescriptor, call: relax.Call) -> str | None:
    """Conv2d: layouts, groups 1, dilation, window and channel multiples."""
    reason = tensor_reason(desc, call, accumulates=True)
    if reason:
        return reason
    attrs = call.attrs
    if str(attrs.kernel_layout) != desc.kernel_layout:
        return f"kernel layout {attrs.kernel_layout} (the NPU takes {desc.kernel_layout})"
    if int(attrs.groups) != 1:
        return f"groups {int(attrs.groups)} (the NPU runs groups=1 only)"
    weight = shape_of(call.args[1])
    reason = _window_reason(desc, attrs, "data_layout", weight[2:])
    return (
        reason
        or _multiple("input channels", weight[1], desc.channel_multiple)
        or _multiple("output channels", weight[0], desc.channel_multiple)
    )


def max_pool2d_reason(desc: NpuDescriptor, call: relax.Call) -> str | None:
    """Max pool: layout, dilation, window, no ceil mode, innermost dim a vector multiple."""
    reason = tensor_reason(desc, call)
    if reason:
        return reason
    if bool(call.attrs.ceil_mode):
        return "ceil_mode=True"
    reason = _window_reason(desc, call.attrs, "layout", [int(p) for p in call.attrs.pool_size])
    return reason or _multiple("innermost dim", shape_of(call)[-1], desc.vector_multiple)


def elementwise_reason(desc: NpuDescriptor, call: relax.Call) -> str | None:
    """add / multiply / relu: dtypes and the innermost output dim a vector multiple."""
    reason = tensor_reason(desc, call)
    if reason:
        return reason
    shape = shape_of(call)
    if not shape:
        return "a scalar result"
    return _multiple("innermost dim", shape[-1], desc.vector_multiple)


def bias_reason(desc: NpuDescriptor, bias, channels: int, axis: int) -> str | None:
    """A bias must hold one value per output channel, laid out along ``axis`` (from the end)."""
    shape = shape_of(bias)
    if shape is None or tensor_dtype(bias) not in desc.dtypes:
        return "bias is not a static tensor of an NPU dtype"
    padded = (1,) * max(0, -axis - len(shape)) + shape
    expected = [1] * len(padded)
    expected[axis] = channels
    if list(padded) != expected:
        return f"bias shape {shape} is not one value per channel ({channels})"
    return None


OP_REASONS = {
    "relax.matmul": matmul_reason,
    "relax.nn.conv2d": conv2d_reason,
    "relax.nn.max_pool2d": max_pool2d_reason,
    "relax.add": elementwise_reason,
    "relax.multiply": elementwise_reason,
    "relax.nn.relu": elementwise_reason,
    "relax.nn.gelu": elementwise_reason,
}


def op_reason(desc: NpuDescriptor, call: relax.Call) -> str | None:
    """Why the NPU cannot run this single call (None when it can)."""
    name = call.op.name
    if name not in desc.runnable_ops():
        return f"{name} is not an op of {desc.name}"
    return OP_REASONS[name](desc, call)
