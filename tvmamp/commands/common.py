"""Options shared by the subcommands that build a model."""

from __future__ import annotations


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
