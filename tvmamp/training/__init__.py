"""Mixed-precision training: loss scaling, the all-finite check and the update in one graph."""

from tvmamp.loss_scale import DynamicLossScale, NoOpLossScale, StaticLossScale

from .losses import LOSSES
from .optimizers import OPTIMIZERS, SGD, Adam
from .trainer import Trainer

__all__ = [
    "LOSSES",
    "OPTIMIZERS",
    "SGD",
    "Adam",
    "DynamicLossScale",
    "NoOpLossScale",
    "StaticLossScale",
    "Trainer",
]
