"""The compute capability of a CUDA target, from its ``arch`` ("sm_80" -> 80)."""

from __future__ import annotations

import re

import tvm


def compute_capability(target: tvm.target.Target) -> int:
    """70 for sm_70, 80 for sm_80, 90 for sm_90a, ..."""
    arch = str(target.attrs.get("arch", "sm_50"))
    match = re.fullmatch(r"sm_(\d+)[a-z]?", arch)
    if match is None:
        raise ValueError(f"tvmamp: CUDA arch {arch!r} is not of the form sm_XY")
    return int(match.group(1))


__all__ = ["compute_capability"]
