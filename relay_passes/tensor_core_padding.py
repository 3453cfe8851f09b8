"""TensorCorePadding: pad low-precision matmul and conv2d shapes to tensor-core multiples.

Tensor cores take 16x8x16 (mma.sync) or 16x16x16 (wmma) tiles; NVIDIA's guidance is M, N and K
(and conv channels) in multiples of 8 for fp16, 16 from A100 on. This pass pads the operands of
every matmul and conv2d whose inputs are in ``dtypes`` with zeros up to ``multiple`` and slices
the result back, so the padding is invisible: the function's types and values are unchanged.
Padded constants (weights) fold at compile time; padded activations cost one pad each.
"""

from __future__ import annotations

from collections.abc import Sequence

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from tvmamp.tensors import static_shape, tensor_dtype

_MATMUL = tvm.ir.Op.get("relax.matmul")
_CONV2D = tvm.ir.Op.get("relax.nn.conv2d")


def round_up(value: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is >= ``value``."""
    return -(-value // multiple) * multiple


@mutator
class _Padder(PyExprMutator):
    def __init__(self, mod: tvm.IRModule, multiple: int, dtypes: Sequence[str]):
        super().__init__(mod)
        self.multiple = multiple
        self.dtypes = tuple(dtypes)
        self.padded = 0

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if call.op.same_as(_MATMUL) and self._low(call):
            return self._matmul(call)
        if call.op.same_as(_CONV2D) and self._low(call) and int(call.attrs.groups) == 1:
            return self._conv2d(call)
        return call

    def _low(self, call: relax.Call) -> bool:
        return all(tensor_dtype(arg) in self.dtypes for arg in call.args[:2])

    def _pad(self, expr: relax.Expr, dims: tuple[int, ...], axes: dict[int, int]) -> relax.Expr:
        """Zero-pad ``expr`` (shape ``dims``) at the end of each axis in ``axes`` to its size."""
        width = []
        for axis, dim in enumerate(dims):
            width += [0, axes.get(axis, dim) - dim]
        if not any(width):
            return expr
        return self.builder_.emit(relax.op.nn.pad(expr, width, pad_value=0.0))

    def _slice(self, expr: relax.Expr, ends: dict[int, tuple[int, int]]) -> relax.Expr:
        """Slice axis ``a`` of ``expr`` back from its padded to its original size ``ends[a]``."""
        self.padded += 1
        axes = sorted(a for a, (size, padded) in ends.items() if size != padded)
        if not axes:
            return expr
        out = self.builder_.emit(expr)
        return relax.op.strided_slice(out, axes, [0] * len(axes), [ends[a][0] for a in axes])

    def _matmul(self, call: relax.Call) -> relax.Expr:
        a, b = call.args
        a_dims, b_dims = static_shape(a.ty), static_shape(b.ty)
        if a_dims is None or b_dims is None or len(a_dims) < 2 or len(b_dims) < 2:
            return call
        (m, k), n = a_dims[-2:], b_dims[-1]
        mp, kp, np_ = (round_up(v, self.multiple) for v in (m, k, n))
        if (mp, kp, np_) == (m, k, n):
            return call
        a = self._pad(a, a_dims, {len(a_dims) - 2: mp, len(a_dims) - 1: kp})
        b = self._pad(b, b_dims, {len(b_dims) - 2: kp, len(b_dims) - 1: np_})
        out = relax.op.matmul(a, b, out_dtype=call.attrs.out_dtype)
        rank = len(static_shape(call.ty))
        return self._slice(out, {rank - 2: (m, mp), rank - 1: (n, np_)})

    def _conv2d(self, call: relax.Call) -> relax.Expr:
        data, weight = call.args
        d_dims, w_dims = static_shape(data.ty), static_shape(weight.ty)
        if d_dims is None or w_dims is None:
            return call
        attrs = call.attrs
        c_axis = str(attrs.data_layout).index("C")
        i_axis, o_axis = (str(attrs.kernel_layout).index(c) for c in "IO")
        out_axis = str(attrs.out_layout or attrs.data_layout).index("C")
        c_in, c_out = d_dims[c_axis], w_dims[o_axis]
        cp_in, cp_out = round_up(c_in, self.multiple), round_up(c_out, self.multiple)
        if (cp_in, cp_out) == (c_in, c_out):
            return call
        data = self._pad(data, d_dims, {c_axis: cp_in})
        weight = self._pad(weight, w_dims, {i_axis: cp_in, o_axis: cp_out})
        out = relax.Call(call.op, [data, weight], call.attrs)
        return self._slice(out, {out_axis: (c_out, cp_out)})


@tvm.transform.module_pass(opt_level=0, name="tvmamp.TensorCorePadding")
class TensorCorePadding:
    """Pad matmul M/N/K and conv2d channels to a multiple of ``multiple`` (then slice back).

    Parameters
    ----------
    multiple : int
        8 for fp16 before sm_80, 16 on sm_80 and later (``tensor_core_multiple``).
    dtypes : sequence of str
        Input dtypes of the ops to pad; fp16 and bf16 by default. Tests pass "float32" to check
        the rewrite's numerics on a CPU.

    Attributes
    ----------
    padded : int
        How many ops the last run padded.
    """

    def __init__(self, multiple: int = 16, dtypes: Sequence[str] = ("float16", "bfloat16")):
        if isinstance(multiple, bool) or not isinstance(multiple, int) or multiple < 1:
            raise ValueError(
                f"tvmamp.TensorCorePadding: multiple {multiple!r} must be a positive int "
                "(8 for fp16 before sm_80, 16 on sm_80 and later)"
            )
        self.multiple = multiple
        self.dtypes = tuple(dtypes)
        self.padded = 0

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        padder = _Padder(mod, self.multiple, self.dtypes)
        for gvar, func in mod.functions_items():
            if isinstance(func, relax.Function):
                padder.builder_.update_func(gvar, padder.visit_expr(func))
        self.padded = padder.padded
        return padder.builder_.get()


def tensor_core_multiple(compute_capability: int) -> int:
    """The padding multiple for a GPU: 16 on sm_80 and later, 8 before."""
    return 16 if compute_capability >= 80 else 8
