"""Which params are trained (unread ones are left alone), tied names, attached weights."""

import warnings

import numpy as np
import pytest
import torch
from tvm.relax.frontend import nn
from tvm.relax.frontend.torch import from_exported_program

from tvmamp.training import SGD, Adam, Trainer

B, D = 4, 8


def _batches(seed, n=5):
    rng = np.random.default_rng(seed)
    return [tuple(rng.standard_normal((2, B, D)).astype("float32")) for _ in range(n)]


def _torch_optimizer(opt, params):
    if isinstance(opt, SGD):
        return torch.optim.SGD(params, lr=opt.lr, weight_decay=opt.weight_decay)
    return torch.optim.Adam(params, lr=opt.lr, weight_decay=opt.weight_decay)


class _Unused(nn.Module):
    def __init__(self):
        self.fc = nn.Linear(D, D)
        self.extra = nn.Linear(D, D)

    def forward(self, x):
        return self.fc(x)


@pytest.mark.parametrize("opt", [SGD(0.1, weight_decay=0.1), Adam(0.01, weight_decay=0.1)], ids=str)
def test_an_unread_param_is_not_trained_nor_decayed(opt):
    spec = {"x": nn.spec.Tensor((B, D), "float32")}
    with pytest.warns(UserWarning, match=r"never reads params \['extra.weight', 'extra.bias'\]"):
        trainer = Trainer(_Unused(), "mse", opt, level="O0", input_spec=spec)
    start = trainer.params
    fc = torch.nn.Linear(D, D)
    with torch.no_grad():
        fc.weight.copy_(torch.from_numpy(start["fc.weight"]))
        fc.bias.copy_(torch.from_numpy(start["fc.bias"]))
    torch_opt = _torch_optimizer(opt, fc.parameters())
    for x, y in _batches(1):
        trainer.step(x, y)
        torch_opt.zero_grad()
        torch.nn.functional.mse_loss(fc(torch.from_numpy(x)), torch.from_numpy(y)).backward()
        torch_opt.step()
    got = trainer.params
    assert list(got) == ["fc.weight", "fc.bias", "extra.weight", "extra.bias"]
    np.testing.assert_array_equal(got["extra.weight"], start["extra.weight"])  # as torch: grad None
    np.testing.assert_array_equal(got["extra.bias"], start["extra.bias"])
    np.testing.assert_allclose(got["fc.weight"], fc.weight.detach().numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got["fc.bias"], fc.bias.detach().numpy(), rtol=1e-5, atol=1e-6)
    assert set(trainer.gradients(*_batches(2, 1)[0])) == {"fc.weight", "fc.bias"}


class _TorchTied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = torch.nn.Linear(D, D, bias=False)
        self.dec = torch.nn.Linear(D, D, bias=False)
        self.dec.weight = self.enc.weight

    def forward(self, x):
        return self.dec(torch.relu(self.enc(x)))


def _exported_tied():
    torch.manual_seed(0)
    model = _TorchTied()
    program = torch.export.export(model, (torch.randn(B, D),))
    mod = from_exported_program(program, keep_params_as_input=True, unwrap_unit_return_tuple=True)
    func = mod["main"]
    params = {p.name: v.numpy() for p, v in zip(func.params[1:], func.attrs["params"])}
    return model, mod, params


def test_a_tied_weight_is_trained_once_and_reads_the_same_under_both_names():
    model, mod, params = _exported_tied()
    assert list(params) == ["p_enc_weight", "p_dec_weight"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = Trainer(mod, "mse", SGD(0.1, weight_decay=0.01), level="O0", params=params)
    messages = [str(w.message) for w in caught if "never reads" in str(w.message)]
    assert len(messages) == 1, messages
    assert "'p_enc_weight' is tied to 'p_dec_weight'" in messages[0]
    torch_opt = torch.optim.SGD(model.parameters(), lr=0.1, weight_decay=0.01)
    for x, y in _batches(3):
        trainer.step(x, y)
        torch_opt.zero_grad()
        torch.nn.functional.mse_loss(model(torch.from_numpy(x)), torch.from_numpy(y)).backward()
        torch_opt.step()
    want = model.enc.weight.detach().numpy()
    for name in ("p_enc_weight", "p_dec_weight"):
        np.testing.assert_allclose(trainer.params[name], want, rtol=1e-5, atol=1e-6)
    assert not np.array_equal(trainer.params["p_enc_weight"], params["p_enc_weight"])


class _NNTied(nn.Module):
    def __init__(self):
        self.enc = nn.Linear(D, D, bias=False)
        self.dec = nn.Linear(D, D, bias=False)
        self.dec.weight = self.enc.weight

    def forward(self, x):
        return self.dec(nn.relu(self.enc(x)))


def test_a_tied_nn_module_weight_reads_the_trained_value_under_both_names():
    spec = {"x": nn.spec.Tensor((B, D), "float32")}
    with pytest.warns(UserWarning, match="'enc.weight' is tied to 'dec.weight'"):
        trainer = Trainer(_NNTied(), "mse", SGD(0.1), level="O0", input_spec=spec)
    for x, y in _batches(4, 2):
        trainer.step(x, y)
    got = trainer.params
    np.testing.assert_array_equal(got["enc.weight"], got["dec.weight"])


class _TorchMLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(D, 16)
        self.fc2 = torch.nn.Linear(16, D)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def test_weights_attached_by_from_exported_program_are_the_default_start():
    torch.manual_seed(1)
    model = _TorchMLP()
    program = torch.export.export(model, (torch.randn(B, D),))
    mod = from_exported_program(program, keep_params_as_input=True, unwrap_unit_return_tuple=True)
    func = mod["main"]
    attached = {p.name: v.numpy() for p, v in zip(func.params[1:], func.attrs["params"])}
    trainer = Trainer(mod, "mse", SGD(0.05), level="O0")
    for name, value in attached.items():
        np.testing.assert_array_equal(trainer.params[name], value)
    torch_opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for x, y in _batches(5, 3):
        loss = trainer.step(x, y)
        torch_opt.zero_grad()
        want = torch.nn.functional.mse_loss(model(torch.from_numpy(x)), torch.from_numpy(y))
        want.backward()
        torch_opt.step()
        np.testing.assert_allclose(loss, want.item(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(
        trainer.params["p_fc1_weight"], model.fc1.weight.detach().numpy(), rtol=1e-5, atol=1e-6
    )
    explicit = {k: np.full_like(v, 0.5) for k, v in attached.items()}  # params= wins
    assert Trainer(mod, "mse", level="O0", params=explicit).params["p_fc2_bias"][0] == 0.5


def test_a_forward_returning_a_tuple_of_one_tensor_is_trained_on_it():
    """from_exported_program's default output (no unwrap_unit_return_tuple) was refused:
    "the model must return one tensor, it returns T.Tuple(R.Tensor((4, 8)))"."""
    torch.manual_seed(2)
    model = _TorchMLP()
    program = torch.export.export(model, (torch.randn(B, D),))
    mod = from_exported_program(program, keep_params_as_input=True)
    trainer = Trainer(mod, "mse", SGD(0.05), level="O0")
    x, y = _batches(6, 1)[0]
    want = torch.nn.functional.mse_loss(model(torch.from_numpy(x)), torch.from_numpy(y))
    np.testing.assert_allclose(trainer.step(x, y), want.item(), rtol=1e-5, atol=1e-6)


def test_carried_weights_of_another_count_are_named_not_silently_replaced():
    torch.manual_seed(3)
    program = torch.export.export(_TorchMLP(), (torch.randn(B, D),))
    mod = from_exported_program(program, keep_params_as_input=True, unwrap_unit_return_tuple=True)
    func = mod["main"]
    mod["main"] = func.with_attr("params", list(func.attrs["params"])[:-1])
    with pytest.warns(UserWarning, match="carries 3 weights for its 4 params; they are not used"):
        Trainer(mod, "mse", SGD(0.05), level="O0")
