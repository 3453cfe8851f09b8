"""Keep a concatenation over symbolic sizes fusable with its neighbours.

TVM legalizes ``relax.concat`` to one TE kernel that selects, per output element, the input it
comes from. Over symbolic sizes ``AnnotateTIROpPattern`` cannot prove those selects injective
and calls the kernel opaque, so ``FuseOps`` fuses nothing into it. A decoder's key-value
cache at O2 then ran as three kernels where one does: the cached ``past`` rounded to bf16
(``cast``), the concatenation, and each reader of it. In a GPT-2 decoder (4 layers of 768,
512 cached positions, one thread) the rounding kernels alone took 0.45 of 4.1 ms a step.

:data:`LEGALIZE_MAP`, given to ``LegalizeOps``, legalizes a concatenation over symbolic sizes
as TVM does and marks its kernel injective, which it is: each output element is one input
element, chosen by its index alone. Static concatenations keep TVM's own annotation.
"""

from __future__ import annotations

import tvm
from tvm import relax

from tvmamp.tensors import static_shape

from .fused_functions import INJECTIVE

_TVM_LEGALIZE = tvm.ir.Op.get("relax.concat").get_attr("FLegalize")


def _legalize_concat(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    legalized = _TVM_LEGALIZE(bb, call)
    if static_shape(call.ty) is not None or not _calls_tir(legalized):
        return legalized
    gvar = legalized.args[0]
    kernel = bb.get()[gvar]
    if isinstance(kernel, tvm.tirx.PrimFunc) and not (kernel.attrs or {}).get("op_pattern"):
        bb.update_func(gvar, kernel.with_attr("op_pattern", INJECTIVE))
    return legalized


def _calls_tir(expr: relax.Expr) -> bool:
    return (
        isinstance(expr, relax.Call)
        and expr.op.same_as(tvm.ir.Op.get("relax.call_tir"))
        and isinstance(expr.args[0], tvm.ir.GlobalVar)
    )


LEGALIZE_MAP = {"relax.concat": _legalize_concat}

__all__ = ["LEGALIZE_MAP"]
