"""Target entries for tvmamp: one per target kind, registered in one dict.

The registry and the target spec parsing live in :mod:`tvmamp.targets.registry`; each target
module (``llvm``, ``cuda``, ``npu``) registers its :class:`TargetEntry` when imported, which
this package does. Adding a target touches only ``targets/`` and ``schedules/``.
"""

from . import cuda as _cuda  # noqa: F401  (registers "cuda")
from . import llvm as _llvm  # noqa: F401  (registers "llvm")
from . import npu as _npu  # noqa: F401  (registers "npu")
from .npu import register_npu
from .registry import (
    DEFAULT_SPACE,
    REGISTRY,
    TARGET_ALIASES,
    DesignSpace,
    SourceFormat,
    TargetEntry,
    register_target,
    resolve_target,
)

__all__ = [
    "DEFAULT_SPACE",
    "REGISTRY",
    "TARGET_ALIASES",
    "DesignSpace",
    "SourceFormat",
    "TargetEntry",
    "register_npu",
    "register_target",
    "resolve_target",
]
