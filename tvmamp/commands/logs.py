"""``tvmamp logs show``: what a tuning log holds (target, level, dtype, best time per kernel)."""

from __future__ import annotations


def register(subparsers) -> None:
    """Add the ``logs`` parser with its ``show`` action."""
    p = subparsers.add_parser(
        "logs",
        help="inspect tuning logs written by tvmamp tune",
        description="Inspect a tuning log directory written by tvmamp tune.",
    )
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    show = actions.add_parser(
        "show",
        help="target, level, dtype and the best time of each kernel",
        description="Print a tuning log's manifest and, per kernel, trials and best time.",
    )
    show.add_argument("work_dir", metavar="DIR", help="the tuning log directory")
    show.set_defaults(func=run)


def run(args) -> int:
    """Print the log summary."""
    from tvmamp.tuning.summary import describe_log

    print(describe_log(args.work_dir))
    return 0
