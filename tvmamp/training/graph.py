"""The differentiated, loss-scaled and mixed-precision part of the training graph.

``main(*inputs, *params)`` -> the loss appended to its block (``_appended_loss``) ->
``scaled_loss(*inputs, *params, targets, amp_loss_scale) = (loss * amp_loss_scale, loss)`` ->
Gradient -> AutoMixedPrecision. The AMP pass runs after Gradient (converting first breaks
Gradient's type check, REFERENCE.md) on the forward and backward ops only, the loss and the
scale's ops kept fp32 (``SCALE_NODES``); the optimizer update stays fp32 (master weights).
"""

from __future__ import annotations

import inspect

import tvm
from tvm import relax
from tvm.relax import PyExprMutator

from tvmamp.conversion import Converted, convert

from .model import ForwardModel

# Binding and parameter names of the loss-scale ops and of every 0-d float value of the adjoint
# (the loss, the scaled loss, the seed of the backward pass and the mean's scalar backward): the
# AMP policy keeps them fp32 (free for scalars), so a scale such as 65536 never meets fp16 as a
# scalar (65536 > 65504 would be inf); it reaches the low dtype divided by the element count.
# The loss's own bindings are named ``amp_loss_*`` (``_appended_loss``), so it is fp32 too.
SCALE_NODES = ("amp_*",)

# The keyword options of tvmamp.convert a Trainer passes on: it gives the model, level, target,
# dtype and params itself, and keep_io_types is always True (see ``convert_adjoint``).
AMP_OPTIONS = tuple(
    name
    for name in inspect.signature(convert).parameters
    if name not in ("mod", "level", "target", "dtype", "params", "keep_io_types")
)


def scaled_adjoint(model: ForwardModel, loss_fn: relax.Function) -> relax.Function:
    """``(*inputs, *params, targets, amp_loss_scale) -> (scaled_loss, loss, *grads)``.

    The gradients are those of ``loss * amp_loss_scale`` with respect to the params.
    """
    bindings, targets, loss = _appended_loss(model, loss_fn)
    scale = relax.Var("amp_loss_scale", relax.TensorType((), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("scaled_loss", [*model.func.params, targets, scale]):
        with bb.dataflow():
            for binding in bindings:
                bb.emit_normalized(binding)
            loss = _as_f32(bb, loss)
            scaled = bb.emit_output(relax.op.multiply(loss, scale), name_hint="amp_scaled_loss")
        bb.emit_func_output(relax.Tuple([scaled, loss]))
    grad_vars = bb.get()["scaled_loss"].params[
        model.num_input : model.num_input + len(model.params)
    ]
    try:
        mod = relax.transform.Gradient("scaled_loss", require_grads=list(grad_vars))(bb.get())
    except (RuntimeError, ValueError, TypeError) as err:  # what TVM raises
        missing = _ops_without_gradient(bb.get()["scaled_loss"])
        if not missing:
            raise
        advice = (
            "fold batch_norm into the preceding conv for fine-tuning, or "
            if "relax.nn.batch_norm" in missing
            else ""
        )
        raise ValueError(
            f"tvmamp.training: TVM {tvm.__version__} has no gradient for {', '.join(missing)}, "
            f"so this model cannot be trained; {advice}write those ops out with ops that have "
            f"gradients, or train the model in its framework ({err})"
        ) from None
    return _Namer("amp_", scalars=True).visit_expr(_flat_outputs(mod["scaled_loss_adjoint"]))


def _appended_loss(model: ForwardModel, loss_fn: relax.Function):
    """The forward's bindings then the loss's, the targets parameter and the loss value.

    What ``relax.training.AppendLoss`` does, without its copies: it gives the forward and the
    loss fresh symbolic variables each and then compares the forward's output type with the
    loss's predictions structurally, so a symbolic batch ``n`` never matches. Here the loss's
    predictions are bound to the forward's output itself and its targets to a new parameter of
    the loss's targets type, which names the forward's symbolic variables (the built-in losses
    are made from the output type, a user's loss is bound to it by ``loss_function``).
    """
    targets = relax.Var("targets", loss_fn.params[1].ty)
    output = model.func.body.body
    # The loss (and, by the adjoints' names, its backward) computes in fp32 at every level,
    # as MindSpore's build_train_network casts the network's output to fp32 for the loss and
    # torch autocast runs mse_loss and cross_entropy in fp32: at O3 in fp16 the squares of
    # mse overflowed to inf with targets of a few hundred.
    loss_fn = _Namer("amp_loss_", scalars=False).visit_expr(loss_fn)
    loss = loss_fn.bind_params({loss_fn.params[0]: output, loss_fn.params[1]: targets})
    bindings = _bindings(model.func) + _bindings(loss)
    return bindings, targets, loss.body.body


def _ops_without_gradient(func: relax.Function) -> list[str]:
    """The ops called in ``func`` that register no ``FPrimalGradient``, sorted."""
    found = set()

    def visit(expr):
        if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op):
            if expr.op.get_attr("FPrimalGradient") is None:
                found.add(expr.op.name)

    relax.analysis.post_order_visit(func, visit)
    return sorted(found)


@relax.expr_functor.mutator
class _Namer(PyExprMutator):
    """Prefix the names of bindings with ``prefix`` (an ``amp_`` name: see ``SCALE_NODES``):
    every binding, or with ``scalars`` the 0-d float ones only."""

    def __init__(self, prefix: str, scalars: bool):
        super().__init__()
        self.prefix, self.scalars = prefix, scalars

    def visit_var_binding_(self, binding):
        var, ty = binding.var, binding.var.ty
        scalar = isinstance(ty, relax.TensorType) and ty.ndim == 0 and "float" in str(ty.dtype)
        if (self.scalars and not scalar) or var.name.startswith("amp_"):
            return super().visit_var_binding_(binding)
        value = self.builder_.normalize(self.visit_expr(binding.value))
        kind = relax.DataflowVar if isinstance(var, relax.DataflowVar) else relax.Var
        new = kind(self.prefix + var.name, value.ty)
        self.builder_.emit_normalized(relax.VarBinding(new, value))
        self.set_var_remap(var, new)
        return None


def _flat_outputs(func: relax.Function) -> relax.Function:
    """((a, b), (g, ...)) -> (a, b, g, ...): FuseOps mishandles the nested TupleGetItem."""
    seq = func.body
    fields = [f for group in seq.body.fields for f in group.fields]
    bb = relax.BlockBuilder()
    flat = bb.normalize(relax.Tuple(fields))
    body = relax.SeqExpr(seq.blocks, flat)
    return bb.normalize(relax.Function(func.params, body, flat.ty, func.is_pure, func.attrs))


def _bindings(func: relax.Function) -> list:
    blocks = func.body.blocks
    if len(blocks) != 1 or not isinstance(blocks[0], relax.DataflowBlock):
        raise ValueError(
            "tvmamp.training: the model and the loss must each be one dataflow block "
            "(run relax.transform.ConvertToDataflow first)"
        )
    return list(blocks[0].bindings)


def _as_f32(bb, loss):
    if str(loss.ty.dtype) == "float32":
        return loss
    return bb.emit_output(relax.op.astype(loss, "float32"), name_hint="amp_loss_f32")


def convert_adjoint(adjoint: relax.Function, level, target, dtype, amp_options) -> Converted:
    """Run tvmamp's AMP conversion on the adjoint; it becomes the private ``loss_adjoint``.

    ``keep_io_types=True``: params and grads stay fp32 at the function boundary, so at O2 the
    fp32 params are master weights cast to the low dtype inside the forward/backward.
    """
    options = dict(amp_options or {})
    if "keep_io_types" in options:
        raise ValueError(
            "tvmamp.training: keep_io_types cannot be set: the training step keeps its params "
            "and gradients fp32 at its boundary (the fp32 master weights)"
        )
    fp32_nodes = list(options.pop("custom_fp32_nodes", None) or ()) + list(SCALE_NODES)
    mod = tvm.IRModule({"main": adjoint.with_attr("global_symbol", "main")})
    converted = convert(
        mod, level, target, dtype, custom_fp32_nodes=fp32_nodes, keep_io_types=True, **options
    )
    func = converted.mod["main"].without_attr("global_symbol")
    return Converted(
        tvm.IRModule({"loss_adjoint": func}),
        converted.report,
        converted.policy,
        converted.target,
        converted.entry,
    )
