"""Helpers for tests that import small PyTorch modules and compare them with eager torch."""

import numpy as np
import torch

import tvmamp

TARGET = "llvm -num-cores=1"


class Lambda(torch.nn.Module):
    """A module whose forward is ``fn(*xs)``."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *xs):
        return self.fn(*xs)


def check_against_torch(model, *xs, levels=("O0", "O2"), o2_tol=2e-2):
    """Import ``model`` (a module or a function of the inputs), build it at each level and
    compare every result with eager torch: same dtypes and shapes, integer results equal,
    float results within 1e-5 at O0 and ``o2_tol`` at other levels."""
    model = model if isinstance(model, torch.nn.Module) else Lambda(model)
    tensors = tuple(torch.from_numpy(x) for x in xs)
    with torch.no_grad():
        want = model(*tensors)
    want = [w.numpy() for w in (want if isinstance(want, tuple) else (want,))]
    mod, params = tvmamp.from_torch(model, tensors)
    for level in levels:
        got = tvmamp.build(mod, level, TARGET, params=params)(*xs)
        got = [np.asarray(g) for g in (got if isinstance(got, (list, tuple)) else (got,))]
        assert len(got) == len(want), level
        for g, w in zip(got, want, strict=True):
            assert g.dtype == w.dtype and g.shape == w.shape, (level, g.dtype, g.shape)
            if np.issubdtype(w.dtype, np.integer):
                np.testing.assert_array_equal(g, w, err_msg=level)
            else:
                tol = 1e-5 if level == "O0" else o2_tol
                np.testing.assert_allclose(g, w, rtol=tol, atol=tol, err_msg=level)
