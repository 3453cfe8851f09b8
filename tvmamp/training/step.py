"""Emit the compiled train step: unscale, update, all-finite check, choice, loss-scale update.

``train_step(*inputs, targets, params, optim_states, scale_state[, accum])`` returns
``(loss, params, optim_states, scale_state, found_inf[, accum, updated])``; every tuple is a
Relax tuple so the state stays on the device between steps. All of it is fp32.

The optimizer step is always computed; a Relax ``If`` on the all-finite flag then returns
either the stepped params and optimizer state or the ones passed in (no copy either way).
``found_inf`` is set when a gradient is not finite or, for optimizers whose
``checks_updated_params`` is true (plain SGD, Adam), when an updated parameter is not: a
non-finite gradient makes its parameter's update non-finite, and checking the update instead
lets the weight-gradient matmul and the update fuse into one kernel.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax

from tvmamp.loss_scale import LossScale

from .model import ForwardModel


def _f32(value):
    return relax.const(np.float32(value), "float32")


def _item(bb, tup, i, name=None):
    return bb.emit(relax.TupleGetItem(tup, i), name_hint=name or "")


def all_finite(bb, tensors):
    """Emit ``min over tensors of min(astype(|t| <= FLT_MAX, "int32")) > 0`` (Relax has no all).

    ``|t| <= FLT_MAX`` is ``isfinite(t)`` for fp32 (an ordered compare: false for NaN and
    +-inf), and it vectorises: TVM lowers ``isfinite`` to ``isnan`` and ``or`` terms that
    LLVM leaves scalar (5x slower on a 512 x 512 gradient).
    """
    flags, largest = None, relax.const(np.finfo(np.float32).max, "float32")
    for t in tensors:
        finite = relax.op.less_equal(relax.op.abs(t), largest)
        flag = bb.emit(relax.op.min(relax.op.astype(finite, "int32")))
        flags = flag if flags is None else bb.emit(relax.op.minimum(flags, flag))
    return bb.emit(relax.op.greater(flags, relax.const(0, "int32")), name_hint="amp_all_finite")


class StepBuilder:
    """Adds ``train_step`` and ``grads`` to a module holding ``loss_adjoint``."""

    def __init__(self, mod, model: ForwardModel, targets_ty, scaler: LossScale, optimizer):
        self.bb = relax.BlockBuilder()
        self.checks_updated_params = optimizer.checks_updated_params
        self.model, self.targets_ty, self.scaler = model, targets_ty, scaler
        self.adjoint = self.bb.add_func(mod["loss_adjoint"], "loss_adjoint")
        self.opt = optimizer.relax_optimizer().init(model.params)
        func = self.opt.get_function().without_attr("global_symbol")
        self.optimizer = self.bb.add_func(func, "optimizer")
        self.params_ty = relax.TupleType([p.ty for p in model.params])

    def _data_vars(self):
        inputs = [relax.Var(v.name, v.ty) for v in self.model.inputs]
        return inputs, relax.Var("targets", self.targets_ty)

    def _scale_var(self):
        ty = relax.TupleType([relax.TensorType((), str(v.dtype)) for v in self.scaler.state])
        return relax.Var("scale_state", ty)

    def _unscaled_grads(self, inputs, targets, params, scale):
        """Call the adjoint and multiply every gradient by 1/scale (in fp32)."""
        bb, names = self.bb, self.model.param_names
        out = bb.emit(relax.Call(self.adjoint, [*inputs, *params, targets, scale]))
        loss = _item(bb, out, 1, "loss")
        inv = bb.emit(relax.op.divide(_f32(1.0), scale), name_hint="amp_inv_scale")
        unscaled = [
            bb.emit(relax.op.multiply(_item(bb, out, i + 2), inv), name_hint=f"{n}_grad")
            for i, n in enumerate(names)
        ]
        return loss, unscaled

    def add_grads(self):
        """``grads(*inputs, targets, params, scale_state) -> (loss, unscaled grads)``."""
        bb = self.bb
        inputs, targets = self._data_vars()
        params_var, scale_state = relax.Var("params", self.params_ty), self._scale_var()
        with bb.function("grads", [*inputs, targets, params_var, scale_state]):
            with bb.dataflow():
                params = [_item(bb, params_var, i) for i in range(len(self.model.params))]
                scale = _item(bb, scale_state, 0, "amp_loss_scale")
                loss, grads = self._unscaled_grads(inputs, targets, params, scale)
                out = bb.emit_output(relax.Tuple([loss, relax.Tuple(grads)]))
            bb.emit_func_output(out)

    def add_train_step(self, accumulate_steps: int = 1) -> tvm.IRModule:
        """The train step; with ``accumulate_steps`` k > 1 it updates every k-th call."""
        bb = self.bb
        inputs, targets, state_vars = self._step_vars(accumulate_steps)
        params_var, opt_var, scale_var = state_vars[:3]
        with bb.function("train_step", [*inputs, targets, *state_vars]):
            with bb.dataflow():
                params = [_item(bb, params_var, i, n) for i, n in enumerate(self.model.param_names)]
                state = [_item(bb, scale_var, i) for i in range(len(self.scaler.state))]
                loss, grads = self._unscaled_grads(inputs, targets, params, state[0])
                extra, update = [], None
                if accumulate_steps > 1:
                    grads, update, extra = self._accumulate(state_vars[3], grads, accumulate_steps)
                apply, stepped, outs = self._guarded_update(
                    params_var, opt_var, grads, state, update
                )
                loss = bb.emit_output(loss, name_hint="loss")
                apply = bb.emit_output(apply, name_hint="amp_apply")
                stepped = bb.emit_output(stepped, name_hint="amp_stepped")
                rest = [bb.emit_output(o) for o in (*outs, *extra)]
            kept = relax.Tuple([params_var, opt_var])
            chosen = bb.emit(relax.If(apply, stepped, kept), name_hint="amp_chosen")
            chosen = [_item(bb, chosen, 0, "params_new"), _item(bb, chosen, 1, "optim_new")]
            bb.emit_func_output(relax.Tuple([loss, *chosen, *rest]))
        return bb.get()

    def _step_vars(self, accumulate_steps):
        """Inputs, targets and the state tuples params, optim_states, scale_state[, accum]."""
        inputs, targets = self._data_vars()
        opt_ty = relax.TupleType([relax.TensorType(s.shape, s.dtype) for s in self.opt.state])
        state = [
            relax.Var("params", self.params_ty),
            relax.Var("optim_states", opt_ty),
            self._scale_var(),
        ]
        if accumulate_steps > 1:
            accum_ty = [relax.TensorType((), "int64"), *self.params_ty.fields]
            state.append(relax.Var("accum", relax.TupleType(accum_ty)))
        return inputs, targets, state

    def _guarded_update(self, params_var, opt_var, grads, state, update):
        """The optimizer step, the all-finite flag, and the loss-scale update.

        ``train_step`` keeps the step only when the flag is set (see the module docstring).
        The flag reads the updated params when the optimizer asks for it: a non-finite
        gradient makes its parameter's update non-finite (``p`` is finite), and then each
        gradient has one consumer, so its matmul, 1/scale and update fuse into one kernel.
        """
        bb = self.bb
        stepped = bb.emit(relax.Call(self.optimizer, [params_var, relax.Tuple(grads), opt_var]))
        checked = grads
        if self.checks_updated_params:
            new_params = _item(bb, stepped, 0)
            checked = [_item(bb, new_params, i) for i in range(len(self.model.params))]
        finite = all_finite(bb, checked)
        apply = finite
        if update is not None:
            apply = bb.emit(relax.op.logical_and(update, finite), name_hint="amp_apply")
        scale = self.scaler.emit_adjust(bb, state, finite)
        if update is not None:  # the loss scale only moves on update steps
            scale = [bb.emit(relax.op.where(update, new, old)) for new, old in zip(scale, state)]
        found_inf = bb.emit(relax.op.logical_not(finite), name_hint="amp_found_inf")
        return apply, stepped, [relax.Tuple(scale), found_inf]

    def _accumulate(self, accum, grads, k):
        """Sum the unscaled grads over k calls (Paddle's guide 3.1); reset after the update."""
        bb = self.bb
        count = bb.emit(relax.op.add(_item(bb, accum, 0), relax.const(1, "int64")))
        update = bb.emit(relax.op.equal(count, relax.const(k, "int64")), name_hint="amp_update")
        sums = [
            bb.emit(relax.op.add(_item(bb, accum, i + 1), g), name_hint=f"{n}_grad_sum")
            for i, (g, n) in enumerate(zip(grads, self.model.param_names))
        ]
        reset = [bb.emit(relax.op.where(update, relax.op.zeros_like(s), s)) for s in sums]
        count = bb.emit(relax.op.where(update, relax.const(0, "int64"), count))
        return sums, update, [relax.Tuple([count, *reset]), update]
