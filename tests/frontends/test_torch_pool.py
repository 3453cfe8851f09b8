"""tvmamp.from_torch: max pooling's indices and adaptive max pooling, against eager torch.

TVM's importer returned zeros for the indices of ``max_pool2d_with_indices`` (silently wrong
for ``return_indices=True`` and ``max_unpool2d``) and had no adaptive max pool.
Random ops, which it built as one fixed draw (or none), are refused.
"""

import numpy as np
import pytest

import tvmamp

torch = pytest.importorskip("torch")
F = torch.nn.functional
from torch_modules import Lambda, check_against_torch  # noqa: E402


def _floats(rng, *shape):
    return rng.standard_normal(shape).astype("float32")


@pytest.mark.parametrize(
    "fn, shape",
    [
        (lambda x: F.max_pool2d(x, 2, return_indices=True), (2, 3, 6, 9)),
        (
            lambda x: F.max_pool2d(
                x, 3, 2, padding=1, dilation=2, ceil_mode=True, return_indices=True
            ),
            (1, 2, 11, 10),
        ),
        (
            lambda x: F.max_pool2d(x, (2, 3), (1, 2), padding=(1, 1), return_indices=True),
            (1, 2, 7, 10),
        ),
        (lambda x: F.max_pool2d(x, 2, return_indices=True), (3, 6, 8)),  # no batch axis
        (lambda x: F.max_pool1d(x, 3, 2, padding=1, return_indices=True), (2, 3, 17)),
        (lambda x: F.max_pool3d(x, 2, (1, 2, 2), return_indices=True), (1, 2, 4, 6, 6)),
    ],
)
def test_max_pool_indices(fn, shape, rng):
    check_against_torch(fn, _floats(rng, *shape))


def test_max_pool_indices_of_ties_are_the_first_in_window_order(rng):
    x = rng.integers(0, 3, (1, 2, 6, 7)).astype("float32")  # many equal maxima
    check_against_torch(lambda x: F.max_pool2d(x, 3, 1, padding=1, return_indices=True), x)


def test_max_pool_indices_of_nan_windows(rng):
    """A NaN is the maximum; of several, the last (ATen's scan). Only the indices are
    compared: TVM's max pooling does not propagate NaN values as torch does."""
    x = _floats(rng, 1, 1, 4, 4)
    x[0, 0, 0, 1] = x[0, 0, 1, 1] = x[0, 0, 3, 2] = np.nan
    check_against_torch(lambda x: F.max_pool2d(x, 2, return_indices=True)[1], x, levels=("O0",))


def test_max_unpool_after_max_pool(rng):
    fn = lambda x: F.max_unpool2d(*F.max_pool2d(x, 2, return_indices=True), 2)  # noqa: E731
    check_against_torch(fn, _floats(rng, 1, 2, 6, 8))


def test_max_pool_without_indices_adds_no_kernel(rng):
    mod, _ = tvmamp.from_torch(Lambda(lambda x: F.max_pool2d(x, 2)), (torch.randn(1, 2, 4, 4),))
    assert "max_pool2d_indices" not in [g.name_hint for g in mod.get_global_vars()]


@pytest.mark.parametrize(
    "fn, shape",
    [
        (lambda x: F.adaptive_max_pool2d(x, (3, 4), return_indices=True), (2, 3, 10, 11)),
        (lambda x: F.adaptive_max_pool2d(x, (7, 5), return_indices=True), (1, 2, 5, 3)),  # up
        (lambda x: F.adaptive_max_pool2d(x, 3) * 2, (2, 3, 10, 11)),
        (lambda x: F.adaptive_max_pool1d(x, 5, return_indices=True), (2, 3, 17)),
        (lambda x: F.adaptive_max_pool3d(x, (2, 3, 3), return_indices=True), (1, 2, 5, 7, 6)),
    ],
)
def test_adaptive_max_pool(fn, shape, rng):
    check_against_torch(fn, _floats(rng, *shape))


@pytest.mark.parametrize(
    "fn, op",
    [
        (lambda x: x + torch.randn_like(x) * 0.1, "randn_like"),
        (lambda x: torch.bernoulli(x), "rand"),  # exported as rand and a comparison
        (lambda x: x + torch.rand(3), "rand"),
        (lambda x: x * torch.empty_like(x).exponential_(), "exponential"),
    ],
)
def test_random_ops_are_refused(fn, op):
    with pytest.raises(tvmamp.frontends.common.UnsupportedOperatorError, match=f"random.*{op}"):
        tvmamp.from_torch(Lambda(fn), (torch.rand(2, 3),))
