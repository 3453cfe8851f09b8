"""A row rearrangement before a matmul with a matrix weight, moved into the copies after it.

``x[..., k] @ W[k, n]`` (and an epilogue of elementwise ops whose other operands hold one
value per column: a bias, a cast, an activation) computes each row on its own, so a
``permute_dims`` that keeps the last axis, or a ``reshape`` that keeps the last dimension, gives
the same values before or after it. torch's batch-first ``nn.MultiheadAttention`` (as in a
TransformerEncoderLayer) transposes its input to sequence-first before the ``qkv`` projection:
a kernel that casts and transposes, although the head split after the projection is a chain
of copies anyway.

:class:`SinkRowLayoutBelowMatmul` moves such an op from a matmul's input to the epilogue's
result, when the input is not itself the result of a layout op and every reader of the
epilogue's result is a copying layout op (``permute_dims``, ``strided_slice``, ``split``) or a
view (``reshape``, ``squeeze``) whose readers are: the rearrangement then joins that chain of
copies, which ``FuseOps`` makes one kernel and :mod:`.gemm_layout` merges into the GEMMs'
packing. (A view alone would become a copy of the wider result.) Every value it moves across
must have no other reader. It rewrites until nothing moves; binding names are kept for
per-node precision control, and the moved op is named after the matmul (``<matmul>_rows``).

The other direction, the output projection's transpose back to batch-first moved above the
matmul so that the residual add fuses into the GEMM, was measured and left out: the GEMM then
read the residual (2 MB of fp32, cold) inside its compute loop and took 0.3 ms longer than
the separate add kernel it saved (Zen5, TransformerEncoderLayer(512, 8, 2048), 8 x 128
tokens; BENCHMARKS.md).
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax import PyExprMutator

from tvmamp.tensors import static_shape

from .bindings import bound_values, call_of, rebind, use_counts
from .matmul_broadcast import epilogue_argument

_MATMUL = tvm.ir.Op.get("relax.matmul")
_PERMUTE = tvm.ir.Op.get("relax.permute_dims")
_RESHAPE = tvm.ir.Op.get("relax.reshape")
# Ops that only rearrange or select elements: the readers a sunk rearrangement joins.
LAYOUT_OPS = frozenset(
    tvm.ir.Op.get(f"relax.{name}")
    for name in ("permute_dims reshape expand_dims squeeze strided_slice split flatten").split()
)
# Those of them that the VM runs as views of their input (RewriteDataflowReshape), no copy.
_VIEW_OPS = frozenset(
    tvm.ir.Op.get(f"relax.{name}") for name in ("reshape expand_dims squeeze flatten").split()
)
_MAX_ROUNDS = 8


@tvm.transform.module_pass(opt_level=0, name="tvmamp.SinkRowLayoutBelowMatmul")
class SinkRowLayoutBelowMatmul:
    """Move a row-preserving ``permute_dims``/``reshape`` from a matmul's input (with a matrix
    weight) to its epilogue's result, where it joins a chain of copies (module docstring)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        """Rewrite every Relax function of ``mod`` until no op moves."""
        for _ in range(_MAX_ROUNDS):
            rewriter = _Rewriter(mod)
            for gvar, func in mod.functions_items():
                if isinstance(func, relax.Function):
                    rewriter.start(func)
                    rewriter.builder_.update_func(gvar, rewriter.visit_expr(func))
            if not rewriter.moved:
                return mod
            mod = relax.transform.DeadCodeElimination()(rewriter.builder_.get())
        return mod


def _shape(expr: relax.Expr) -> tuple[int, ...] | None:
    return static_shape(getattr(expr, "ty", None))  # None for a non-tensor or dynamic shape


def _row_layout(value: relax.Expr | None) -> relax.Call | None:
    """``value`` when it is a ``permute_dims`` keeping the last axis last, or a ``reshape``
    keeping the last dimension, of a static shape."""
    call = call_of(value, _PERMUTE)
    call = call if call is not None else call_of(value, _RESHAPE)
    if call is None:
        return None
    source, result = _shape(call.args[0]), _shape(call)
    if source is None or result is None or not source or not result:
        return None
    if call.op == _PERMUTE:
        axes = call.attrs.axes
        last = len(source) - 1
        return call if axes is not None and int(axes[-1]) == last else None
    return call if source[-1] == result[-1] else None


def _on_rows(layout: relax.Call, x: relax.Expr, columns: int) -> relax.Expr:
    """``layout``'s rearrangement of rows applied to ``x``, whose rows have ``columns``."""
    if layout.op == _PERMUTE:
        return relax.op.permute_dims(x, [int(a) for a in layout.attrs.axes])
    return relax.op.reshape(x, [*_shape(layout)[:-1], columns])


@relax.expr_functor.mutator
class _Rewriter(PyExprMutator):
    def __init__(self, mod: tvm.IRModule):
        super().__init__(mod)
        self.values: dict = {}  # var -> bound value, of the function being rewritten
        self.uses: dict = {}  # var -> how many times it is read
        self.readers: dict = {}  # var -> the values that read it
        self.vars: dict = {}  # bound value -> its var
        self.moved = False

    def start(self, func: relax.Function) -> None:
        self.values, self.uses = bound_values(func), use_counts(func)
        self.vars = {value: var for var, value in self.values.items()}
        self.readers = {}
        for value in self.values.values():
            for arg in getattr(value, "args", []):
                if isinstance(arg, relax.Var):
                    self.readers.setdefault(arg, []).append(value)

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        moved = self._sunk(binding)
        if moved is None:
            super().visit_var_binding_(binding)
            return
        rebind(self, binding.var, *moved)
        self.moved = True

    def _chain(self, end: relax.Var):
        """``(matmul var, [(var, call, chain argument index)] of the epilogue)`` for ``end``
        bound to ``epilogue(matmul(a, W))`` with ``W`` a matrix and every value after the
        matmul read once (``end`` aside); None otherwise."""
        chain, current = [], end
        while True:
            value = self.values.get(current)
            matmul = call_of(value, _MATMUL)
            if matmul is not None:
                weight = _shape(matmul.args[1])
                a = _shape(matmul.args[0])
                return (current, chain) if weight and len(weight) == 2 and a else None
            index = epilogue_argument(value, current)
            if index is None:
                return None
            chain.insert(0, (current, value, index))
            current = value.args[index]
            if not isinstance(current, relax.Var) or self.uses.get(current, 0) != 1:
                return None

    def _rebuilt(self, a: relax.Expr, matmul_var: relax.Var, chain) -> relax.Expr:
        """The matmul of ``matmul_var`` on ``a`` instead, then ``chain``, the last unbound."""
        matmul = self.values[matmul_var]
        value = relax.op.matmul(a, self.visit_expr(matmul.args[1]), matmul.attrs.out_dtype)
        name = matmul_var.name
        for var, call, index in chain:
            operand = self.builder_.emit(value, name)
            rank = len(_shape(operand))
            args = [self.visit_expr(arg) for arg in call.args]
            if any(len(_shape(arg) or ()) > rank for i, arg in enumerate(args) if i != index):
                return None  # a per-column operand of more axes would broadcast the rows
            args[index] = operand
            value, name = relax.Call(call.op, args, call.attrs, call.ty_args), var.name
        return value

    def _copied(self, var: relax.Var) -> bool:
        """Whether every reader of ``var`` is a copying layout op, or a view whose readers are
        (so the moved rearrangement joins a copy that is made anyway, never adds one)."""
        readers = self.readers.get(var, [])
        if not readers or self.uses.get(var, 0) != len(readers):
            return False
        for reader in readers:
            op = getattr(reader, "op", None)
            if op in _VIEW_OPS and not self._copied(self.vars[reader]):
                return False
            if op not in LAYOUT_OPS:
                return False
        return True

    def _sunk(self, binding: relax.VarBinding) -> tuple[relax.Expr, str] | None:
        """``binding`` = ``epilogue(matmul(L(x), W))`` read only by layout ops, with ``x`` no
        layout op's result: ``L`` of the epilogue of ``matmul(x, W)`` (which keeps
        ``binding``'s name), and the name of its binding."""
        readers = self.readers.get(binding.var, [])
        if not readers or not self._copied(binding.var):
            return None
        plan = self._chain(binding.var)
        if plan is None:
            return None
        matmul_var, chain = plan
        a = self.values[matmul_var].args[0]
        layout = _row_layout(self.values.get(a))
        if layout is None or self.uses.get(a, 0) != 1:
            return None
        x = layout.args[0]
        if getattr(self.values.get(x), "op", None) in LAYOUT_OPS:
            return None
        value = self._rebuilt(self.visit_expr(x), matmul_var, chain)
        if value is None:
            return None
        out = self.builder_.emit(value, binding.var.name)
        return _on_rows(layout, out, _shape(binding.var)[-1]), f"{matmul_var.name}_rows"
