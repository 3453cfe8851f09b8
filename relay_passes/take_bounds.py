"""GuardTakeIndices: a run-time index out of range raises ``IndexError``; it never reads past
the table.

torch's importer turns ``nn.Embedding`` and ``index_select`` into ``take(..., mode="fast")``,
and TVM's ``take`` in that mode loads ``table[index]`` unchecked. A token id at or past the
vocabulary size, or a negative one, therefore read whatever memory lay there: a wrong output,
silently, or a segfault that took the whole process with it (``ids[0, 0] = 10**8`` on a
100-row embedding did). torch raises ``IndexError`` for the same input, and onnxruntime an
error too.

Each ``take`` in fast mode whose indices are not a constant now reads them through a small
check kernel: it copies the indices (a view of them as one row) and asserts, per index, that
``0 <= index < n``, ``n`` being the taken axis's extent (symbolic extents are passed in at run
time). A failed assertion is a Python ``IndexError`` naming the valid range. The copy costs one
pass over the indices, a few hundred bytes for a batch of token ids; the gathered rows, what
the ``take`` itself moves, are unchanged.

Negative indices are out of range here, as for ``nn.Embedding``: frontends that give them a
meaning (ONNX ``Gather``, torch's ``x[..., -1]``) wrap them before the ``take``. A constant
index is left alone: it cannot change at run time.

The kernel reads host memory, so the pass is for CPU targets (``targets/llvm.py``).
"""

from __future__ import annotations

import math

import tvm
from tvm import relax, tirx
from tvm.ir.expr import Constant
from tvm.relax import PyExprMutator
from tvm.script import tirx as T

from tvmamp.tensors import type_dtype

from .bindings import rewrite_functions

_TAKE = tvm.ir.Op.get("relax.take")


@tvm.transform.module_pass(opt_level=0, name="tvmamp.GuardTakeIndices")
class GuardTakeIndices:
    """Read the run-time indices of every fast-mode ``take`` through a range check."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return rewrite_functions(mod, _Rewriter(mod))


@relax.expr_functor.mutator
class _Rewriter(PyExprMutator):
    def __init__(self, mod: tvm.IRModule):
        super().__init__(mod)
        self.checkers: dict[tuple[str, str], tvm.ir.GlobalVar] = {}

    def visit_call_(self, call):  # pylint: disable=arguments-renamed
        call = super().visit_call_(call)
        if not (isinstance(call, relax.Call) and call.op.same_as(_TAKE)):
            return call
        if str(call.attrs.mode) != "fast":
            return call
        data, indices = call.args
        extent = _extent(data.ty, call.attrs.axis)
        index_ty = indices.ty
        dtype = type_dtype(index_ty)
        if (
            isinstance(indices, Constant)
            or extent is None
            or not isinstance(index_ty, relax.TensorType)
            or index_ty.shape is None
            or dtype is None
            or not dtype.startswith(("int", "uint"))
        ):
            return call
        dims = list(index_ty.shape.values)
        count = math.prod(dims) if dims else tirx.IntImm("int64", 1)
        flat = self.builder_.emit(relax.op.reshape(indices, [count]))
        checked = self.builder_.emit(
            relax.call_tir(
                self._checker(dtype, data.ty, call.attrs.axis),
                [flat, relax.prim_value(_as_int64(extent))],
                relax.TensorType([count], dtype),
            )
        )
        restored = self.builder_.emit(relax.op.reshape(checked, dims))
        return relax.Call(call.op, [data, restored], call.attrs)

    def _checker(self, dtype: str, table_ty, axis) -> tvm.ir.GlobalVar:
        where = "the flattened table" if axis is None else f"axis {int(axis)}"
        extent = _extent(table_ty, axis)
        message = (
            f"tvmamp: an index of a take (an embedding lookup or gather) on a table of shape "
            f"{_shape_text(table_ty)} is out of range: each index along {where} must lie in "
            f"[0, {_dim_text(extent)}) (torch raises IndexError for the same input)"
        )
        key = (dtype, message)
        if key not in self.checkers:
            self.checkers[key] = self.builder_.add_func(
                _check_kernel(dtype, message), "check_index"
            )
        return self.checkers[key]


def _check_kernel(dtype: str, message: str) -> tirx.PrimFunc:
    """Copy ``m`` indices, asserting ``0 <= index < n`` for each (``IndexError`` otherwise)."""

    @T.prim_func(private=True, s_tir=True)
    def check_index(var_ids: T.handle, n: T.int64, var_out: T.handle):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
        m = T.int64()
        ids = T.match_buffer(var_ids, (m,), dtype)
        out = T.match_buffer(var_out, (m,), dtype)
        with T.sblock("root"):
            for i in range(m):
                index = T.Cast("int64", ids[i])
                with T.Assert(T.int64(0) <= index and index < n, [message], "IndexError"):
                    out[i] = ids[i]

    return check_index


def _extent(data_ty, axis):
    """The extent of the taken axis (the element count for ``axis=None``), or None."""
    if not isinstance(data_ty, relax.TensorType) or data_ty.shape is None:
        return None
    dims = list(data_ty.shape.values)
    if axis is None:
        return math.prod(dims) if dims else None
    return dims[int(axis) % len(dims)] if dims else None


def _as_int64(dim):
    if isinstance(dim, int):
        return tirx.IntImm("int64", dim)
    return dim if str(dim.ty) == "int64" else tirx.Cast("int64", dim)


def _dim_text(dim) -> str:
    return str(int(dim)) if isinstance(dim, tirx.IntImm) else str(dim)


def _shape_text(ty) -> str:
    return "(" + ", ".join(_dim_text(d) for d in ty.shape.values) + ")"
