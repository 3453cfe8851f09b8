"""Helpers shared by the frontends: optional extras, errors and parameter naming."""

from __future__ import annotations

import importlib
from collections.abc import Mapping

import numpy as np
import tvm
from tvm import relax


class MissingExtraError(ImportError, RuntimeError):
    """An optional dependency (a ``pip install tvmamp[extra]``) is not installed."""


class UnsupportedOperatorError(ValueError):
    """The model uses operators that TVM's importer cannot translate.

    Attributes
    ----------
    operators : list of str
        The operator names, sorted.
    """

    def __init__(self, message: str, operators):
        super().__init__(message)
        self.operators = sorted(operators)


def require(module: str, extra: str, component: str):
    """Import ``module`` or raise :class:`MissingExtraError` saying how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise MissingExtraError(
            f"{component} needs the {module!r} package, which is not installed: "
            f"pip install 'tvmamp[{extra}]'"
        ) from err


def node_arg(node, index: int, name: str, default=None):
    """Argument ``index`` of an FX ``node`` as passed, by position or as keyword ``name``."""
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def reads_beyond_first(node) -> bool:
    """Whether a user of an FX node that returns several results reads more than result 0."""
    import operator

    return any(u.target is not operator.getitem or u.args[1] != 0 for u in node.users)


def to_numpy(value) -> np.ndarray:
    """A TVM tensor, torch tensor or array-like as a numpy array."""
    if isinstance(value, tvm.runtime.Tensor):
        return value.numpy()
    if hasattr(value, "detach"):
        return value.detach().cpu().numpy()
    return np.asarray(value)


def rename_params(func: relax.Function, names: Mapping[str, str]) -> relax.Function:
    """Rename parameters of ``func`` (old name -> new name), keeping their order and types."""
    changed = {p: relax.Var(names[p.name], p.ty) for p in func.params if p.name in names}
    changed = {old: new for old, new in changed.items() if old.name != new.name}
    if not changed:
        return func
    body = func.bind_params(changed).body
    params = [changed.get(p, p) for p in func.params]
    return relax.Function(params, body, func.ret_ty, func.is_pure, func.attrs)


def split_params(mod: tvm.IRModule, values, component: str):
    """Detach trailing parameter values from ``main``: returns (module, {name: numpy array}).

    ``values`` are in the order of ``main``'s parameters after its ``num_input`` data inputs.
    """
    func = mod["main"]
    num_input = int(func.attrs["num_input"])
    names = [p.name for p in func.params[num_input:]]
    if len(names) != len(values):
        raise RuntimeError(
            f"{component}: the importer returned {len(values)} parameter values for "
            f"{len(names)} parameters ({', '.join(names)})"
        )
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise RuntimeError(f"{component}: parameter names {duplicates} are not unique")
    mod = tvm.IRModule(dict(mod.functions_items()), attrs=mod.attrs)
    mod["main"] = func.without_attr("params")
    return mod, {n: to_numpy(v) for n, v in zip(names, values)}
