"""Loss-scale state updates: numpy, compiled Relax and the frameworks' algorithms agree."""

import numpy as np
import pytest
import tvm
from loss_scale_reference import reference_update
from tvm import relax

from tvmamp.loss_scale import PRESETS, DynamicLossScale, NoOpLossScale, StaticLossScale

# Small growth intervals so a short sequence exercises growth, decrease and both counters.
SCALERS = {
    "paddle": DynamicLossScale(preset="paddle", incr_every_n_steps=3),
    "paddle_legacy": DynamicLossScale(preset="paddle_legacy", incr_every_n_steps=3),
    "torch": DynamicLossScale(preset="torch", incr_every_n_steps=3),
    "mindspore": DynamicLossScale(preset="mindspore", incr_every_n_steps=3),
    "explicit": DynamicLossScale(1024.0, 4.0, 0.25, 2, 3),
}
# A fixed sequence of forced overflows: runs of finite steps and of overflows of various lengths.
OVERFLOWS = [0, 0, 0, 1, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 0, 1, 0, 0, 0, 0, 1, 1, 0, 0]


def _reference_trajectory(scaler, overflows):
    state, out = scaler.state, []
    for found_inf in overflows:
        state = reference_update(scaler, state, bool(found_inf))
        out.append(tuple(float(v) for v in state))
    return out


@pytest.mark.parametrize("name", sorted(SCALERS))
def test_numpy_adjust_matches_reference(name):
    scaler = SCALERS[name]
    got = []
    for found_inf in OVERFLOWS:
        scaler = scaler.adjust(not found_inf)
        got.append(tuple(float(v) for v in scaler.state))
    assert got == _reference_trajectory(SCALERS[name], OVERFLOWS)


def test_presets_have_their_frameworks_defaults():
    table = {
        "paddle": (65536.0, 2.0, 0.5, 2000, 1),
        "paddle_legacy": (32768.0, 2.0, 0.5, 1000, 2),
        "torch": (65536.0, 2.0, 0.5, 2000, 1),
        "mindspore": (2.0**24, 2.0, 0.5, 2000, 1),
    }
    for name, (init, incr, decr, n_incr, n_decr) in table.items():
        s = DynamicLossScale(preset=name)
        assert (s.loss_scale, s.incr_ratio, s.decr_ratio) == (init, incr, decr)
        assert (s.incr_every_n_steps, s.decr_every_n_nan_or_inf) == (n_incr, n_decr)
    assert DynamicLossScale().preset == "paddle"


def test_mindspore_trajectory_by_hand():
    # DynamicLossScaleManager(8, 2, 3): cur_iter starts at 1, last_overflow_iter at 0.
    s = DynamicLossScale(8.0, preset="mindspore", incr_ratio=2.0, incr_every_n_steps=3)
    scales = []
    for found_inf in [0, 0, 0, 1, 0, 0, 0, 1, 1, 1, 1, 1]:
        s = s.adjust(not found_inf)
        scales.append(s.loss_scale)
    # iter 3: (3-0)%3==0 -> 16; iter 4 overflow -> 8, last=4; iter 7: (7-4)%3==0 -> 16; then
    # five overflows halve to the floor of 1.
    assert scales == [8, 8, 16, 8, 8, 8, 16, 8, 4, 2, 1, 1]


def test_torch_preset_matches_torch_grad_scaler_kernel():
    torch = pytest.importorskip("torch")
    s = DynamicLossScale(preset="torch", incr_every_n_steps=3)
    scale = torch.full((1,), 65536.0)
    tracker = torch.zeros((1,), dtype=torch.int32)
    for found_inf in OVERFLOWS * 3:
        torch._amp_update_scale_(scale, tracker, torch.full((1,), float(found_inf)), 2.0, 0.5, 3)
        s = s.adjust(not found_inf)
        assert (float(scale), int(tracker)) == (s.loss_scale, int(s.state[1]))


@pytest.mark.parametrize("name", ["paddle", "paddle_legacy", "mindspore"])
def test_floor_is_one(name):
    s = DynamicLossScale(preset=name)
    for _ in range(100):
        s = s.adjust(False)
    assert s.loss_scale == 1.0


def test_scale_never_zero_or_inf():
    s = DynamicLossScale(preset="torch")
    for _ in range(400):
        s = s.adjust(False)
    assert 0.0 < s.loss_scale < np.inf
    for name in ("paddle", "torch", "mindspore"):
        big = DynamicLossScale(2.0**126, preset=name, incr_every_n_steps=1)
        for _ in range(10):
            big = big.adjust(True)
        assert big.loss_scale == 2.0**127


def _compiled_adjust(scaler):
    """Compile the Relax emission of ``scaler``'s update as adjust(state..., finite)."""
    bb = relax.BlockBuilder()
    state = [
        relax.Var(n, relax.TensorType((), str(v.dtype)))
        for n, v in zip(scaler.state_names, scaler.state)
    ]
    finite = relax.Var("finite", relax.TensorType((), "bool"))
    with bb.function("adjust", [*state, finite]):
        with bb.dataflow():
            new = scaler.emit_adjust(bb, state, finite)
            out = bb.emit_output(relax.Tuple(new))
        bb.emit_func_output(out)
    vm = relax.VirtualMachine(tvm.compile(bb.get(), target="llvm"), tvm.cpu())
    return vm["adjust"]


@pytest.mark.parametrize("name", sorted(SCALERS))
def test_compiled_update_matches_reference_step_by_step(name):
    scaler = SCALERS[name]
    adjust = _compiled_adjust(scaler)
    state = [tvm.runtime.tensor(v) for v in scaler.state]
    expected = _reference_trajectory(scaler, OVERFLOWS)
    for step, found_inf in enumerate(OVERFLOWS):
        state = list(adjust(*state, tvm.runtime.tensor(np.bool_(not found_inf))))
        assert tuple(float(v.numpy()) for v in state) == expected[step], f"step {step}"


def test_static_and_noop():
    s = StaticLossScale(1024.0)
    assert s.adjust(False).loss_scale == 1024.0 and s.adjust(True).loss_scale == 1024.0
    grads = {"w": np.full((2,), 3.0, np.float32)}
    np.testing.assert_array_equal(s.unscale(s.scale(grads))["w"], grads["w"])
    assert NoOpLossScale().loss_scale == 1.0
    assert NoOpLossScale().adjust(False).loss_scale == 1.0


def test_bad_preset_lists_choices():
    with pytest.raises(ValueError, match="preset 'apex' is not one of paddle, paddle_legacy"):
        DynamicLossScale(preset="apex")
    assert set(PRESETS) == {"paddle", "paddle_legacy", "torch", "mindspore"}


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"init": 0.0}, "init must be a finite number > 0"),
        ({"init": float("inf")}, "init must be a finite number > 0"),
        ({"incr_ratio": 0.5}, "incr_ratio >= 1"),
        ({"incr_every_n_steps": 0}, "incr_every_n_steps must be an int >= 1"),
        ({"preset": "torch", "decr_every_n_nan_or_inf": 2}, "decrease on every overflow"),
    ],
)
def test_bad_parameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DynamicLossScale(**kwargs)
    with pytest.raises(ValueError, match="finite number > 0"):
        StaticLossScale(-1.0)


@pytest.mark.parametrize(
    "make, shown",
    [
        (lambda: StaticLossScale(1e39), r"got 1e\+39 \(inf as float32\)"),
        (lambda: StaticLossScale(3.5e38), r"got 3.5e\+38 \(inf as float32\)"),
        (lambda: StaticLossScale(1e-46), r"got 1e-46 \(0.0 as float32\)"),
        (lambda: StaticLossScale(1e-40), "got 1e-40"),  # subnormal: 1/scale is inf
        (lambda: DynamicLossScale(init=1e39), "init must be"),
        (lambda: DynamicLossScale(preset="torch", init=1e39), "init must be"),
        (lambda: DynamicLossScale(incr_ratio=1e39), "incr_ratio must be"),
        (lambda: DynamicLossScale(decr_ratio=1e-46), "decr_ratio must be"),
        (lambda: StaticLossScale(state=(np.float32(np.nan),)), r"state\[0\] \(the scale\)"),
        (lambda: DynamicLossScale(state=(np.float32(np.inf), 0, 0)), r"state\[0\] \(the scale\)"),
    ],
)
def test_scales_outside_float32_are_refused(make, shown):
    """A scale finite in float64 but inf or 0 in float32 (the state's dtype) is refused."""
    with pytest.raises(ValueError, match=r"normal float32, in \[1.1754944e-38, 3.4028235e\+38\]"):
        make()
    with pytest.raises(ValueError, match=shown):
        make()


def test_largest_float32_scale_is_accepted_and_growth_stays_finite():
    assert StaticLossScale(float(np.finfo(np.float32).max)).adjust(False).loss_scale < np.inf
    s = DynamicLossScale(2.0**127, preset="torch", incr_every_n_steps=1)
    for _ in range(3):
        s = s.adjust(True)
    assert s.loss_scale == 2.0**127  # x2 would be inf: the scale is kept, as torch does
