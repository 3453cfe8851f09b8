"""The model a Trainer trains: a Relax forward function and the initial values of its params."""

from __future__ import annotations

import dataclasses
import warnings

import numpy as np
import tvm
from tvm import relax

from tvmamp.tensors import static_shape

from .spec import export_forward


@dataclasses.dataclass(frozen=True)
class ForwardModel:
    """``func(*inputs, *params)`` returning one tensor; ``num_input`` data inputs come first.

    ``func`` takes only the params its body reads: those are trained. ``all_params`` are the
    params of the function as given, in its order; the ones ``func`` dropped (``unread``) get
    no gradient and no update, as PyTorch skips params whose grad is None. ``attached`` holds
    the weights the function carried in its ``params`` attribute (as
    ``from_exported_program(keep_params_as_input=True)`` attaches them), by name, or None.
    ``shared`` maps each name of an nn.Module's parameter object to its first name.
    """

    func: relax.Function
    num_input: int
    all_params: tuple = ()
    attached: dict | None = None
    shared: dict = dataclasses.field(default_factory=dict)  # nn.Module name -> first name

    @property
    def inputs(self) -> list:
        return list(self.func.params[: self.num_input])

    @property
    def params(self) -> list:
        return list(self.func.params[self.num_input :])

    @property
    def param_names(self) -> list[str]:
        """The names of the trained params (those the forward graph reads)."""
        return [p.name for p in self.params]

    @property
    def unread(self) -> list:
        """The params of the given function that its body never reads (not trained)."""
        read = set(self.param_names)
        return [p for p in self.all_params if p.name not in read]


def load_forward(mod, input_spec=None) -> ForwardModel:
    """Accept an IRModule (``main`` with attr ``num_input``), a relax.Function or an nn.Module.

    An ``nn.Module`` needs ``input_spec``: ``{"x": nn.spec.Tensor(shape, dtype), ...}`` for
    the arguments of its ``forward``.
    """
    from tvm.relax.frontend import nn

    if isinstance(mod, nn.Module):
        shared = _shared_names(mod)
        exported = export_forward(mod, input_spec)
        return dataclasses.replace(_checked(exported["forward"]), shared=shared)
    if isinstance(mod, tvm.IRModule):
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
    num_input = int(attrs["num_input"])
    func = _unit_tuple_unwrapped(func)
    all_params = list(func.params[num_input:])
    attached = _attached_weights(func, all_params)
    if "params" in attrs:  # the values now live in ``attached``; the graph does not need them
        func = func.without_attr("params")
    read = relax.analysis.free_vars(func.body)
    trained = [p for p in all_params if any(p.same_as(v) for v in read)]
    if len(trained) != len(all_params):
        inputs = list(func.params[:num_input])
        func = relax.Function([*inputs, *trained], func.body, func.ret_ty, func.is_pure, func.attrs)
    model = ForwardModel(func, num_input, tuple(all_params), attached)
    if not model.params:
        raise ValueError(
            "tvmamp.training: the forward function has no params to train (its output reads "
            f"none of {[p.name for p in all_params]})"
        )
    for var in all_params:
        dtype = str(getattr(var.ty, "dtype", None))
        if dtype != "float32" or static_shape(var.ty) is None:
            raise TypeError(
                f"tvmamp.training: param {var.name!r} is {var.ty}; trainable params must be "
                "float32 tensors of static shape (tvmamp keeps fp32 master weights)"
            )
    return model


def _unit_tuple_unwrapped(func: relax.Function) -> relax.Function:
    """``func`` returning its one tensor where it returns a tuple of one (as
    ``from_exported_program`` writes a module's output unless ``unwrap_unit_return_tuple``)."""
    ty = func.ret_ty
    if not isinstance(ty, relax.TupleType) or len(ty.fields) != 1:
        return func
    blocks = func.body.blocks if isinstance(func.body, relax.SeqExpr) else []
    if len(blocks) != 1 or not isinstance(blocks[0], relax.DataflowBlock):
        return func
    bb = relax.BlockBuilder()
    attrs = {key: func.attrs[key] for key in func.attrs.keys()} if func.attrs else None
    with bb.function("main", list(func.params), attrs=attrs, pure=func.is_pure):
        with bb.dataflow():
            for binding in blocks[0].bindings:
                bb.emit_normalized(binding)
            out = bb.emit_output(relax.TupleGetItem(func.body.body, 0))
        bb.emit_func_output(out)
    return bb.get()["main"]


def _shared_names(module) -> dict[str, str]:
    """{name: first name of the same parameter object} for an nn.Module (tied weights)."""
    first, names = {}, {}
    for name, param in module.named_parameters():
        names[name] = first.setdefault(id(param), name)
    return names


def _attached_weights(func: relax.Function, params: list) -> dict | None:
    """The function's ``params`` attribute as {name: value}, when it has one value per param."""
    attrs = func.attrs or {}
    values = attrs["params"] if "params" in attrs else None
    if values is None:
        return None
    if len(values) != len(params):
        warnings.warn(
            f"tvmamp.training: the forward function carries {len(values)} weights for its "
            f"{len(params)} params; they are not used (pass params=, or seeded values start)",
            UserWarning,
            stacklevel=4,
        )
        return None
    return {p.name: v for p, v in zip(params, values)}


def initial_params(model: ForwardModel, params=None, seed: int = 0) -> dict[str, np.ndarray]:
    """The initial value of every param in ``model.all_params``, trained or not.

    ``params`` if given (checked), else the weights the model carries (``model.attached``),
    else seeded ones: N(0, 1/fan_in) for tensors of rank >= 2, ones for 1-d
    ``*weight``/``*gamma``/``*scale``, zeros for other 1-d tensors.
    """
    shapes = {v.name: static_shape(v.ty) for v in model.all_params}
    if params is None and model.attached is not None:
        params = model.attached
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


def untrained_params(model: ForwardModel, values: dict, given: bool) -> dict[str, str | None]:
    """{unread param: the trained param it is tied to, or None}, with one warning naming them.

    An unread param is tied to a read one (a weight shared by two modules and imported under
    both names, only one of which the graph reads) when both are names of one nn.Module
    parameter object, or when the values were ``given`` (``params=`` or the model's attached
    weights, not seeded) and it holds exactly the same shape and values, not all equal (two
    zero biases are not a tie). A tied param starts from its twin's value.
    """
    untrained = {}
    by_object = {}
    for name in model.param_names:
        by_object.setdefault(model.shared.get(name, name), name)
    for var in model.unread:
        value = values[var.name]
        shared = model.shared.get(var.name)
        twins = [by_object[shared]] if shared in by_object else []
        if not twins and given and value.size > 1 and np.ptp(value) > 0:
            twins = [
                n
                for n in model.param_names
                if values[n].shape == value.shape and np.array_equal(values[n], value)
            ]
        untrained[var.name] = twins[0] if twins else None
    if untrained:
        tied = [f"{u!r} is tied to {t!r} and trained as it" for u, t in untrained.items() if t]
        warnings.warn(
            f"tvmamp.training: the forward graph never reads params {list(untrained)}; they "
            "are not trained (no gradient, no weight decay or momentum, as PyTorch skips "
            "params whose grad is None)" + (f"; {', '.join(tied)}" if tied else ""),
            UserWarning,
            stacklevel=3,
        )
    return untrained
