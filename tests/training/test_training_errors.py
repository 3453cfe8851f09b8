"""Bad input to the Trainer fails early with a message naming the value and the choices."""

import numpy as np
import pytest
from tvm import relax
from tvm.relax.frontend import nn

import tvmamp
from tvmamp import models
from tvmamp.training import SGD, Adam, DynamicLossScale, Trainer


@pytest.fixture(scope="module")
def model():
    return models.simple_net(batch=2, hidden=4, layers=1)


def test_unknown_loss_lists_the_choices(model):
    with pytest.raises(ValueError, match="loss 'hinge' is not one of mse, cross_entropy"):
        Trainer(model[0], loss="hinge")


def test_unknown_optimizer_lists_the_choices(model):
    with pytest.raises(ValueError, match="optimizer 'lamb' is not one of sgd, momentum, adam"):
        Trainer(model[0], optimizer="lamb")
    with pytest.raises(TypeError, match="optimizer must be tvmamp.training.SGD.*got 0.1"):
        Trainer(model[0], optimizer=0.1)
    # was "..., got type" for a class
    with pytest.raises(TypeError, match="got <class 'tvmamp.training.optimizers.SGD'>"):
        Trainer(model[0], optimizer=SGD)


def test_unknown_preset_lists_the_choices():
    with pytest.raises(ValueError, match="paddle, paddle_legacy, torch, mindspore"):
        DynamicLossScale(preset="amp")


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"scaler": 1024.0}, TypeError, "scaler must be NoOpLossScale"),
        ({"accumulate_steps": 0}, ValueError, "accumulate_steps must be >= 1"),
        ({"level": "O5"}, ValueError, "level 'O5' is not one of"),
        ({"dtype": "float64"}, ValueError, "dtype 'float64' is not one of"),
        ({"params": {"linear0.weight": np.zeros((4, 4))}}, ValueError, "params missing"),
        ({"model": object()}, TypeError, "must be a tvm.IRModule, a relax.Function or"),
        # was "got multiple values for keyword argument 'keep_io_types'"
        ({"keep_io_types": False}, ValueError, "keep_io_types cannot be set"),
        # was "dtype 'float32' is not one of float16, bfloat16", at O0 as well
        ({"level": "O1", "dtype": "float32"}, ValueError, "'float32' is only meaningful at .*O0"),
        # was "convert() got an unexpected keyword argument 'bogus_option'"
        ({"bogus_option": 1}, TypeError, "unknown option 'bogus_option'; it takes loss, "),
        ({"custom_white": ["exp"]}, TypeError, "did you mean custom_white_list"),
    ],
)
def test_bad_options(model, kwargs, error, match):
    mod = kwargs.pop("model", model[0])
    with pytest.raises(error, match=match):
        Trainer(mod, **kwargs)


def test_cross_entropy_needs_2d_outputs():
    mod, _ = models.transformer_layer(batch=1, seq=2, dim=4, heads=1)
    with pytest.raises(ValueError, match="'cross_entropy' needs model outputs of shape"):
        Trainer(mod, loss="cross_entropy")


def test_param_dtype_mismatch(model):
    mod, params = model
    wrong = {**params, "linear0.weight": params["linear0.weight"].astype("float16")}
    with pytest.raises(TypeError, match="param 'linear0.weight' is float16, not float32"):
        Trainer(mod, params=wrong)


def test_low_precision_model_is_refused():
    x = relax.Var("x", relax.TensorType((2, 4), "float16"))
    w = relax.Var("w", relax.TensorType((4, 4), "float16"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, w], attrs={"num_input": 1}):
        with bb.dataflow():
            out = bb.emit_output(relax.op.matmul(x, w))
        bb.emit_func_output(out)
    with pytest.raises(TypeError, match="param 'w' is .*float16.*master weights"):
        Trainer(bb.get())


def test_user_loss_of_the_wrong_type(model):
    pred = relax.Var("p", relax.TensorType((3, 4), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("loss", [pred, pred]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.sum(pred))
        bb.emit_func_output(out)
    with pytest.raises(TypeError, match="the loss function's predictions are"):
        Trainer(model[0], loss=bb.get()["loss"])


def test_model_without_num_input():
    mod, _ = models.simple_net(batch=2, hidden=4, layers=1)
    mod["main"] = mod["main"].without_attr("num_input")
    with pytest.raises(ValueError, match="needs the attribute num_input"):
        Trainer(mod)


def test_optimizer_hyper_parameters():
    with pytest.raises(ValueError, match="SGD lr=0 is out of range"):
        SGD(0)
    with pytest.raises(ValueError, match=r"Adam betas\[1\]=1.0 is out of range"):
        Adam(betas=(0.9, 1.0))


def test_an_unknown_optimizer_argument_names_the_valid_ones():
    """Python's own message named only the keyword ("unexpected keyword argument 'momentm'")."""
    with pytest.raises(
        TypeError,
        match=r"SGD got the unknown argument 'momentm'; it takes lr, "
        r"momentum, weight_decay, nesterov; did you mean momentum\?",
    ):
        SGD(0.1, momentm=0.9)
    with pytest.raises(
        TypeError, match=r"Adam got the unknown argument 'beta';.*did you mean betas"
    ):
        Adam(beta=0.9)
    with pytest.raises(TypeError, match="SGD got 5 positional arguments; it takes lr, momentum"):
        SGD(0.1, 0.9, 0.0, False, 3)
    assert SGD(lr=0.2, momentum=0.5).momentum == 0.5  # known keywords still pass


def test_an_op_without_a_gradient_is_named():
    """TVM registers no gradient for batch_norm: the error names it instead of TVM's internals."""
    mod, _params = models.conv_net(batch=2, channels=4, size=8, blocks=1)
    with pytest.raises(ValueError, match=r"has no gradient for .*relax\.nn\.batch_norm"):
        Trainer(mod, loss="mse")


def test_numpy_scalars_are_accepted_and_bool_nan_inf_refused():
    assert SGD(np.float32(0.1)).relax_optimizer() is not None
    assert Adam(np.float64(1e-3), betas=(np.float32(0.9), 0.999)).lr == np.float64(1e-3)
    with pytest.raises(TypeError, match="SGD lr must be a real number"):
        SGD(np.bool_(True))
    for bad in (np.float32("nan"), np.inf):
        with pytest.raises(ValueError, match=r"SGD lr=.* is out of range \(0.0, inf\)"):
            SGD(bad)


def test_float32_at_o0_trains_as_the_default_o0(model, rng):
    """O0 converts nothing, so dtype="float32" is accepted there and changes nothing."""
    mod, params = model
    fp32 = Trainer(mod, level="O0", dtype="float32", params=params)
    default = Trainer(mod, level="O0", params=params)
    assert fp32.dtype == "float32"
    x = rng.standard_normal((2, 4)).astype("float32")
    y = rng.standard_normal((2, 4)).astype("float32")
    for _ in range(3):
        np.testing.assert_allclose(fp32.step(x, y), default.step(x, y), rtol=1e-6)
    for name, value in fp32.params.items():
        np.testing.assert_allclose(value, default.params[name], rtol=1e-6, atol=1e-7)


def test_build_and_convert_take_float32_at_o0_only(model):
    """The Trainer's dtype check is tvmamp.convert's (tvmamp/conversion.py)."""
    mod, params = model
    converted = tvmamp.convert(mod, "O0", dtype="float32", params=params)
    assert converted.report.casts_inserted == 0
    with pytest.raises(ValueError, match=r"'float32' is only meaningful at level O0.*at O2"):
        tvmamp.build(mod, "O2", dtype="float32", params=params)
    with pytest.raises(ValueError, match="dtype 'fp16' is not one of float16, bfloat16"):
        tvmamp.convert(mod, "O0", dtype="fp16")


class _MLP(nn.Module):
    def __init__(self):
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(8, 2)

    def forward(self, x):
        return self.fc2(nn.relu(self.fc1(x)))


@pytest.mark.parametrize(
    "spec, error, match",
    [
        # was "MLP.forward() missing 1 required positional argument: 'x'"
        (
            {"inp": nn.spec.Tensor((2, 4), "float32")},
            ValueError,
            r"input_spec names 'inp', but _MLP.forward takes \(x\): 'inp' is not an argument "
            "of forward; forward's argument 'x' has no spec",
        ),
        (
            {"x": nn.spec.Tensor((2, 4), "float32"), "y": nn.spec.Tensor((2, 4), "float32")},
            ValueError,
            "'y' is not an argument of forward",
        ),
        # was "Binary operators must have the same datatype for both operands..."
        (
            {"x": nn.spec.Tensor((2, 4), "float16")},
            TypeError,
            r"input_spec\['x'\] is float16; give float32 inputs",
        ),
        ({"x": (2, 4)}, TypeError, r"input_spec\['x'\] must be nn.spec.Tensor"),
    ],
)
def test_input_spec_names_forward_arguments_and_float32_tensors(spec, error, match):
    with pytest.raises(error, match=match):
        Trainer(_MLP(), "mse", input_spec=spec)
