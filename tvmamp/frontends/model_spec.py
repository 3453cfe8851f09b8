"""Load a model named on the command line: a built-in or suite name, module:function or a file."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os

import tvm

from tvmamp import models
from tvmamp.messages import last_line

from . import files

# File suffix -> loader(path[, input_shapes]) -> (mod, params). Frontends add theirs here;
# a loader that takes ``input_shapes`` gets the ``--input-shape`` values.
FILE_LOADERS: dict = {}


def _load_json(path):
    try:
        with open(path, encoding="utf-8") as f:
            return tvm.ir.load_json(f.read()), None
    except (ValueError, RuntimeError) as err:  # json's, UTF-8's and TVM's errors
        raise ValueError(
            f"tvmamp: {path!r} is not a module saved with tvm.ir.save_json: {last_line(err)}"
        ) from err


FILE_LOADERS[".json"] = _load_json
FILE_LOADERS[".onnx"] = files.load_onnx_file
FILE_LOADERS[".pt2"] = files.load_exported_program_file
FILE_LOADERS[".pt"] = files.load_torchscript_file
FILE_LOADERS[".ts"] = files.load_torchscript_file


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


def _load_file(path: str, input_shapes):
    loader = FILE_LOADERS[os.path.splitext(path)[1].lower()]
    if not os.path.isfile(path):
        raise FileNotFoundError(f"tvmamp: no such model file {path!r}")
    if "input_shapes" in inspect.signature(loader).parameters:
        return loader(path, input_shapes=input_shapes)
    if input_shapes:
        raise ValueError(f"tvmamp: input shapes cannot be given for {path!r}; its shapes are fixed")
    return loader(path)


def _load_suite(name: str, input_shapes):
    from tvmamp import suite

    if not input_shapes:
        return suite.load(name)
    if len(input_shapes) != 1:
        raise ValueError(f"tvmamp: suite model {name!r} takes one input shape, got {input_shapes}")
    return suite.load(name, shape=input_shapes[0][1])


def load_model(spec: str, input_shapes=None):
    """Return ``(model, params)`` for a model spec.

    Parameters
    ----------
    spec : str
        A built-in model name (``tvmamp.models.MODELS``), a suite model name
        (``tvmamp.suite.SUITE``: resnet18, mobilenet_v2, transformer_encoder, onnx_cnn),
        ``module:function`` or ``file.py:function`` (the function returns a Relax module,
        ``(module, params)``, a torch.nn.Module, ``(nn.Module, example_inputs)``, a torch
        ExportedProgram or an onnx.ModelProto), or a file whose suffix has a loader in
        ``FILE_LOADERS``: ``.json`` (``tvm.ir.save_json``), ``.onnx``, ``.pt2``
        (``torch.export.save``), ``.pt``/``.ts`` (TorchScript).
    input_shapes : list of (name or None, shape), optional
        Input shapes (see :func:`tvmamp.frontends.files.parse_input_shapes`) for models that
        do not fix them: ONNX models with symbolic dimensions, TorchScript files, torch modules
        and suite models.
    """
    if spec in models.MODELS:
        if input_shapes:
            raise ValueError(f"tvmamp: built-in model {spec!r} takes no input shapes")
        return models.get_model(spec)
    from tvmamp.suite import SUITE

    if spec in SUITE:
        return _load_suite(spec, input_shapes)
    if os.path.splitext(spec)[1].lower() in FILE_LOADERS:
        return _load_file(spec, input_shapes)
    if ":" in spec:
        module_name, func_name = spec.rsplit(":", 1)
        return files.from_object(_call_factory(module_name, func_name), input_shapes)
    known = ", ".join(sorted([*models.MODELS, *SUITE]))
    suffixes = ", ".join(sorted(FILE_LOADERS))
    raise ValueError(
        f"tvmamp: cannot load model {spec!r}: give a built-in model ({known}), "
        f"module:function, or a file ending in {suffixes}"
    )
