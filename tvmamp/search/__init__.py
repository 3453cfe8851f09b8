"""Automatic precision search: the fastest per-node plan that meets an error budget."""

from .budget import ErrorBudget
from .plan import PrecisionPlan, model_hash
from .search import search_precision

__all__ = ["ErrorBudget", "PrecisionPlan", "model_hash", "search_precision"]
