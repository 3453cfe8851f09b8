"""The arrays of one train step checked against the model's inputs and targets."""

from __future__ import annotations

import numpy as np
import tvm

from tvmamp.tensors import check_array, dim_texts, shape_dims

COMPONENT = "tvmamp.training"


def check_step_data(data, want) -> list[np.ndarray]:
    """``data`` as numpy arrays, checked against ``want``, a list of (name, relax type).

    Dtypes and static shapes are checked by ``tvmamp.tensors.check_array``; a shape with a
    symbolic dimension (a dynamic batch ``n``) is checked here: its rank and static sizes, and
    one size for each symbolic variable across all the arrays (the inputs' ``n`` and the
    targets' ``n`` are one variable in the graph).
    """
    if len(data) != len(want):
        names = ", ".join(n for n, _ in want)
        raise TypeError(f"{COMPONENT}: step takes {len(want)} arrays ({names}), got {len(data)}")
    arrays = [check_array(a, n, t, COMPONENT) for a, (n, t) in zip(data, want)]
    sizes: dict[str, tuple[int, str]] = {}  # symbolic variable -> (its size, the array's name)
    for array, (name, ty) in zip(arrays, want):
        dims = shape_dims(ty)
        if dims is not None and not all(isinstance(d, int) for d in dims):
            _check_symbolic(array, name, dims, sizes)
    return arrays


def _check_symbolic(array: np.ndarray, name: str, dims: tuple, sizes: dict) -> None:
    expected = f"({', '.join(dim_texts(dims))})"
    if array.ndim != len(dims):
        raise ValueError(
            f"{COMPONENT}: {name!r} has shape {array.shape}, but the model expects {expected}"
        )
    for size, dim in zip(array.shape, dims):
        if isinstance(dim, int):
            if size != dim:
                raise ValueError(
                    f"{COMPONENT}: {name!r} has shape {array.shape}, but the model expects "
                    f"{expected}"
                )
        elif isinstance(dim, tvm.tirx.Var):
            first, source = sizes.setdefault(dim.name, (size, name))
            if size != first:
                raise ValueError(
                    f"{COMPONENT}: {name!r} has shape {array.shape}, so {dim.name}={size}, but "
                    f"{source!r} gave {dim.name}={first}; the model expects {expected}"
                )
