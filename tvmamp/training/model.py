"""The model a Trainer trains: a Relax forward function and the initial values of its params."""

from __future__ import annotations

import dataclasses

import numpy as np
import tvm
from tvm import relax

from tvmamp.tensors import static_shape


@dataclasses.dataclass(frozen=True)
class ForwardModel:
    """``func(*inputs, *params)`` returning one tensor; ``num_input`` data inputs come first."""

    func: relax.Function
    num_input: int

    @property
    def inputs(self) -> list:
        return list(self.func.params[: self.num_input])

    @property
    def params(self) -> list:
        return list(self.func.params[self.num_input :])

    @property
    def param_names(self) -> list[str]:
        return [p.name for p in self.params]


def load_forward(mod, input_spec=None) -> ForwardModel:
    """Accept an IRModule (``main`` with attr ``num_input``), a relax.Function or an nn.Module.

    An ``nn.Module`` needs ``input_spec``: ``{"x": nn.spec.Tensor(shape, dtype), ...}`` for
    the arguments of its ``forward``.
    """
    from tvm.relax.frontend import nn

    if isinstance(mod, nn.Module):
        if not isinstance(input_spec, dict) or not input_spec:
            raise TypeError(
                "tvmamp.training: an nn.Module needs input_spec={'x': nn.spec.Tensor(shape, "
                "dtype), ...} naming the inputs of its forward"
            )
        mod, _ = mod.export_tvm(spec={"forward": input_spec})
        func = mod["forward"]
    elif isinstance(mod, tvm.IRModule):
        names = [gv.name_hint for gv in mod.get_global_vars()]
        if "main" not in names:
            raise ValueError(f"tvmamp.training: the IRModule has no 'main' function, only {names}")
        func = mod["main"]
    elif isinstance(mod, relax.Function):
        func = mod
    else:
        raise TypeError(
            "tvmamp.training: the model must be a tvm.IRModule, a relax.Function or a "
            f"relax.frontend.nn.Module, got {type(mod).__name__}"
        )
    return _checked(func)


def _checked(func: relax.Function) -> ForwardModel:
    attrs = func.attrs or {}
    if "num_input" not in attrs:
        raise ValueError(
            "tvmamp.training: the forward function needs the attribute num_input (the number "
            "of data inputs before the params), e.g. func.with_attr('num_input', 1)"
        )
    model = ForwardModel(func, int(attrs["num_input"]))
    if not model.params:
        raise ValueError("tvmamp.training: the forward function has no params to train")
    for var in model.params:
        dtype = str(getattr(var.ty, "dtype", None))
        if dtype != "float32" or static_shape(var.ty) is None:
            raise TypeError(
                f"tvmamp.training: param {var.name!r} is {var.ty}; trainable params must be "
                "float32 tensors of static shape (tvmamp keeps fp32 master weights)"
            )
    return model


def initial_params(model: ForwardModel, params=None, seed: int = 0) -> dict[str, np.ndarray]:
    """Given values (checked), else seeded ones: N(0, 1/fan_in) for tensors of rank >= 2,
    ones for 1-d ``*weight``/``*gamma``/``*scale``, zeros for other 1-d tensors."""
    shapes = {v.name: static_shape(v.ty) for v in model.params}
    if params is not None:
        return _given_params(params, shapes)
    rng = np.random.default_rng(seed)
    values = {}
    for name, shape in shapes.items():
        if len(shape) >= 2:
            fan_in = int(np.prod(shape[1:]))
            values[name] = rng.standard_normal(shape) / np.sqrt(fan_in)
        elif name.rsplit(".", 1)[-1].rsplit("_", 1)[-1] in ("weight", "gamma", "scale"):
            values[name] = np.ones(shape)
        else:
            values[name] = np.zeros(shape)
    return {k: v.astype("float32") for k, v in values.items()}


def _given_params(params, shapes) -> dict[str, np.ndarray]:
    if not isinstance(params, dict):
        raise TypeError(f"tvmamp.training: params must be a dict name -> array, got {params!r}")
    missing, unknown = sorted(set(shapes) - set(params)), sorted(set(params) - set(shapes))
    if missing or unknown:
        raise ValueError(
            f"tvmamp.training: params missing {missing} and unknown {unknown}; the model's "
            f"params are {list(shapes)}"
        )
    values = {}
    for name, shape in shapes.items():
        value = params[name]
        array = value.numpy() if isinstance(value, tvm.runtime.Tensor) else np.asarray(value)
        if array.dtype != np.float32:
            raise TypeError(f"tvmamp.training: param {name!r} is {array.dtype}, not float32")
        if array.shape != shape:
            raise ValueError(
                f"tvmamp.training: param {name!r} has shape {array.shape}, not {shape}"
            )
        values[name] = np.array(array, copy=True)
    return values
