"""get_white_list / get_black_list: the effective op lists for a level, dtype and target."""

from __future__ import annotations

from tvmamp.conversion import target_policy


def get_white_list(level: str = "O1", dtype: str | None = None, target="llvm", **custom):
    """Relax ops that run in the low dtype whatever their inputs at this level."""
    policy, _, _ = target_policy(level, dtype, target, "tvmamp", check_hardware=False, **custom)
    return policy.white_list()


def get_black_list(level: str = "O1", dtype: str | None = None, target="llvm", **custom):
    """Relax ops that run in fp32 whatever their inputs at this level."""
    policy, _, _ = target_policy(level, dtype, target, "tvmamp", check_hardware=False, **custom)
    return policy.black_list()
