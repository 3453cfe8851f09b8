"""Shared pytest fixtures and helpers for tvmamp's tests."""

import numpy as np
import pytest


def pytest_collection_modifyitems(config, items):
    """Skip tests marked gpu when there is no CUDA device."""
    import tvm

    if tvm.cuda(0).exist:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def rng():
    """A seeded random generator: random, never-zero test inputs."""
    return np.random.default_rng(20261121)
