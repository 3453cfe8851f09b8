"""How an error raised inside TVM or another library is quoted in tvmamp's own messages."""

from __future__ import annotations


def last_line(err: BaseException) -> str:
    """The last non-empty line of ``err``'s message (TVM puts the check that failed there,
    after its traceback), or its type's name where the message is empty."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return lines[-1] if lines else type(err).__name__
