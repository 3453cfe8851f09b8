"""Loss functions for tvmamp training: built-in names or a user Relax function."""

from __future__ import annotations

import numpy as np
import tvm
import tvm_ffi
from tvm import relax

from tvmamp.tensors import static_shape

LOSSES = ("mse", "cross_entropy")
# A cross_entropy target equal to this is left out of the mean (torch's default ignore_index).
IGNORE_INDEX = -100


def _same_type(a, b) -> bool:
    return bool(tvm_ffi.structural_equal(a, b))


def loss_function(loss, pred_ty: relax.TensorType) -> relax.Function:
    """The Relax loss ``f(predictions, targets) -> scalar`` for a model output type.

    Parameters
    ----------
    loss : str or relax.Function
        "mse" (mean squared error, targets like the predictions), "cross_entropy" (mean over
        the batch of log_softmax + nll_loss; predictions (batch, classes), targets int64
        (batch,) class indices; targets equal to ``IGNORE_INDEX`` (-100, torch's default
        ``ignore_index``) are left out of the mean, see :func:`check_labels`) or a Relax
        function of (predictions, targets) returning a 0-d float tensor, written with one
        dataflow block.
    pred_ty : relax.TensorType
        The type of the model's output.
    """
    if not isinstance(pred_ty, relax.TensorType):
        raise TypeError(f"tvmamp.training: the model must return one tensor, it returns {pred_ty}")
    if isinstance(loss, relax.Function):
        return _check_user_loss(loss, pred_ty)
    if not isinstance(loss, str):
        raise TypeError(
            f"tvmamp.training: loss must be one of {', '.join(LOSSES)} or a relax.Function, "
            f"got {type(loss).__name__}"
        )
    if loss == "mse":
        return _mse(pred_ty)
    if loss == "cross_entropy":
        shape = pred_ty.shape.values if isinstance(pred_ty.shape, relax.ShapeExpr) else None
        if shape is None or len(shape) != 2:
            raise ValueError(
                "tvmamp.training: loss 'cross_entropy' needs model outputs of shape "
                f"(batch, classes), got {pred_ty}"
            )
        return _cross_entropy(pred_ty)
    raise ValueError(
        f"tvmamp.training: loss {loss!r} is not one of {', '.join(LOSSES)} "
        "(or a relax.Function(predictions, targets) -> scalar)"
    )


def _mse(pred_ty) -> relax.Function:
    """``mean(power(p - t, 2))``: relax.training's MSELoss squares with a ``multiply``, which O2
    runs in the low dtype, and fp16 targets ~100 away overflowed it (every reported loss inf,
    while most steps applied their updates). ``power`` is on the black list, so the squares
    and their mean are fp32 at O1 and O2, as torch autocast computes ``mse_loss``.

    With a symbolic dimension (a dynamic batch) the mean is ``sum / sum(ones_like(targets))``:
    TVM 0.27's gradient of ``mean`` needs a static element count. The count's bindings are
    named ``amp_*``, so the AMP policy keeps it fp32 (fp16 counts past 2048 are not exact)."""
    bb = relax.BlockBuilder()
    predictions = relax.Var("predictions", pred_ty)
    targets = relax.Var("targets", pred_ty)
    with bb.function("mse_loss", [predictions, targets]):
        with bb.dataflow():
            error = relax.op.subtract(predictions, targets)
            squares = relax.op.power(error, relax.const(2.0, str(pred_ty.dtype)))
            if static_shape(pred_ty) is not None:
                loss = bb.emit_output(relax.op.mean(squares))
            else:
                ones = bb.emit(relax.op.ones_like(targets), name_hint="amp_mse_ones")
                count = bb.emit(relax.op.sum(ones), name_hint="amp_mse_count")
                loss = bb.emit_output(relax.op.divide(relax.op.sum(squares), count))
        bb.emit_func_output(loss)
    return bb.get()["mse_loss"]


def _cross_entropy(pred_ty) -> relax.Function:
    """``-sum(sum(log_softmax(p) * one_hot(t), axis=1)) / max(kept, 1)``.

    Equal to relax.training's CrossEntropyLoss (log_softmax + nll_loss), whose legalized
    nll_loss backward crashes TVM 0.27's dlight.cpu.Reduction rule (compute_at InternalError).
    A target equal to ``IGNORE_INDEX`` has an all-zero one-hot row, and ``kept`` counts the
    other targets: the loss is the mean over those (torch's ``ignore_index``), 0 with zero
    gradients when all are ignored. With none ignored ``kept`` is the batch: the plain mean.
    The batch may be symbolic.
    """
    batch, classes = pred_ty.shape.values
    bb = relax.BlockBuilder()
    pred = relax.Var("predictions", pred_ty)
    labels = relax.Var("targets", relax.TensorType([batch], "int64"))
    with bb.function("cross_entropy_loss", [pred, labels]):
        with bb.dataflow():
            log_p = bb.emit(relax.op.nn.log_softmax(pred))
            classes_const = relax.const(np.arange(int(classes), dtype="int64"))
            hit = relax.op.equal(relax.op.expand_dims(labels, 1), classes_const)
            one_hot = bb.emit(relax.op.astype(hit, "float32"))  # one_hot has no gradient
            picked = bb.emit(relax.op.sum(relax.op.multiply(log_p, one_hot), axis=[1]))
            kept = relax.op.not_equal(labels, relax.const(IGNORE_INDEX, "int64"))
            kept = bb.emit(relax.op.sum(relax.op.astype(kept, "float32")))
            kept = bb.emit(relax.op.maximum(kept, relax.const(1.0, "float32")))
            mean = relax.op.divide(relax.op.sum(picked), kept)
            loss = bb.emit_output(relax.op.negative(mean))
        bb.emit_func_output(loss)
    return bb.get()["cross_entropy_loss"]


def check_labels(labels: np.ndarray, classes: int) -> None:
    """Raise a ValueError when a cross_entropy target is outside [0, classes) and not ignored.

    The graph cannot raise: a label of 7 for 3 classes would silently score 0 (an all-zero
    one-hot row), so the Trainer checks the numpy targets before each step.
    """
    bad = (labels < 0) | (labels >= classes)
    bad &= labels != IGNORE_INDEX
    if bad.any():
        values = sorted({int(v) for v in labels[bad]})
        raise ValueError(
            f"tvmamp.training: cross_entropy targets must be class indices in [0, {classes}) "
            f"or {IGNORE_INDEX} (ignored), got {', '.join(map(str, values[:5]))}"
            + (f" and {len(values) - 5} more" if len(values) > 5 else "")
        )


def _check_user_loss(func: relax.Function, pred_ty) -> relax.Function:
    if len(func.params) != 2:
        raise ValueError(
            "tvmamp.training: a loss function takes (predictions, targets), this one takes "
            f"{len(func.params)} parameters"
        )
    func = _symbols_of(func, pred_ty)
    if not _same_type(func.params[0].ty, pred_ty):
        raise TypeError(
            f"tvmamp.training: the loss function's predictions are {func.params[0].ty}, but the "
            f"model returns {pred_ty}"
        )
    ret = func.ret_ty
    if not isinstance(ret, relax.TensorType) or ret.ndim != 0 or "float" not in str(ret.dtype):
        raise TypeError(f"tvmamp.training: the loss function must return a 0-d float, not {ret}")
    return func


def _symbols_of(func: relax.Function, pred_ty) -> relax.Function:
    """``func`` with the symbolic dimensions of its predictions replaced by the model output's
    at the same positions: a loss written for ``R.Tensor(("n", 4))`` has a variable ``n`` of
    its own, which only the name shares with the model's."""
    shapes = [getattr(t, "shape", None) for t in (func.params[0].ty, pred_ty)]
    if not all(isinstance(shape, relax.ShapeExpr) for shape in shapes):
        return func
    mine, model = (list(shape.values) for shape in shapes)
    if len(mine) != len(model):
        return func
    pairs = zip(mine, model)
    mapping = {d: m for d, m in pairs if isinstance(d, tvm.tirx.Var) and not d.same_as(m)}
    return func.bind_symbolic_vars(mapping) if mapping else func
