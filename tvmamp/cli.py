"""The ``tvmamp`` command line: one entry point, one module per subcommand in tvmamp.commands."""

from __future__ import annotations

import argparse
import importlib
import re
import sys

# Each module defines ``register(subparsers)``, which adds its parser and sets ``func``.
SUBCOMMANDS = (
    "demo",
    "compile",
    "run",
    "tune",
    "logs",
    "stats",
    "profile",
    "compare",
    "inspect",
    "search",
)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every subcommand registered."""
    parser = argparse.ArgumentParser(
        prog="tvmamp",
        description="Automatic mixed precision (fp16/bf16) compiler on Apache TVM.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in SUBCOMMANDS:
        importlib.import_module(f"tvmamp.commands.{name}").register(subparsers)
    return parser


def main(argv=None) -> int:
    """Run the command line; returns the exit code."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, TypeError, OSError, ImportError, RuntimeError) as err:
        # messages name their origin for API users ("tvmamp run: ..."); the prefix says it here
        text = re.sub(r"^tvmamp( \w+)?: ", "", str(err))
        print(f"tvmamp {args.command}: error: {text}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
