"""Trainer: mixed-precision training with loss scaling inside one compiled train step."""

from __future__ import annotations

import difflib
import inspect
import logging

import numpy as np
import tvm
from tvm import relax

from tvmamp.conversion import Converted
from tvmamp.loss_scale import DynamicLossScale, LossScale, NoOpLossScale
from tvmamp.messages import last_line
from tvmamp.pipeline import compile_converted

from .data import check_step_data
from .graph import AMP_OPTIONS, convert_adjoint, scaled_adjoint
from .losses import check_labels, loss_function
from .model import initial_params, load_forward, untrained_params
from .optimizers import SGD, resolve_optimizer
from .step import StepBuilder

logger = logging.getLogger("tvmamp.training")


def default_scaler(level: str, dtype: str) -> LossScale:
    """Dynamic (Paddle defaults) for fp16; none for fp32 (O0) and bf16 (fp32's range)."""
    if level != "O0" and dtype == "float16":
        return DynamicLossScale(preset="paddle")
    return NoOpLossScale()


class Trainer:
    """Train a Relax model with automatic mixed precision and loss scaling.

    Parameters
    ----------
    mod : tvm.IRModule, relax.Function or relax.frontend.nn.Module
        The fp32 forward model: ``main(*inputs, *params)`` with attribute ``num_input``
        (as ``tvmamp.models.simple_net()`` builds), or an nn.Module with ``input_spec``.
    loss : str or relax.Function
        "mse", "cross_entropy" or a Relax function (predictions, targets) -> 0-d float.
    optimizer : SGD, Adam or str
        ``tvmamp.training.SGD(lr, momentum=...)``, ``Adam(...)`` or "sgd"/"momentum"/"adam".
    level : str
        AMP level of the forward and backward graph ("O0" trains in fp32).
    dtype, target :
        As in :func:`tvmamp.build`; ``dtype="float32"`` is accepted at O0 (then ``.dtype``).
    scaler : tvmamp.loss_scale.LossScale, optional
        By default dynamic scaling (Paddle defaults) for fp16 and none otherwise.
    seed : int
        Seed of the initial params when ``params`` is not given and the model carries no
        weights.
    params : dict, optional
        Initial fp32 values by param name. By default the weights the model carries (the
        ``params`` attribute ``from_exported_program(keep_params_as_input=True)`` attaches),
        else seeded ones. Params the forward graph never reads are not trained (one warning
        names them).
    accumulate_steps : int
        Update every k-th step with the sum of k steps' unscaled gradients.
    input_spec : dict, optional
        For an nn.Module: ``{"x": nn.spec.Tensor(shape, dtype)}``, one per argument of its
        forward; float inputs are float32. A dimension may be symbolic (``("n", 8)``): one
        step then runs at any batch size.
    **amp_options
        ``custom_white_list``, ``custom_black_list``, ``custom_fp32_nodes``, ... of
        :func:`tvmamp.convert` (``graph.AMP_OPTIONS``); another keyword is a TypeError.
    """

    def __init__(
        self,
        mod,
        loss="mse",
        optimizer=None,
        level: str = "O1",
        dtype: str | None = None,
        target="llvm",
        scaler: LossScale | None = None,
        seed: int = 0,
        params: dict | None = None,
        accumulate_steps: int = 1,
        *,
        input_spec: dict | None = None,
        **amp_options,
    ):
        _check_options(amp_options)
        self.model = load_forward(mod, input_spec)
        self.accumulate_steps = _check_accumulate(accumulate_steps)
        optimizer = resolve_optimizer(SGD() if optimizer is None else optimizer)
        loss_fn = loss_function(loss, self.model.func.ret_ty)
        # The class count when the built-in cross_entropy checks its targets on the host.
        self._classes = None
        if isinstance(loss, str) and loss == "cross_entropy":
            self._classes = int(self.model.func.ret_ty.shape.values[1])
        _check_scaler_type(scaler)
        values = initial_params(self.model, params, seed)
        # Params the graph never reads: {name: (the trained param it is tied to or None, value)}.
        given = params is not None or self.model.attached is not None
        untrained = untrained_params(self.model, values, given)
        self._untrained = {n: (tied, values[n]) for n, tied in untrained.items()}
        converted = convert_adjoint(
            scaled_adjoint(self.model, loss_fn), level, target, dtype, amp_options
        )
        # O0 trains in fp32 whatever the policy's (unused) low dtype.
        self.dtype = "float32" if level == "O0" else converted.policy.low_dtype
        self.level, self.report = level, converted.report
        self.scaler = scaler if scaler is not None else default_scaler(level, self.dtype)
        steps = StepBuilder(converted.mod, self.model, loss_fn.params[1].ty, self.scaler, optimizer)
        steps.add_grads()
        self.mod = steps.add_train_step(self.accumulate_steps)
        # The adjoint and the optimizer are private functions: inlined into train_step, their
        # kernels fuse with the step's (the 1/scale unscale and, with plain SGD, the update
        # itself into the weight-gradient matmuls).
        self.executable = compile_converted(Converted(_inline_private(self.mod), *_rest(converted)))
        self._init_state(values, steps.opt.state)

    def _init_state(self, values, optim_state):
        device = self.executable.device
        tensor = lambda a: tvm.runtime.tensor(np.asarray(a), device)  # noqa: E731
        self._params = tuple(tensor(values[n]) for n in self.model.param_names)
        self._optim = tuple(tensor(s.numpy()) for s in optim_state)
        self._scale = tuple(tensor(s) for s in self.scaler.state)
        self._accum = None
        if self.accumulate_steps > 1:
            zeros = [np.zeros_like(values[n]) for n in self.model.param_names]
            self._accum = (tensor(np.int64(0)), *(tensor(z) for z in zeros))
        self.history: list[dict] = []
        self.skipped_steps = 0
        self.found_inf = False
        self._data_types = [(v.name, v.ty) for v in self.model.inputs]
        self._staged: dict[int, tuple] = {}

    def step(self, *data) -> float:
        """One compiled train step on inputs then targets: ``step(x, y)``; returns the loss."""
        args = self._data(data)
        scale_used = self.loss_scale
        state = [self._params, self._optim, self._scale]
        if self._accum is not None:
            state.append(self._accum)
        out = self.executable.vm["train_step"](*args, *state)
        self._params, self._optim, self._scale = tuple(out[1]), tuple(out[2]), tuple(out[3])
        self.found_inf = bool(out[4].numpy())
        updated = True
        if self._accum is not None:
            self._accum, updated = tuple(out[5]), bool(out[6].numpy())
        return self._record(float(out[0].numpy()), scale_used, self.found_inf and updated)

    def _record(self, loss, scale_used, skipped) -> float:
        """Append this step to ``history`` (the format tvmamp.debugging plots)."""
        self.skipped_steps += int(skipped)
        entry = {"step": len(self.history) + 1, "loss": loss, "loss_scale": scale_used}
        self.history.append({**entry, "found_inf": self.found_inf, "skipped": skipped})
        return loss

    def gradients(self, *data) -> dict[str, np.ndarray]:
        """The unscaled fp32 gradients for one batch under the current scale (no update)."""
        out = self.executable.vm["grads"](*self._data(data), self._params, self._scale)
        return {n: g.numpy() for n, g in zip(self.model.param_names, out[1])}

    def _data(self, data):
        want = [
            *self._data_types,
            ("targets", self.mod["train_step"].params[len(self._data_types)].ty),
        ]
        arrays = check_step_data(data, want)
        if self._classes is not None:
            check_labels(arrays[-1], self._classes)
        return [self._stage(i, a) for i, a in enumerate(arrays)]

    def _stage(self, index: int, array: np.ndarray):
        """``array`` copied into the device buffer kept for input ``index`` since the last step.

        A fresh buffer per step is a fresh mmap: one page fault per 4 KiB, measured at 0.25 ms
        of a 5 ms SimpleNet step. The step reads its inputs and returns none of them, so the
        buffer is free again when the call returns.
        """
        key = (array.shape, array.dtype)
        kept = self._staged.get(index)
        if kept is not None and kept[0] == key:
            return kept[1].copyfrom(array)
        buffer = tvm.runtime.tensor(array, self.executable.device)
        self._staged[index] = (key, buffer)
        return buffer

    @property
    def loss_scale(self) -> float:
        """The loss scale the next step will use."""
        return float(self._scale[0].numpy())

    @property
    def scale_state(self) -> tuple:
        """The whole loss-scale state (scale, counters) as numpy values."""
        return tuple(s.numpy() for s in self._scale)

    @property
    def params(self) -> dict[str, np.ndarray]:
        """The fp32 (master) params by name, every param of the model in its order.

        A param the forward graph never reads is not trained: it keeps its initial value, or,
        when it was tied to a read param (same initial values), it shows that param's trained
        value, so a tied weight reads the same under both names.
        """
        trained = {n: p.numpy() for n, p in zip(self.model.param_names, self._params)}
        out = {}
        for var in self.model.all_params:
            name = var.name
            if name in trained:
                out[name] = trained[name]
            else:
                tied, initial = self._untrained[name]
                out[name] = trained[tied].copy() if tied else initial.copy()
        return out

    def script(self) -> str:
        """TVMScript of the training module before lowering (train_step, loss_adjoint, ...)."""
        return self.mod.script()

    def show(self) -> None:
        """Print the training module, where the loss-scale ops are named ``amp_*``."""
        print(self.script())


def _inline_private(mod: tvm.IRModule) -> tvm.IRModule:
    """``mod`` with its private functions inlined into their callers (``grads``, ``train_step``).

    TVM 0.27's ``InlinePrivateFunctions`` can leave a caller's dataflow variable used outside
    its dataflow block (seen on the O3 fp16 adjoint); then ``mod`` is compiled as it is, with
    the adjoint and optimizer as separate functions (correct, a few kernels more per step).
    """
    inlined = relax.transform.InlinePrivateFunctions()(mod)
    try:
        relax.analysis.well_formed(inlined)  # raises on the first violation
    except ValueError as err:
        problem = last_line(err)
        logger.info("tvmamp.training: train step compiled without inlining: %s", problem)
        return mod
    return inlined


def _rest(converted: Converted):
    return converted.report, converted.policy, converted.target, converted.entry


def _check_scaler_type(scaler) -> None:
    if scaler is not None and not isinstance(scaler, LossScale):
        raise TypeError(
            "tvmamp.training: scaler must be NoOpLossScale(), StaticLossScale(s) or "
            f"DynamicLossScale(...), got {type(scaler).__name__}"
        )


def _check_accumulate(steps) -> int:
    if isinstance(steps, bool) or not isinstance(steps, int):
        raise TypeError(f"tvmamp.training: accumulate_steps must be an int, not {steps!r}")
    if steps < 1:
        raise ValueError(f"tvmamp.training: accumulate_steps must be >= 1, got {steps}")
    return steps


def _check_options(options: dict) -> None:
    """Refuse a keyword that is neither an argument of Trainer nor an AMP option."""
    unknown = sorted(set(options) - set(AMP_OPTIONS) - {"keep_io_types"})
    if not unknown:
        return
    own = [p for p in inspect.signature(Trainer).parameters if p not in ("mod", "amp_options")]
    close = difflib.get_close_matches(unknown[0], [*own, *AMP_OPTIONS], n=3)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    raise TypeError(
        f"tvmamp.training: Trainer got the unknown option{'s' * (len(unknown) > 1)} "
        f"{', '.join(map(repr, unknown))}; it takes {', '.join(own)} and the AMP options "
        f"{', '.join(AMP_OPTIONS)}{hint}"
    )
