"""Load a model named on the command line: a built-in name, ``module:function`` or a file."""

from __future__ import annotations

import importlib
import importlib.util
import os

import tvm

from tvmamp import models

# File suffix -> loader(path) -> (mod, params). Frontends add theirs here.
FILE_LOADERS: dict = {}


def _load_json(path):
    return tvm.ir.load_json(open(path, encoding="utf-8").read()), None


FILE_LOADERS[".json"] = _load_json


def _call_factory(module_name: str, func_name: str):
    if module_name.endswith(".py"):
        if not os.path.isfile(module_name):
            raise FileNotFoundError(f"tvmamp: no such file {module_name!r}")
        spec = importlib.util.spec_from_file_location("_tvmamp_user_model", module_name)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(module_name)
    factory = getattr(module, func_name, None)
    if factory is None:
        raise ValueError(f"tvmamp: {module_name} has no function {func_name!r}")
    return factory()


def _split(result):
    if isinstance(result, tuple) and len(result) == 2:
        return result
    return result, None


def load_model(spec: str):
    """Return ``(model, params)`` for a model spec.

    ``spec`` is a built-in model name (see ``tvmamp.models.MODELS``), ``module:function`` or
    ``file.py:function`` (the function returns a model, or ``(model, params)``), or a file whose
    suffix has a loader in ``FILE_LOADERS`` (``.json`` from ``tvm.ir.save_json``; the frontends
    add theirs).
    """
    if spec in models.MODELS:
        return models.get_model(spec)
    suffix = os.path.splitext(spec)[1].lower()
    if suffix in FILE_LOADERS:
        if not os.path.isfile(spec):
            raise FileNotFoundError(f"tvmamp: no such model file {spec!r}")
        return FILE_LOADERS[suffix](spec)
    if ":" in spec:
        module_name, func_name = spec.rsplit(":", 1)
        return _split(_call_factory(module_name, func_name))
    known = ", ".join(sorted(models.MODELS))
    suffixes = ", ".join(sorted(FILE_LOADERS))
    raise ValueError(
        f"tvmamp: cannot load model {spec!r}: give a built-in model ({known}), "
        f"module:function, or a file ending in {suffixes}"
    )
