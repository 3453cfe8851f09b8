"""TakeToSlice: a ``take`` of one constant index along an axis is a slice.

torch's ``x[i]`` and ``x.select(axis, i)`` import as ``take(x, const(i), axis)``. ``take`` is on
Paddle's black list (as ``lookup_table``: an embedding's gather by run-time ids), so at O1 and
O2 such a select ran in fp32, and whatever produced ``x`` handed it an fp32 tensor.
``nn.MultiheadAttention`` splits its in-projection into q, k and v this way: the in-projection
GEMM of a TransformerEncoderLayer wrote fp32, and three fp32 copies followed (0.36 ms of a
16 ms layer).

A constant in-range index selects a fixed slice: ``squeeze(strided_slice(x, [axis], [i],
[i + 1]), [axis])`` gives the same values. Both are data movement (follow ops), so they take
the dtype of their input, and the lookup_table rule stays with the gathers it was written for.
An index out of range, a non-scalar index, or an unknown shape is left as it was.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax
from tvm.ir.expr import Constant
from tvm.relax import PyExprMutator

from tvmamp.tensors import static_shape

from .bindings import rewrite_functions

_TAKE = tvm.ir.Op.get("relax.take")


@tvm.transform.module_pass(opt_level=0, name="tvmamp.TakeToSlice")
class TakeToSlice:
    """Rewrite each ``take`` of a constant scalar index into a slice and a squeeze."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return rewrite_functions(mod, _Rewriter(mod))


@relax.expr_functor.mutator
class _Rewriter(PyExprMutator):
    def visit_call_(self, call):  # pylint: disable=arguments-renamed
        call = super().visit_call_(call)
        if not (isinstance(call, relax.Call) and call.op.same_as(_TAKE)):
            return call
        data, index = call.args
        position = _scalar_index(index)
        shape = static_shape(data.ty)
        axis = call.attrs.axis
        if position is None or shape is None or axis is None:
            return call
        axis = int(axis) % len(shape)
        if position < 0:
            position += shape[axis]
        if not 0 <= position < shape[axis]:
            return call
        part = relax.op.strided_slice(data, [axis], [position], [position + 1])
        return relax.op.squeeze(part, [axis])


def _scalar_index(index) -> int | None:
    """The value of a 0-d integer constant, else None."""
    if not isinstance(index, Constant):
        return None
    value = index.value.numpy()
    if value.ndim != 0 or not np.issubdtype(value.dtype, np.integer):
        return None
    return int(value)
