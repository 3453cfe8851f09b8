"""PNG plots: relative error per op (dtype colour-coded) and a loss-scale trajectory."""

from __future__ import annotations

import math
import os

DTYPE_COLOURS = {"float16": "tab:orange", "bfloat16": "tab:purple", "float32": "tab:blue"}
OTHER_COLOUR = "tab:gray"
HISTORY_KEYS = ("step", "loss", "loss_scale", "found_inf", "skipped")


def _figure(rows: int, height: float, width: float = 10):
    """A matplotlib Figure on the Agg canvas (no pyplot, no global backend change)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as err:
        raise RuntimeError(
            "tvmamp.debugging: plotting needs matplotlib; install it with "
            "pip install 'tvmamp[plot]'"
        ) from err
    fig = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(fig)
    return fig, fig.subplots(rows, 1, sharex=True, squeeze=False)[:, 0]


def _error_bars(ax, rows, floor, ceiling):
    """One bar per op, coloured by compute dtype; NaN/Inf errors hatched up to ``ceiling``."""
    for dtype in sorted({r.dtype for r in rows}):
        picked = [r for r in rows if r.dtype == dtype]
        heights = [
            max(r.max_rel_err, floor) if math.isfinite(r.max_rel_err) else ceiling for r in picked
        ]
        hatches = ["" if math.isfinite(r.max_rel_err) else "//" for r in picked]
        colour = DTYPE_COLOURS.get(dtype, OTHER_COLOUR)
        bars = ax.bar([r.index for r in picked], heights, color=colour, label=dtype or "other")
        for bar, hatch in zip(bars, hatches):
            bar.set_hatch(hatch)
    blown = [r.index for r in rows if not math.isfinite(r.max_rel_err)]
    if blown:
        ax.axhline(ceiling, color="red", linestyle=":", linewidth=1)
        ax.scatter(
            blown,
            [ceiling] * len(blown),
            marker="^",
            color="red",
            zorder=3,
            label="NaN/Inf in AMP output (drawn at the red line)",
        )


def plot_accuracy(report, path: str | os.PathLike) -> str:
    """Relative error of each op's output (log scale) in graph order, coloured by its dtype.

    Ops whose AMP output holds NaN/Inf where fp32 is finite get a hatched bar up to the top of
    the axis and a red triangle; the threshold is a dashed line; the first op over it is named.
    """
    fig, (ax,) = _figure(1, 5, width=12)
    rows = report.rows
    finite = [r.max_rel_err for r in rows if math.isfinite(r.max_rel_err) and r.max_rel_err > 0]
    floor = min(finite + [report.threshold]) / 10
    ceiling = max(finite + [report.threshold]) * 100
    _error_bars(ax, rows, floor, ceiling)
    ax.axhline(
        report.threshold,
        color="black",
        linestyle="--",
        linewidth=1,
        label=f"threshold {report.threshold:g}",
    )
    bad = report.first_bad
    if bad is not None:
        label = f"first op over the threshold:\n#{bad.index} {bad.op} ({bad.var}), {bad.dtype}"
        ax.scatter([bad.index], [ceiling * 4], marker="v", s=80, color="black", label=label)
    ax.set_ylim(floor, ceiling * 60)
    _label_error_axes(ax, report)
    fig.tight_layout()
    fig.savefig(path)
    return os.fspath(path)


def _label_error_axes(ax, report):
    ax.set_yscale("log")
    ax.set_ylabel("max |amp - fp32| / max |fp32|")
    ax.set_xlabel("op (graph order)")
    ax.set_title(f"AMP {report.level} ({report.low_dtype}) vs fp32: relative error per op")
    if len(report.rows) <= 60:
        ax.set_xticks([r.index for r in report.rows])
        ax.set_xticklabels([r.op for r in report.rows], rotation=90, fontsize=7)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)


def check_history(history) -> list:
    """Validate a training history: a list of dicts with the keys in ``HISTORY_KEYS``."""
    history = list(history)
    if not history:
        raise ValueError("tvmamp.debugging.plot_loss_scale: the training history is empty")
    for i, entry in enumerate(history):
        missing = [k for k in HISTORY_KEYS if not isinstance(entry, dict) or k not in entry]
        if missing:
            raise ValueError(
                f"tvmamp.debugging.plot_loss_scale: history entry {i} lacks {', '.join(missing)}; "
                f"each entry needs {', '.join(HISTORY_KEYS)} (as Trainer.history keeps them)"
            )
    return history


def plot_loss_scale(history, path: str | os.PathLike) -> str:
    """Loss scale (log2 axis), skipped steps and loss per training step, as one PNG.

    Parameters
    ----------
    history : list of dict
        One dict per step with "step", "loss", "loss_scale", "found_inf" and "skipped"
        (``Trainer.history``).
    path : path
        The PNG to write.
    """
    history = check_history(history)
    fig, (ax_scale, ax_loss) = _figure(2, 6)
    skipped = [h["step"] for h in history if h["skipped"]]
    for step in skipped:
        for ax in (ax_scale, ax_loss):
            ax.axvspan(step - 0.5, step + 0.5, color="red", alpha=0.15, linewidth=0)
    _scale_panel(ax_scale, history)
    _loss_panel(ax_loss, history, len(skipped))
    fig.tight_layout()
    fig.savefig(path)
    return os.fspath(path)


def _scale_panel(ax, history):
    steps = [h["step"] for h in history]
    ax.step(
        steps,
        [h["loss_scale"] for h in history],
        where="post",
        color="tab:blue",
        label="loss scale",
    )
    ax.set_yscale("log", base=2)
    inf = [h for h in history if h["found_inf"]]
    ax.scatter(
        [h["step"] for h in inf],
        [h["loss_scale"] for h in inf],
        marker="x",
        color="red",
        zorder=3,
        label=f"inf/NaN gradients ({len(inf)})",
    )
    ax.set_ylabel("loss scale")
    ax.set_title("Loss-scale trajectory")
    ax.legend(loc="best", fontsize=8)


def _loss_panel(ax, history, n_skipped):
    losses = [float(h["loss"]) for h in history]
    ax.plot([h["step"] for h in history], losses, color="tab:green", marker=".", label="loss")
    if all(v > 0 for v in losses if math.isfinite(v)):
        ax.set_yscale("log")
    ax.set_ylabel("loss")
    ax.set_xlabel("step")
    ax.legend(loc="best", fontsize=8, title=f"{n_skipped} skipped steps (red)")
