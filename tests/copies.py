"""Helpers of the transposing-copy tests (tests/schedules/test_*transpose.py): the target they
schedule for, numpy's dtype of a TVM one, and bit patterns to compare exactly."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import tvm
from forced_cpus import forced

# The extern functions of the 16 x 16 transpose (``transpose_intrin.function_name``).
TRANSPOSE_CALL = '"tvmamp_transpose_16x16_i'


def target(cores: int) -> tvm.target.Target:
    """znver4 (16-lane vectors, no sse4a), with ``cores`` cores."""
    return tvm.target.Target(forced("znver4", cores))


def numpy_dtype(dtype: str):
    return ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)


def bits(array: np.ndarray) -> np.ndarray:
    """The bit patterns of ``array``: NaN compares equal to itself, -0.0 differs from 0.0."""
    return array.view(f"uint{array.dtype.itemsize * 8}")
