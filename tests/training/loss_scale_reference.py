"""The test oracle for loss scaling: each framework's update, in plain Python with branches."""

import numpy as np

from tvmamp.loss_scale import PRESETS, DynamicLossScale, LossScale


def reference_update(scaler: LossScale, state, found_inf: bool) -> tuple:
    """One step of the framework algorithm ``scaler`` follows, in plain Python with branches.

    Written from the anchors (Paddle ``update_loss_scaling``, PyTorch ``_amp_update_scale_``,
    MindSpore ``DynamicLossScaleManager.update_loss_scale``), independently of
    ``tvmamp.loss_scale.LossScale.update``; the scale is float32 as in all three.
    """
    if not isinstance(scaler, DynamicLossScale):
        return tuple(state)
    f32 = np.float32
    scale, a, b = f32(state[0]), int(state[1]), int(state[2])
    preset = PRESETS[scaler.preset]
    if preset.rule == "window":  # MindSpore: a = cur_iter, b = last_overflow_iter
        if found_inf:
            scale, b = max(scale * f32(scaler.decr_ratio), f32(1.0)), a
        elif (a - b) % scaler.incr_every_n_steps == 0 and np.isfinite(
            scale * f32(scaler.incr_ratio)
        ):
            scale = scale * f32(scaler.incr_ratio)
        return scale, a + 1, b
    if found_inf:  # Paddle / PyTorch: a = good steps (growth tracker), b = bad steps
        a, b = 0, b + 1
        if b == scaler.decr_every_n_nan_or_inf:
            scale, b = max(scale * f32(scaler.decr_ratio), f32(preset.floor)), 0
        return scale, a, b
    a, b = a + 1, 0
    if a == scaler.incr_every_n_steps:
        if np.isfinite(scale * f32(scaler.incr_ratio)):
            scale = scale * f32(scaler.incr_ratio)
        a = 0
    return scale, a, b
