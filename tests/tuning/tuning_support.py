"""Constants and the tiny model shared by the tuning tests (imported by name, not a conftest)."""

from tvmamp import models

TARGET = "llvm -num-cores=1"
LEVEL = "O2"
DTYPE = "bfloat16"
TRIALS = 4


def tiny_model():
    """One Linear(64) layer on a 16 x 64 batch: at O2 the input cast and one matmul kernel (the
    output cast fuses into it)."""
    return models.simple_net(batch=16, hidden=64, layers=1, seed=3)
