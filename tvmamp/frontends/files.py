"""Model files and Python objects to ``(mod, params)``: .onnx, .pt2, TorchScript, modules.

Input shapes come as a list of ``(name or None, shape)`` (``tvmamp compile --input-shape``); a
dimension given as ``?`` is ``None``: an ONNX model keeps its own (symbolic) dimension there.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import zipfile

import numpy as np

from .common import require

TORCHSCRIPT_HINT = (
    "save the model with torch.export.save(torch.export.export(model.eval(), args), 'model.pt2') "
    "and compile the .pt2 instead"
)


def parse_input_shapes(texts) -> list:
    """``["image=1,3,32,32", "2,16", "ids=?,128"]`` -> ``[("image", (1, 3, 32, 32)),
    (None, (2, 16)), ("ids", (None, 128))]``: ``?`` keeps an ONNX model's own dimension (a
    symbolic batch), as ``None`` in ``from_onnx``'s ``shape_dict``."""
    shapes = []
    for text in texts or ():
        name, _, dims = text.rpartition("=")
        parts = [d.strip() for d in dims.replace("x", ",").split(",")]
        shape = tuple(None if d == "?" else int(d) for d in parts if d == "?" or d.isdigit())
        if len(shape) != len(parts) or any(d is not None and d <= 0 for d in shape):
            raise ValueError(
                f"tvmamp: input shape {text!r} is not NAME=D0,D1,... or D0,D1,... "
                "with positive integer dimensions, or ? to keep an ONNX model's own"
            )
        shapes.append((name.strip() or None, shape))
    return shapes


def random_inputs(input_shapes, component: str) -> list[np.ndarray]:
    """Seeded random float32 example inputs of the given shapes (for torch.export)."""
    if not input_shapes:
        raise ValueError(
            f"{component}: the model's input shapes are unknown; give them with "
            "--input-shape 1,3,224,224 (one per input, in order)"
        )
    for name, shape in input_shapes:
        if None in shape:
            raise ValueError(
                f"{component}: input shape {name + '=' if name else ''}"
                f"{','.join('?' if d is None else str(d) for d in shape)} has a ? dimension; "
                "example inputs need every dimension (? keeps an ONNX model's own)"
            )
    rng = np.random.default_rng(0)
    return [rng.standard_normal(shape).astype("float32") for _, shape in input_shapes]


def load_onnx_file(path: str, input_shapes=None):
    """An ``.onnx`` file; named shapes go to ``shape_dict``, unnamed ones to inputs in order."""
    onnx = require("onnx", "onnx", "tvmamp: loading an .onnx file")
    from .onnx import from_onnx, graph_inputs, read_model

    model = read_model(onnx, path)
    return from_onnx(model, shape_dict=_shape_dict(graph_inputs(model), input_shapes))


def _shape_dict(inputs, input_shapes) -> dict | None:
    if not input_shapes:
        return None
    if len(input_shapes) > len(inputs):
        raise ValueError(
            f"tvmamp: {len(input_shapes)} input shapes given, but the ONNX model has "
            f"{len(inputs)} inputs ({', '.join(inputs)})"
        )
    return {name or inputs[i]: shape for i, (name, shape) in enumerate(input_shapes)}


def load_exported_program_file(path: str, input_shapes=None):
    """A ``.pt2`` file from ``torch.export.save``; its signature fixes the input shapes."""
    torch = require("torch", "torch", "tvmamp: loading a .pt2 file")
    from .torch import import_exported_program

    if input_shapes:
        raise ValueError(f"tvmamp: {path!r} is an exported program; its input shapes are fixed")
    what = _not_an_exported_program(path)
    if what:
        raise ValueError(f"tvmamp: {path!r} is not a torch.export .pt2 archive: {what}")
    try:
        # torch logs the cause with its traceback, then raises "check the warnings above"
        with _logged_errors("torch.export") as logged:
            program = torch.export.load(path)
    except Exception as err:  # torch raises several types for a corrupt archive
        cause = logged[-1] if logged else err
        raise ValueError(f"tvmamp: {path!r} is not a torch.export .pt2 archive: {cause}") from err
    return import_exported_program(program)


def _not_an_exported_program(path: str) -> str | None:
    """Why a ``.pt2`` file is not a ``torch.export.save`` archive, from its zip members' names
    (``None`` where it may be one)."""
    if not zipfile.is_zipfile(path):
        return f"it is not a zip archive; {TORCHSCRIPT_HINT}"
    with zipfile.ZipFile(path) as archive:
        names = {name.split("/", 1)[-1] for name in archive.namelist()}
    if "constants.pkl" in names or any(name.startswith("code/") for name in names):
        return "it holds a TorchScript module (torch.jit.save); give it a .pt suffix"
    if "data.pkl" in names:
        return f"it holds a torch.save checkpoint (weights or a pickled module); {TORCHSCRIPT_HINT}"
    return None  # torch.export.load tells the rest (other archive versions included)


@contextlib.contextmanager
def _logged_errors(logger_name: str):
    """Keep a logger's records from the console while the block runs; yields the list of the
    exceptions they carried."""

    class Keep(logging.Handler):
        def emit(self, record):
            if record.exc_info and record.exc_info[1] is not None:
                errors.append(record.exc_info[1])

    errors: list = []
    logger, handler = logging.getLogger(logger_name), Keep()
    propagate = logger.propagate
    logger.addHandler(handler)
    logger.propagate = False
    try:
        yield errors
    finally:
        logger.removeHandler(handler)
        logger.propagate = propagate


def load_torchscript_file(path: str, input_shapes=None):
    """A TorchScript ``.pt`` file, converted with torch's TorchScript-to-export converter.

    TorchScript keeps no input shapes, so ``input_shapes`` are required. The converter
    (``torch._export.converter``, a private torch API) lifts the weights as constants, so the
    returned params are empty and the weights are converted at compile time.
    """
    torch = require("torch", "torch", "tvmamp: loading a TorchScript file")
    from .torch import import_exported_program

    try:
        script = torch.jit.load(path, map_location="cpu")
    except Exception as err:  # torch.jit.load raises RuntimeError and others
        raise ValueError(
            f"tvmamp: {path!r} is not a TorchScript archive ({err}); if it holds a pickled "
            f"module or a state dict, {TORCHSCRIPT_HINT}"
        ) from err
    args = tuple(torch.from_numpy(x) for x in random_inputs(input_shapes, "tvmamp"))
    try:
        from torch._export.converter import TS2EPConverter

        program = TS2EPConverter(script, args).convert()
    except Exception as err:  # the converter raises many types
        raise RuntimeError(
            f"tvmamp: torch could not convert the TorchScript model {path!r} to an exported "
            f"program ({err}); {TORCHSCRIPT_HINT}"
        ) from err
    return import_exported_program(program)


def from_object(obj, input_shapes=None):
    """``(mod, params)`` from what a ``module:function`` factory returned.

    Accepted: a torch.nn.Module (shapes from ``input_shapes``), ``(nn.Module, example_inputs)``,
    a torch ExportedProgram, an onnx.ModelProto; anything else is returned as ``(obj, None)``
    or, for a pair, as it is.
    """
    torch, onnx = sys.modules.get("torch"), sys.modules.get("onnx")
    if torch is not None:
        from .torch import from_torch

        if isinstance(obj, tuple) and len(obj) == 2 and isinstance(obj[0], torch.nn.Module):
            return from_torch(obj[0], obj[1])
        if isinstance(obj, torch.export.ExportedProgram):
            return from_torch(obj, None)
        if isinstance(obj, torch.nn.Module):
            return from_torch(obj, random_inputs(input_shapes, "tvmamp"))
    if onnx is not None and isinstance(obj, onnx.ModelProto):
        from .onnx import from_onnx, graph_inputs

        return from_onnx(obj, shape_dict=_shape_dict(graph_inputs(obj), input_shapes))
    if isinstance(obj, tuple) and len(obj) == 2:
        return obj
    return obj, None
