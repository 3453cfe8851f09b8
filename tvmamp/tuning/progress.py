"""The tqdm progress bar of tvmamp.tune: trials done, the task being tuned, its best latency."""

from __future__ import annotations

import sys

from tqdm import tqdm


class Progress:
    """A progress bar over the trials of one ``tune`` call.

    Parameters
    ----------
    total : int
        Trials this call will run.
    enabled : bool
        False hides the bar (tests, quiet runs).
    """

    def __init__(self, total: int, enabled: bool = True):
        self.bar = tqdm(
            total=total, unit="trial", desc="tvmamp tune", file=sys.stderr, disable=not enabled
        )
        self.task = ""
        self.best: float | None = None
        self.new_trials = 0

    def start_task(self, name: str, best_secs: float | None) -> None:
        """A new task begins; ``best_secs`` is its best time in the log so far (None if none)."""
        self.task, self.best = name, best_secs
        self._show()

    def measured(self, secs: list) -> None:
        """One batch of candidates was measured (None for a failed one)."""
        good = [s for s in secs if s is not None]
        if good:
            self.best = min([*good, *([self.best] if self.best is not None else [])])
        self.new_trials += len(secs)
        self.bar.update(len(secs))
        self._show()

    def _show(self) -> None:
        best = f"{self.best * 1e3:.4g} ms" if self.best is not None else "-"
        self.bar.set_postfix_str(f"task={self.task} best={best}", refresh=True)

    def close(self) -> None:
        """Finish the bar."""
        self.bar.close()
