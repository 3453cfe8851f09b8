"""Legalization of low-precision reductions: read the low values, add up in fp32.

TVM legalizes ``sum``, ``mean`` and the like in their input's dtype, so a
bfloat16 sum keeps a bfloat16 running total, which stops growing at 256 times the value it
adds: a bf16 model's ``x.sum(-1)`` over 4096 values near 0.8 gave 1024 at O0 instead of 3284
(frameworks keep an fp32 accumulator for low reductions). :data:`LEGALIZE_MAP`, given to
``LegalizeOps``, computes each such reduction of a float16/bfloat16 input as the fp32
reduction of its widened input, rounded once at the end; the cast in fuses into the kernel.
Reductions of other dtypes keep TVM's legalization. The AMP pass gives the reductions it
lowers an fp32 result already (``_SUMMING_REDUCTIONS``); this covers the rest (a low model at
O0, per-node rules).
"""

from __future__ import annotations

import tvm
from tvm import relax

# cumsum and cumprod are not legalized by LegalizeOps (no FLegalize rule): a low model's
# cumsum still adds up low; the AMP pass widens the ones it lowers itself.
REDUCTIONS = ("sum", "mean", "variance", "std", "prod")
LOW_DTYPES = ("float16", "bfloat16")


def _widened(op_name: str):
    def legalize(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
        # TVM's own rule, looked up when it runs (legalize_ops registers them on import)
        default = tvm.ir.Op.get(op_name).get_attr("FLegalize")
        dtype = str(call.args[0].ty.dtype)
        out = call.ty
        if dtype not in LOW_DTYPES or not isinstance(out, relax.TensorType):
            return default(bb, call)
        if str(out.dtype) != dtype:  # an explicit output dtype (cumsum's): as written
            return default(bb, call)
        wide = bb.emit(relax.op.astype(call.args[0], "float32"))
        reduced = bb.normalize(relax.Call(call.op, [wide, *call.args[1:]], call.attrs))
        return relax.op.astype(reduced, dtype)

    return legalize


LEGALIZE_MAP = {f"relax.{name}": _widened(f"relax.{name}") for name in REDUCTIONS}

__all__ = ["LEGALIZE_MAP"]
