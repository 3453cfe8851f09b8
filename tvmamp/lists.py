"""get_white_list / get_black_list: the effective op lists for a level, dtype and target."""

from __future__ import annotations

from tvmamp.policy import Policy, check_dtype, check_level
from tvmamp.targets import resolve_target


def _policy(level: str, dtype: str | None, target, **custom) -> Policy:
    check_level(level, "tvmamp")
    tvm_target, entry = resolve_target(target)
    dtype = check_dtype(dtype or entry.default_dtype(tvm_target))
    unsupported = entry.unsupported_low_ops(tvm_target, dtype)
    return Policy.for_level(level, dtype, unsupported_low_ops=unsupported, **custom)


def get_white_list(level: str = "O1", dtype: str | None = None, target="llvm", **custom):
    """Relax ops that run in the low dtype whatever their inputs at this level."""
    return _policy(level, dtype, target, **custom).white_list()


def get_black_list(level: str = "O1", dtype: str | None = None, target="llvm", **custom):
    """Relax ops that run in fp32 whatever their inputs at this level."""
    return _policy(level, dtype, target, **custom).black_list()
