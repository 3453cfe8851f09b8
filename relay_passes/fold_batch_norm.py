"""Fold inference batch norms into the convolution before them, as inference runtimes do.

``batch_norm(conv2d(x, W) [+ b], gamma, beta, mean, var)[0]`` with constant weights and
statistics (``training=False``) is ``conv2d(x, W * s) + ((b - mean) * s + beta)``, with
``s = gamma / sqrt(var + eps)`` per output channel, folded here into new constants, so the
batch norm costs nothing. Without this, a batch norm after a grouped or depthwise conv (which
``Conv2dToGemm``'s rows rewrite does not reach) was a kernel of its own, a full pass over the
activations (ShuffleNet, MobileNetV2). Only NCHW / OIHW convs whose result feeds nothing but
the batch norm are folded, and only batch norms over the channel axis. TVM's
``FoldBatchnormToConv2D`` checks neither ``training`` nor the layouts, hence this pass.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax
from tvm.ir.expr import Constant
from tvm.relax import PyExprMutator

from .bindings import use_counts

_CONV = tvm.ir.Op.get("relax.nn.conv2d")
_BATCH_NORM = tvm.ir.Op.get("relax.nn.batch_norm")
_ADD = tvm.ir.Op.get("relax.add")
_RESHAPE = tvm.ir.Op.get("relax.reshape")


@tvm.transform.module_pass(opt_level=0, name="tvmamp.FoldBatchNorm")
class FoldBatchNorm:
    """Fold every foldable inference ``batch_norm(conv2d(...))`` into the conv's weight.

    Parameters
    ----------
    constant_names : dict, optional
        Constant -> parameter name (from ``tvmamp.conversion.bind_params``), updated in place:
        a folded weight keeps its conv weight's name and the new bias its batch norm's bias
        name, so per-node patterns (``custom_fp32_nodes=["conv.*"]``) still match.
    """

    def __init__(self, constant_names: dict | None = None):
        self.constant_names = constant_names if constant_names is not None else {}

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        """Rewrite every Relax function of ``mod``."""
        funcs = [(g, f) for g, f in mod.functions_items() if isinstance(f, relax.Function)]
        uses: dict = {}
        for _, func in funcs:
            uses.update(use_counts(func))
        rewriter = _Rewriter(mod, uses, self.constant_names)
        for gvar, func in funcs:
            rewriter.builder_.update_func(gvar, rewriter.visit_expr(func))
        return relax.transform.DeadCodeElimination()(rewriter.builder_.get())


def _channel_vector(value: np.ndarray | None, channels: int) -> np.ndarray | None:
    """``value`` as a per-channel vector when it broadcasts along NCHW's channel axis only."""
    if value is None or value.size != channels or value.ndim > 4:
        return None
    shape = (1,) * (4 - value.ndim) + value.shape
    if shape != (1, channels, 1, 1):
        return None
    return value.reshape(channels).astype("float64")


def _np(expr) -> np.ndarray | None:
    return expr.value.numpy() if isinstance(expr, Constant) else None


@relax.expr_functor.mutator
class _Rewriter(PyExprMutator):
    def __init__(self, mod: tvm.IRModule, uses: dict, names: dict):
        super().__init__(mod)
        self.uses = uses
        self.names = names

    def visit_tuple_getitem_(self, op: relax.TupleGetItem) -> relax.Expr:
        folded = self._fold(op) if op.index == 0 else None
        return folded if folded is not None else super().visit_tuple_getitem_(op)

    def _fold(self, op: relax.TupleGetItem) -> relax.Expr | None:
        bn = self._value(op.tuple_value)
        if not (isinstance(bn, relax.Call) and bn.op == _BATCH_NORM):
            return None
        attrs = bn.attrs
        if bool(attrs.training) or int(attrs.axis) != 1:
            return None
        data, gamma, beta, mean, var = bn.args
        stats = [_np(a) for a in (gamma, beta, mean, var)]
        if any(s is None for s in stats) or self.uses.get(data, 0) != 1:
            return None  # statistics computed at run time, or the input is used elsewhere too
        conv, bias = self._value(data), np.zeros(stats[0].shape, "float64")
        if isinstance(conv, relax.Call) and conv.op == _ADD:  # conv2d + per-channel bias
            conv_var, bias_const = conv.args
            bias = _channel_vector(self._const(bias_const), stats[0].shape[0])
            if bias is None or self.uses.get(conv_var, 0) != 1:
                return None
            conv = self._value(conv_var)
        if not isinstance(conv, relax.Call) or conv.op != _CONV:
            return None
        layouts = (conv.attrs.data_layout, conv.attrs.kernel_layout, conv.attrs.out_layout)
        weight = _np(conv.args[1])
        if layouts != ("NCHW", "OIHW", "NCHW") or weight is None:
            return None
        gamma, beta, mean, var = (s.astype("float64") for s in stats)
        if not bool(attrs.scale):
            gamma = np.ones_like(gamma)
        if not bool(attrs.center):
            beta = np.zeros_like(beta)
        scale = gamma / np.sqrt(var + float(attrs.epsilon))
        dtype = weight.dtype
        folded = (weight.astype("float64") * scale.reshape(-1, 1, 1, 1)).astype(dtype)
        shift = ((bias - mean) * scale + beta).astype(dtype).reshape(1, -1, 1, 1)
        x = self.visit_expr(conv.args[0])
        new_weight, new_shift = relax.const(folded), relax.const(shift)
        for new, old in ((new_weight, conv.args[1]), (new_shift, bn.args[2])):
            if old in self.names:
                self.names[new] = self.names[old]
        return relax.op.add(relax.Call(conv.op, [x, new_weight], conv.attrs), new_shift)

    def _const(self, expr: relax.Expr) -> np.ndarray | None:
        """The value of a constant, or of a reshape of one (how importers give a conv bias)."""
        value = self._value(expr)
        if isinstance(value, relax.Call) and value.op == _RESHAPE:
            source = _np(self._value(value.args[0]))
            shape = [int(d) for d in value.ty.shape.values] if source is not None else None
            return None if source is None else source.reshape(shape)
        return _np(value)

    def _value(self, expr: relax.Expr) -> relax.Expr | None:
        return self.lookup_binding(expr) if isinstance(expr, relax.Var) else expr
