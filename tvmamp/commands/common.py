"""Options shared by the subcommands that build a model."""

from __future__ import annotations

import argparse
import os

import numpy as np


def add_build_options(p) -> None:
    """--level/--target/--dtype and the list options of tvmamp.build."""
    p.add_argument(
        "model",
        metavar="MODEL",
        help="built-in model name, module:function, file.py:function or a model file",
    )
    p.add_argument(
        "--level",
        default="O1",
        help="O0, O1, O2, O3, OD or auto (default O1); compile also takes auto-search",
    )
    p.add_argument(
        "--target", default="llvm", help="llvm, 'llvm -mcpu=...', cuda, ... (default llvm)"
    )
    p.add_argument("--dtype", default=None, help="float16 or bfloat16 (default: per target)")
    p.add_argument("--white", default="", help="comma-separated ops to force low")
    p.add_argument("--black", default="", help="comma-separated ops to keep fp32")
    p.add_argument("--fp32-nodes", default="", help="comma-separated name patterns kept fp32")
    p.add_argument("--low-nodes", default="", help="comma-separated name patterns forced low")


def add_input_options(p) -> None:
    """--input-shape and --tuning-log: how a model file is imported and which kernels it uses."""
    add_shape_option(p)
    p.add_argument("--tuning-log", default=None, help="tuning log directory from tvmamp tune")


def add_shape_option(p) -> None:
    """--input-shape: static shapes for a model file's symbolic (or TorchScript's) inputs."""
    p.add_argument(
        "--input-shape",
        action="append",
        default=[],
        metavar="[NAME=]D0,D1,...",
        help="input shape, once per input in order (NAME= for ONNX input names); a ? dimension "
        "keeps an ONNX model's own (symbolic) one: --input-shape input_ids=?,128",
    )


def load_model_arg(args):
    """``(mod, params)`` for ``args.model`` with its ``--input-shape`` values."""
    from tvmamp.frontends.files import parse_input_shapes
    from tvmamp.frontends.model_spec import load_model

    return load_model(args.model, input_shapes=parse_input_shapes(args.input_shape))


def count(least: int):
    """An argparse ``type``: an integer of at least ``least``, refused with the value named."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"{value} is less than {least}")
        return value

    return parse


def read_arrays(path: str, who: str) -> list[np.ndarray]:
    """The arrays of an ``.npy`` file, or of an ``.npz`` archive in stored order; a missing or
    unreadable file is refused with its name."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{who}: no such file {path!r}")
    try:
        data = np.load(path)  # an array, or a lazy archive whose members are read below
        if isinstance(data, np.ndarray):
            return [data]
        with data:
            return [data[k] for k in data.files]
    except (ValueError, OSError, EOFError) as err:  # numpy's errors for a file it cannot read
        raise ValueError(f"{who}: {path!r} is not a numpy .npy or .npz file ({err})") from err


def _split(text: str):
    return [t.strip() for t in text.split(",") if t.strip()] or None


def build_kwargs(args) -> dict:
    """Keyword arguments for tvmamp.build from parsed options."""
    return dict(
        level=args.level,
        target=args.target,
        dtype=args.dtype,
        custom_white_list=_split(args.white),
        custom_black_list=_split(args.black),
        custom_fp32_nodes=_split(args.fp32_nodes),
        custom_low_nodes=_split(args.low_nodes),
    )
