"""Loss scaling as functional state: no-op, static and dynamic (Paddle, PyTorch, MindSpore).

The same update rule runs on the host (numpy, :meth:`LossScale.adjust`) and inside the compiled
train step (Relax ops, :meth:`LossScale.emit_adjust`). Both choose the new state with
``where``/``select``, never with Python branches on values, as in deepmind/jmp.
The tests compare both, step by step, with each framework's algorithm restated independently in
plain Python with branches (``tests/training/loss_scale_reference.py``).
"""

from __future__ import annotations

import dataclasses
import types

import numpy as np

# Smallest normal float32: the PyTorch preset never backs off below it (1/scale stays finite).
FLT_MIN = float(np.finfo(np.float32).tiny)
# Largest float32: a scale, and the ratios that move it, must be finite in float32 (the state's
# dtype); 1e39 passes a float64 check but is inf in float32, and inf * 0.5 stays inf.
FLT_MAX = float(np.finfo(np.float32).max)


@dataclasses.dataclass(frozen=True)
class Preset:
    """Defaults and update rule of one framework's dynamic loss scaler."""

    init: float
    incr_ratio: float
    decr_ratio: float
    incr_every_n_steps: int
    decr_every_n_nan_or_inf: int
    rule: str  # "counters" (Paddle/PyTorch) or "window" (MindSpore)
    floor: float  # the scale never goes below this on a decrease
    source: str


PRESETS = {
    "paddle": Preset(65536.0, 2.0, 0.5, 2000, 1, "counters", 1.0, "paddle.amp.GradScaler"),
    "paddle_legacy": Preset(
        2.0**15, 2.0, 0.5, 1000, 2, "counters", 1.0, "Paddle AMP guide (older defaults)"
    ),
    "torch": Preset(2.0**16, 2.0, 0.5, 2000, 1, "counters", FLT_MIN, "torch.amp.GradScaler"),
    "mindspore": Preset(2.0**24, 2.0, 0.5, 2000, 1, "window", 1.0, "DynamicLossScaleManager"),
}


class LossScale:
    """Base class: the state is a tuple of 0-d numpy arrays, ``state[0]`` the scale (float32).

    Subclasses set ``state_names``, ``state`` and implement :meth:`update`.
    """

    state_names: tuple = ("loss_scale",)
    state: tuple = ()

    @property
    def loss_scale(self) -> float:
        """The current scale as a Python float."""
        return float(self.state[0])

    def scale(self, tree):
        """``tree * loss_scale`` for an array, a number or a list/tuple/dict of them."""
        return _tree_map(lambda x: x * self.state[0], tree)

    def unscale(self, tree):
        """``tree * (1 / loss_scale)``: the gradients as if the loss had not been scaled."""
        inv = np.float32(1.0) / self.state[0]
        return _tree_map(lambda x: x * inv, tree)

    def adjust(self, grads_finite) -> LossScale:
        """A new scaler whose state follows this step (``grads_finite``: bool or 0-d array)."""
        finite = np.asarray(grads_finite, dtype=bool)
        with np.errstate(over="ignore"):  # a growth past float32's range is rejected below
            new = self.update(self.state, finite, NUMPY_OPS)
        return dataclasses.replace(self, state=tuple(np.asarray(v) for v in new))

    def update(self, state, finite, ops):
        """The new state given ``finite`` (all gradients finite), in terms of ``ops``."""
        return state

    def emit_adjust(self, bb, state, finite):
        """Emit the state update as Relax ops into BlockBuilder ``bb``; returns the new state."""
        ops = RelaxOps(bb)
        new = self.update(tuple(state), finite, ops)
        return [ops.name(v, f"amp_{n}_new") for v, n in zip(new, self.state_names)]


def _tree_map(fn, tree):
    if isinstance(tree, dict):
        return {k: _tree_map(fn, v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_tree_map(fn, v) for v in tree)
    return fn(tree)


def _scale_state(value: float):
    return (np.asarray(value, dtype=np.float32),)


@dataclasses.dataclass(frozen=True)
class NoOpLossScale(LossScale):
    """No loss scaling: the scale is 1 and never changes (non-finite steps are still skipped)."""

    state: tuple = dataclasses.field(default_factory=lambda: _scale_state(1.0))


@dataclasses.dataclass(frozen=True, init=False)
class StaticLossScale(LossScale):
    """A fixed scale ``s`` (MindSpore ``FixedLossScaleManager(s, drop_overflow_update=True)``)."""

    state: tuple

    def __init__(self, loss_scale: float = 128.0, state: tuple | None = None):
        _check_positive(loss_scale, "StaticLossScale loss_scale")
        if state:
            _check_state_scale(state, "StaticLossScale")
        object.__setattr__(self, "state", state or _scale_state(loss_scale))


@dataclasses.dataclass(frozen=True, init=False)
class DynamicLossScale(LossScale):
    """Grow the scale after a run of finite steps, shrink it after non-finite ones.

    Parameters
    ----------
    init, incr_ratio, decr_ratio, incr_every_n_steps, decr_every_n_nan_or_inf : optional
        Paddle's names; any left out take the preset's value.
    preset : str
        "paddle" (default; 65536 / 2 / 0.5 / 2000 / 1), "paddle_legacy" (2^15 / 2 / 0.5 / 1000
        / 2), "torch" (2^16, growth 2, backoff 0.5, interval 2000) or "mindspore" (2^24,
        factor 2, window 2000).

    Notes
    -----
    "paddle", "paddle_legacy" and "torch" (Paddle ``update_loss_scaling``; PyTorch's
    ``_amp_update_scale_`` is the case ``decr_every_n_nan_or_inf=1``)::

        if not finite: good = 0; bad += 1
                       if bad == decr_n: S = max(S * decr, floor); bad = 0
        else:          bad = 0; good += 1
                       if good == incr_n: S = S * incr if finite(S * incr) else S; good = 0

    with floor 1 for Paddle and, for PyTorch (which has none), the smallest normal float32,
    reached only after about 140 overflows in a row, where PyTorch would go on to 0.

    "mindspore" (``DynamicLossScaleManager.update_loss_scale``; ``it`` starts at 1)::

        if not finite: S = max(S * decr, 1); last = it
        elif (it - last) % window == 0: S = S * incr if finite(S * incr) else S
        it += 1

    The finiteness guard on growth is ours (MindSpore would reach inf after ~100 windows).
    """

    state: tuple
    incr_ratio: float
    decr_ratio: float
    incr_every_n_steps: int
    decr_every_n_nan_or_inf: int
    preset: str

    def __init__(
        self,
        init: float | None = None,
        incr_ratio: float | None = None,
        decr_ratio: float | None = None,
        incr_every_n_steps: int | None = None,
        decr_every_n_nan_or_inf: int | None = None,
        preset: str = "paddle",
        state: tuple | None = None,
    ):
        base = _preset(preset)
        given = dict(
            init=init,
            incr_ratio=incr_ratio,
            decr_ratio=decr_ratio,
            incr_every_n_steps=incr_every_n_steps,
            decr_every_n_nan_or_inf=decr_every_n_nan_or_inf,
        )
        values = {k: getattr(base, k) if v is None else v for k, v in given.items()}
        _check_config(values, preset)
        for key in ("incr_ratio", "decr_ratio", "incr_every_n_steps", "decr_every_n_nan_or_inf"):
            object.__setattr__(self, key, values[key])
        object.__setattr__(self, "preset", preset)
        if state:
            _check_state_scale(state, "DynamicLossScale")
        object.__setattr__(self, "state", state or self._initial_state(values["init"]))

    @property
    def state_names(self) -> tuple:
        if self._preset.rule == "window":
            return ("loss_scale", "iteration", "last_overflow_iter")
        return ("loss_scale", "good_steps", "bad_steps")

    @property
    def _preset(self) -> Preset:
        return PRESETS[self.preset]

    def _initial_state(self, init):
        first = 1 if self._preset.rule == "window" else 0
        return (*_scale_state(init), np.asarray(first, np.int64), np.asarray(0, np.int64))

    def update(self, state, finite, ops):
        if self._preset.rule == "window":
            return self._update_window(state, finite, ops)
        return self._update_counters(state, finite, ops)

    def _grown(self, scale, ops):
        grown = ops.mul(scale, ops.f32(self.incr_ratio))
        return ops.select(ops.isfinite(grown), grown, scale)

    def _shrunk(self, scale, ops):
        return ops.maximum(ops.mul(scale, ops.f32(self.decr_ratio)), ops.f32(self._preset.floor))

    def _update_counters(self, state, finite, ops):
        scale, good, bad = state
        zero, one = ops.i64(0), ops.i64(1)
        good = ops.select(finite, ops.add(good, one), zero)
        bad = ops.select(finite, zero, ops.add(bad, one))
        grow = ops.logical_and(finite, ops.equal(good, ops.i64(self.incr_every_n_steps)))
        shrink = ops.logical_and(
            ops.logical_not(finite), ops.equal(bad, ops.i64(self.decr_every_n_nan_or_inf))
        )
        new_scale = ops.select(
            shrink, self._shrunk(scale, ops), ops.select(grow, self._grown(scale, ops), scale)
        )
        return new_scale, ops.select(grow, zero, good), ops.select(shrink, zero, bad)

    def _update_window(self, state, finite, ops):
        scale, it, last = state
        since = ops.mod(ops.subtract(it, last), ops.i64(self.incr_every_n_steps))
        grow = ops.logical_and(finite, ops.equal(since, ops.i64(0)))
        new_scale = ops.select(
            finite, ops.select(grow, self._grown(scale, ops), scale), self._shrunk(scale, ops)
        )
        new_last = ops.select(finite, last, it)
        return new_scale, ops.add(it, ops.i64(1)), new_last


# The operations of the update rule: name -> (numpy function, Relax op name).
_OPS = {
    "select": (np.where, "where"),
    "maximum": (np.maximum, "maximum"),
    "mul": (np.multiply, "multiply"),
    "add": (np.add, "add"),
    "subtract": (np.subtract, "subtract"),
    "mod": (np.mod, "floor_mod"),
    "equal": (np.equal, "equal"),
    "logical_and": (np.logical_and, "logical_and"),
    "logical_not": (np.logical_not, "logical_not"),
    "isfinite": (np.isfinite, "isfinite"),
}
NUMPY_OPS = types.SimpleNamespace(
    f32=np.float32, i64=np.int64, **{name: fns[0] for name, fns in _OPS.items()}
)


class RelaxOps:
    """The same operations emitted as Relax ops into a BlockBuilder ``bb``."""

    def __init__(self, bb):
        from tvm import relax

        self.bb, self.relax = bb, relax
        for name, (_, op_name) in _OPS.items():
            setattr(self, name, self._emitter(getattr(relax.op, op_name)))

    def _emitter(self, fn):
        return lambda *args: self.bb.emit(fn(*args))

    def f32(self, value):
        return self.relax.const(np.float32(value), "float32")

    def i64(self, value):
        return self.relax.const(np.int64(value), "int64")

    def name(self, value, name):
        """Bind ``value`` to a readable name (shown in the train step's TVMScript)."""
        return self.bb.emit(value, name_hint=name)


def _preset(name) -> Preset:
    if name not in PRESETS:
        raise ValueError(
            f"tvmamp.DynamicLossScale: preset {name!r} is not one of {', '.join(PRESETS)}"
        )
    return PRESETS[name]


def _check_positive(value, what):
    """``value`` is a real number whose float32 value is finite, > 0 and normal.

    The check is on the float32 value, the dtype of the state: 1e39 or 3.5e38 are finite in
    float64 but inf in float32 (and every step would then be skipped, inf * 0.5 being inf), and
    1e-46 is 0 in float32.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise TypeError(f"tvmamp.{what} must be a number, got {value!r}")
    _check_f32_range(value, what)


def _check_f32_range(value, what):
    with np.errstate(over="ignore", under="ignore"):
        f32 = np.float32(value)
    if not (np.isfinite(value) and np.isfinite(f32) and FLT_MIN <= f32 <= FLT_MAX):
        raise ValueError(
            f"tvmamp.{what} must be a finite number > 0 that is a normal float32, in "
            f"[{FLT_MIN:.8g}, {FLT_MAX:.8g}]; got {value!r} ({float(f32)!r} as float32)"
        )


def _check_state_scale(state, what):
    """``state[0]``, a given scale state's scale, is a float32 in the range of the scale."""
    if not isinstance(state, tuple) or not state:
        raise TypeError(f"tvmamp.{what} state must be a non-empty tuple, got {state!r}")
    scale = np.asarray(state[0])
    if scale.shape != () or scale.dtype != np.float32:
        raise TypeError(
            f"tvmamp.{what} state[0] (the scale) must be a 0-d float32 array, got {state[0]!r}"
        )
    _check_f32_range(scale[()], f"{what} state[0] (the scale)")


def _check_config(values, preset: str):
    _check_positive(values["init"], "DynamicLossScale init")
    _check_positive(values["incr_ratio"], "DynamicLossScale incr_ratio")
    _check_positive(values["decr_ratio"], "DynamicLossScale decr_ratio")
    if values["incr_ratio"] < 1 or values["decr_ratio"] > 1:
        raise ValueError(
            "tvmamp.DynamicLossScale: need incr_ratio >= 1 and decr_ratio <= 1, got "
            f"{values['incr_ratio']} and {values['decr_ratio']}"
        )
    for key in ("incr_every_n_steps", "decr_every_n_nan_or_inf"):
        n = values[key]
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
            raise ValueError(f"tvmamp.DynamicLossScale: {key} must be an int >= 1, got {n!r}")
    if preset in ("torch", "mindspore") and values["decr_every_n_nan_or_inf"] != 1:
        raise ValueError(
            "tvmamp.DynamicLossScale: the torch and mindspore presets decrease on every "
            f"overflow; decr_every_n_nan_or_inf={values['decr_every_n_nan_or_inf']} needs "
            "preset 'paddle' or 'paddle_legacy'"
        )


__all__ = [
    "PRESETS",
    "RelaxOps",
    "DynamicLossScale",
    "LossScale",
    "NoOpLossScale",
    "StaticLossScale",
]
