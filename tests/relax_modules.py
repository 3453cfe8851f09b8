"""Small Relax modules the tests build ops into (imported by name, like ``tolerances``)."""

from __future__ import annotations

import tvm
from tvm import relax


def unary_module(op, shape, dtype: str = "float32") -> tvm.IRModule:
    """``main(x) = op(x)`` for one input ``x`` of ``shape`` and ``dtype``."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(shape, dtype))
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(op(x))
        bb.emit_func_output(out)
    return bb.get()
