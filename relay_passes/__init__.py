"""Relax passes of tvmamp (the folder keeps the design card's name; Relay is gone in TVM 0.27)."""

from .amp_report import AmpReport, ForcedNode
from .auto_mixed_precision import AutoMixedPrecision

__all__ = ["AmpReport", "AutoMixedPrecision", "ForcedNode"]
