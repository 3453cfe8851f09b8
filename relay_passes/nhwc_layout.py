"""ConvertConvToNHWC: put low-precision conv2d in NHWC/OHWI, the layout tensor cores want."""

from __future__ import annotations

from collections.abc import Sequence

import tvm
from tvm import relax

from tvmamp.tensors import tensor_dtype

DATA_LAYOUT = "NHWC"
KERNEL_LAYOUT = "OHWI"


@tvm.transform.module_pass(opt_level=0, name="tvmamp.ConvertConvToNHWC")
class ConvertConvToNHWC:
    """Convert conv2d to NHWC data and OHWI weights with ``relax.transform.ConvertLayout``.

    In NHWC the channels are the contiguous axis of both operands, so a conv2d is an implicit
    GEMM whose K axis (KH*KW*C) is read 16 bytes at a time, and the weights need no transpose.
    ConvertLayout also moves the elementwise ops between convs (batch_norm, relu, add) to NHWC
    and inserts transposes only where the model's layout is observed (inputs, outputs, reshapes).

    Parameters
    ----------
    dtypes : sequence of str
        Only modules with a conv2d on these input dtypes are converted (fp16 and bf16 by
        default); an fp32 model keeps its layout.
    """

    def __init__(self, dtypes: Sequence[str] = ("float16", "bfloat16")):
        self.dtypes = tuple(dtypes)

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        if not any(self._low_conv(call) for call in _conv2d_calls(mod)):
            return mod
        layouts = {"relax.nn.conv2d": [DATA_LAYOUT, KERNEL_LAYOUT]}
        return relax.transform.ConvertLayout(layouts)(mod)

    def _low_conv(self, call: relax.Call) -> bool:
        return tensor_dtype(call.args[0]) in self.dtypes and str(call.attrs.data_layout) != "NHWC"


def _conv2d_calls(mod: tvm.IRModule) -> list[relax.Call]:
    conv2d = tvm.ir.Op.get("relax.nn.conv2d")
    calls = []

    def visit(expr):
        if isinstance(expr, relax.Call) and expr.op.same_as(conv2d):
            calls.append(expr)

    for _, func in mod.functions_items():
        if isinstance(func, relax.Function):
            relax.analysis.post_order_visit(func, visit)
    return calls
