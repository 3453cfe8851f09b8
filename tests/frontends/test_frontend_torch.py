"""tvmamp.from_torch: PyTorch param names, train mode, unsupported ops, dynamic batch."""

import numpy as np
import pytest

import tvmamp
from tvmamp.frontends import UnsupportedOperatorError, from_torch

torch = pytest.importorskip("torch")

TARGET = "llvm -num-cores=1"


class SmallNet(torch.nn.Module):
    """Conv, BatchNorm, dropout and a linear head: every layer the importer must get right."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(8)
        self.drop = torch.nn.Dropout(0.5)
        self.fc = torch.nn.Linear(8, 5)

    def forward(self, x):
        y = torch.relu(self.bn(self.conv(x))).mean(dim=(2, 3))
        return self.fc(self.drop(y))


@pytest.fixture
def net():
    torch.manual_seed(0)
    model = SmallNet()
    with torch.no_grad():
        model.bn.running_mean.uniform_(-0.5, 0.5)
        model.bn.running_var.uniform_(0.5, 1.5)
    return model.eval()


def _x(rng, batch=2):
    return rng.standard_normal((batch, 3, 8, 8)).astype("float32")


def _eager(model, x):
    with torch.no_grad():
        return model(torch.from_numpy(x)).numpy()


def test_params_carry_pytorch_names_and_build_matches_eager(net, rng):
    mod, params = from_torch(net, (_x(rng),))
    names = [p.name for p in mod["main"].params]
    assert names == [
        "x",
        "conv.weight",
        "conv.bias",
        "bn.weight",
        "bn.bias",
        "fc.weight",
        "fc.bias",
    ]
    assert sorted(params) == sorted(names[1:])
    np.testing.assert_array_equal(params["fc.weight"], net.fc.weight.detach().numpy())
    x = _x(rng)
    np.testing.assert_allclose(
        tvmamp.build(mod, "O0", TARGET, params=params)(x), _eager(net, x), rtol=1e-5, atol=1e-5
    )
    low = tvmamp.build(mod, "O2", TARGET, dtype="bfloat16", params=params)(x)
    np.testing.assert_allclose(low, _eager(net, x), rtol=2e-2, atol=2e-2)


def test_per_node_patterns_match_pytorch_parameter_names(net, rng):
    mod, params = from_torch(net, (_x(rng),))
    converted = tvmamp.convert(
        mod, "O2", TARGET, dtype="bfloat16", params=params, custom_fp32_nodes=["conv.*"]
    )
    forced = [(f.op, f.dtype) for f in converted.report.forced]
    assert ("relax.nn.conv2d", "float32") in forced


def test_train_mode_module_is_imported_in_eval_mode_with_a_warning(net, rng):
    net.train()
    x = _x(rng)
    with pytest.warns(UserWarning, match=r"importing it in eval mode .* 2 layers \(bn, drop\)"):
        mod, params = from_torch(net, (x,))
    assert net.training and net.drop.training, "the module's train mode must be restored"
    out = tvmamp.build(mod, "O0", TARGET, params=params)(x)
    np.testing.assert_allclose(out, _eager(net.eval(), x), rtol=1e-5, atol=1e-5)


def test_train_mode_can_be_refused(net, rng):
    net.train()
    with pytest.raises(ValueError, match="module is in train mode"):
        from_torch(net, (_x(rng),), train_mode="error")
    with pytest.raises(ValueError, match="train_mode 'maybe' is not one of eval, error"):
        from_torch(net, (_x(rng),), train_mode="maybe")


def test_exported_program_traced_in_train_mode_is_refused(net, rng):
    program = torch.export.export(net.train(), (torch.from_numpy(_x(rng)),))
    with pytest.raises(ValueError, match="traced in train mode.*BatchNorm"):
        from_torch(program, None)


class Counter(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls.add_(1)
        return x * 2


def test_a_buffer_updated_in_eval_mode_is_named(rng):
    """It was refused as "traced in train mode", with advice that did not apply."""
    with pytest.raises(ValueError, match="updates its buffers calls in place"):
        from_torch(Counter().eval(), (_x(rng),))


def test_a_low_precision_exported_program_is_refused_with_the_fix(rng):
    """A bf16 Conv + BatchNorm export failed inside TVM's importer with a dtype mismatch."""
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4)).eval()
    net = net.to(torch.bfloat16)
    x = torch.from_numpy(rng.standard_normal((1, 3, 8, 8)).astype("float32")).bfloat16()
    program = torch.export.export(net, (x,))
    with pytest.raises(ValueError, match="'0.weight' is bfloat16; import the float32 model"):
        from_torch(program, None)


class Digamma(torch.nn.Module):
    def forward(self, x):
        return torch.digamma(x) + 1.0


def test_unsupported_op_is_named(rng, recwarn):
    with pytest.raises(UnsupportedOperatorError, match=r"does not support aten\.digamma\.default"):
        from_torch(Digamma(), (np.abs(_x(rng)) + 1,))
    # A fresh module is in train mode, but without dropout or norms eval mode changes nothing.
    assert not [w for w in recwarn if "train mode" in str(w.message)]


def test_bad_arguments_are_type_errors():
    with pytest.raises(TypeError, match="expected a torch.nn.Module"):
        from_torch(lambda x: x, (np.ones(2, "float32"),))
    with pytest.raises(TypeError, match="example_inputs are required"):
        from_torch(SmallNet(), None)


def test_dynamic_batch_runs_any_batch_size(net, rng):
    mod, params = from_torch(net, (_x(rng, batch=2),), dynamic_batch=True)
    exe = tvmamp.build(mod, "O1", TARGET, dtype="bfloat16", params=params)
    for batch in (1, 3):
        x = _x(rng, batch)
        np.testing.assert_allclose(exe(x), _eager(net, x), rtol=2e-2, atol=2e-2)


class VarArgs(torch.nn.Module):
    """A wrapper whose ``forward(self, *inputs)`` collects its inputs (as bench's ``OutputOf``)."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 4)

    def forward(self, *inputs):
        return self.proj(inputs[0] * inputs[1])


def test_dynamic_batch_with_a_varargs_forward(rng):
    """torch.export wants one tuple of specs for the inputs ``*inputs`` collects."""
    model = VarArgs().eval()
    x, y = (rng.standard_normal((2, 8)).astype("float32") for _ in range(2))
    mod, params = from_torch(model, (x, y), dynamic_batch=True)
    exe = tvmamp.build(mod, "O0", TARGET, params=params)
    for batch in (2, 5):
        xb, yb = (rng.standard_normal((batch, 8)).astype("float32") for _ in range(2))
        with torch.no_grad():
            ref = model(torch.from_numpy(xb), torch.from_numpy(yb)).numpy()
        np.testing.assert_allclose(exe(xb, yb), ref, rtol=1e-5, atol=1e-6)


class EmptyCache(torch.nn.Module):
    """Concatenates to ``torch.tensor([])`` as Hugging Face's DynamicCache does on first use."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(16, 16)

    def forward(self, x, y):
        keys = torch.cat([torch.tensor([]), self.proj(x)], dim=-2)  # only the empty is dropped
        both = torch.cat([keys, torch.tensor([]), y], dim=-2)  # two inputs are left
        return both.sum(dim=-2, keepdim=True) * keys


def test_cat_with_a_legacy_empty_tensor_imports(rng):
    x, y = (rng.standard_normal((2, 4, 3, 16)).astype("float32") for _ in range(2))
    mod, params = from_torch(EmptyCache().eval(), (x, y))
    assert [p.name for p in mod["main"].params] == ["x", "y", "proj.weight", "proj.bias"]
    module = EmptyCache().eval()
    module.load_state_dict({k: torch.from_numpy(v) for k, v in params.items()})
    with torch.no_grad():
        want = module(torch.from_numpy(x), torch.from_numpy(y)).numpy()
    out = tvmamp.build(mod, "O0", TARGET, params=params)(x, y)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)


def test_keyword_example_inputs_set_the_input_order(rng):
    class Scaled(torch.nn.Module):
        def forward(self, x, scale=None):
            return x * scale

    x, scale = (rng.standard_normal((2, 3)).astype("float32") for _ in range(2))
    mod, _ = from_torch(Scaled(), {"scale": scale, "x": x})
    assert [p.name for p in mod["main"].params] == ["scale", "x"]
    np.testing.assert_allclose(tvmamp.build(mod, "O0", TARGET)(scale, x), x * scale, rtol=1e-6)
    with pytest.raises(TypeError, match=r"keys must be argument names, got \[0\]"):
        from_torch(Scaled(), {0: x})


def test_cumsum_of_a_bool_mask_is_int64_as_in_torch(rng):
    """Hugging Face decoders make position ids as ``attention_mask.cumsum(-1)``: torch sums a
    bool or int tensor in int64, TVM's importer kept bool and LLVM could not add bools."""

    class Positions(torch.nn.Module):
        def forward(self, x):
            return (x > 0).cumsum(-1) * x

    x = rng.standard_normal((2, 8)).astype("float32")
    mod, params = from_torch(Positions().eval(), (x,))
    with torch.no_grad():
        want = Positions()(torch.from_numpy(x)).numpy()
    out = tvmamp.build(mod, "O0", TARGET, params=params)(x)
    np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6)


class LastStep(torch.nn.Module):
    """``x[:, -1]`` (an RNN's last step, a decoder's last token) and other negative selects."""

    def __init__(self):
        super().__init__()
        self.gru = torch.nn.GRU(6, 8, batch_first=True)

    def forward(self, x):
        y, _ = self.gru(x)
        picked = y[:, [-1, 0]].sum(1) + x[[-1, 1]].sum((0, 2)).mean()  # negative index tensors
        return y[:, -1] * 2 + x[-1, -2].sum() + y[..., -3].mean() + picked


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic batch"])
def test_negative_select_reads_from_the_end(rng, dynamic):
    """TVM's importer made ``select(x, 1, -1)`` and ``x[:, [-1, 0]]`` a ``take`` in "fast" mode
    with index -1, which reads before the tensor: the GRU classifier's output was whatever
    memory lay there (3.6e33)."""
    torch.manual_seed(0)
    model = LastStep().eval()
    x = rng.standard_normal((3, 5, 6)).astype("float32")
    mod, params = from_torch(model, (x,), dynamic_batch=dynamic)
    exe = tvmamp.build(mod, "O0", TARGET, params=params)
    for batch in (3, 2) if dynamic else (3,):
        np.testing.assert_allclose(exe(x[:batch]), _eager(model, x[:batch]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "mode, padding, corners",
    [("bilinear", "zeros", False), ("nearest", "border", True), ("bilinear", "reflection", False)],
)
def test_grid_sample_reads_torch_grid_layout(rng, mode, padding, corners):
    """torch's grid is [N, H, W, 2]; TVM's importer passed it to a grid_sample that reads
    [N, 2, H, W], and the result came out [N, C, W, 2], silently."""

    class Warp(torch.nn.Module):
        def forward(self, x, grid):
            return torch.nn.functional.grid_sample(
                x, grid, mode=mode, padding_mode=padding, align_corners=corners
            )

    x = rng.standard_normal((2, 3, 6, 7)).astype("float32")
    grid = rng.uniform(-1.2, 1.2, (2, 4, 5, 2)).astype("float32")
    mod, params = from_torch(Warp(), (x, grid))
    out = tvmamp.build(mod, "O0", TARGET, params=params)(x, grid)
    with torch.no_grad():
        want = Warp()(torch.from_numpy(x), torch.from_numpy(grid)).numpy()
    assert out.shape == want.shape
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "resize",
    [
        {"size": (7, 9)},
        {"size": (3, 4)},
        {"scale_factor": (3, 2)},
        {"scale_factor": 1.7},
        {"scale_factor": (1.3, 0.6)},
    ],
)
def test_nearest_interpolation_picks_torch_pixels(rng, resize):
    """torch's "nearest" takes pixel floor(dst * in / out), or floor(dst / scale_factor);
    TVM's importer used half-pixel centres and rounding (torch's "nearest-exact"), so a 5 x 6
    image resized to 7 x 9 differed in most pixels, silently; with a scale of 1.7 the in / out
    mapping still picked other rows at 2 of 8 positions."""

    class Resize(torch.nn.Module):
        def forward(self, x):
            return torch.nn.functional.interpolate(x, mode="nearest", **resize)

    x = rng.standard_normal((1, 2, 5, 6)).astype("float32")
    mod, params = from_torch(Resize(), (x,))
    out = tvmamp.build(mod, "O0", TARGET, params=params)(x)
    np.testing.assert_array_equal(out, _eager(Resize(), x))


def test_nearest_interpolation_with_a_dynamic_batch(rng):
    class Double(torch.nn.Module):
        def forward(self, x):
            return torch.nn.functional.interpolate(x, mode="nearest", scale_factor=2)

    x = rng.standard_normal((2, 2, 5, 6)).astype("float32")
    mod, params = from_torch(Double(), (x,), dynamic_batch=True)
    exe = tvmamp.build(mod, "O0", TARGET, params=params)
    for batch in (2, 3):
        xb = rng.standard_normal((batch, 2, 5, 6)).astype("float32")
        np.testing.assert_array_equal(exe(xb), _eager(Double(), xb))


def test_logsumexp_amax_and_amin_import(rng):
    """torch.logsumexp decomposes into aten.amax, which TVM's importer lacks."""

    class Extremes(torch.nn.Module):
        def forward(self, x):
            lse = torch.logsumexp(x * 30, -1)
            return lse + torch.amin(x, (0, 1)).sum() + x.amax(dim=1, keepdim=True).sum() + x.amax()

    x = rng.standard_normal((3, 4, 5)).astype("float32")
    mod, params = from_torch(Extremes(), (x,))
    out = tvmamp.build(mod, "O0", TARGET, params=params)(x)
    np.testing.assert_allclose(out, _eager(Extremes(), x), rtol=1e-5, atol=1e-5)
