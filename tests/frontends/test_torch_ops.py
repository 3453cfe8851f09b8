"""tvmamp.from_torch: ATen ops TVM's importer lacked (scatter reductions, embedding_bag,
prod over a dim, kthvalue, hypot) or rejected (scatter with a src larger than its index),
against eager torch at O0 and O2."""

import numpy as np
import pytest

import tvmamp
from tvmamp.frontends import UnsupportedOperatorError

torch = pytest.importorskip("torch")
nn = torch.nn
from torch_modules import Lambda, check_against_torch  # noqa: E402


def _floats(rng, *shape):
    return rng.standard_normal(shape).astype("float32")


def _index(*rows):
    return torch.tensor(rows)


@pytest.mark.parametrize(
    "fn, shapes",
    [
        (lambda x, s: x.scatter(1, _index([0, 2], [1, 3]), s), [(2, 5), (3, 4)]),  # src > index
        (lambda x, s: x.scatter_add(0, _index([0, 1, 1], [1, 0, 1]), s), [(2, 3), (3, 4)]),
        (
            lambda x, s: x.scatter_add(1, _index([0, 2, 2], [1, 1, 5], [4, 0, 0]), s),
            [(3, 6), (3, 3)],
        ),
        (
            lambda x, s: x.scatter_reduce(1, _index([0, 0, 2], [1, 1, 1]), s, "amax"),
            [(2, 4), (2, 3)],
        ),
        (
            lambda x, s: x.scatter_reduce(1, _index([0, 0, 2], [3, 1, 1]), s, "amin"),
            [(2, 4), (2, 3)],
        ),
        (lambda x, s: x.scatter_reduce(0, _index([0, 1], [0, 0]), s, "sum"), [(2, 2), (2, 2)]),
        (lambda x, s: x.scatter_reduce(0, _index([0, 1], [0, 0]), s, "prod"), [(2, 2), (2, 2)]),
        (lambda a, b: torch.hypot(a, b), [(3, 4), (3, 4)]),
        (lambda x: torch.kthvalue(x, 3, 1), [(4, 11)]),
        (lambda x: torch.kthvalue(x, 2, 0, keepdim=True)[0], [(5, 3)]),
    ],
)
def test_ops(fn, shapes, rng):
    check_against_torch(fn, *[_floats(rng, *s) for s in shapes])


def test_prod_over_a_dim(rng):
    x = (rng.random((4, 6)) + 0.5).astype("float32")
    check_against_torch(lambda x: torch.prod(x, 1, keepdim=True) + torch.prod(x, 0), x)


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("padding_idx", [None, 0])
def test_embedding_bag_with_offsets(mode, padding_idx):
    """Bags of 2, 0 (empty), 3 and 2 entries; index 0 repeats (and is padding when asked)."""
    torch.manual_seed(0)
    bag = nn.EmbeddingBag(11, 6, mode=mode, padding_idx=padding_idx)
    indices = np.array([1, 0, 10, 3, 0, 7, 2], np.int64)
    offsets = np.array([0, 2, 2, 5], np.int64)
    check_against_torch(bag, indices, offsets)


def test_embedding_bag_of_fixed_size_bags_with_last_offset_and_weights(rng):
    torch.manual_seed(0)
    mean = nn.EmbeddingBag(11, 6, mode="mean", include_last_offset=True)
    check_against_torch(mean, np.array([1, 4, 3, 3, 7], np.int64), np.array([0, 2, 2, 5]))
    weighted = nn.EmbeddingBag(11, 6, mode="sum")
    indices = np.array([[1, 4, 10], [0, 0, 3]], np.int64)
    weights = rng.random((2, 3)).astype("float32")
    check_against_torch(lambda i, w: weighted(i, per_sample_weights=w), indices, weights)


@pytest.mark.parametrize(
    "fn, message",
    [
        (lambda x, s: x.scatter_reduce(1, _index([0, 0]), s, "mean"), "reduce='mean'"),
        (
            lambda x, s: x.scatter_reduce(1, _index([0, 0]), s, "sum", include_self=False),
            "include_self=False",
        ),
    ],
)
def test_unsupported_scatter_reductions_are_refused(fn, message):
    x = (torch.randn(1, 3), torch.randn(1, 2))
    with pytest.raises(UnsupportedOperatorError, match=message):
        tvmamp.from_torch(Lambda(fn), x)


@pytest.mark.parametrize(
    "fn, shapes",
    [
        (lambda a, b: a @ b, [(5, 7), (7, 3)]),
        (lambda a, b: torch.bmm(a, b), [(2, 5, 7), (2, 7, 3)]),
        (lambda a, b: torch.addmm(a[0, :3], a, b, beta=2, alpha=3), [(5, 7), (7, 3)]),
    ],
)
def test_integer_products_stay_integer(fn, shapes, rng):
    """TVM's importer gave every product a float32 result: exact only below 2**24."""
    xs = [rng.integers(-(2**20), 2**20, s) for s in shapes]
    check_against_torch(fn, *xs)


def test_float64_model_stays_float64_and_o2_warns(rng):
    """AMP converts float32 computations only: at O2 a float64 model's ops are named."""
    x = rng.standard_normal((5, 7))  # float64
    w = rng.standard_normal((7, 3))
    check_against_torch(lambda x, w: torch.softmax(x @ w, -1), x, w, levels=("O0",))
    mod, params = tvmamp.from_torch(
        Lambda(lambda x, w: x @ w), (torch.from_numpy(x), torch.from_numpy(w))
    )
    with pytest.warns(UserWarning, match="compute in float64"):
        tvmamp.convert(mod, "O2", "llvm", params=params)


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: torch.var_mean(x, 1),
        lambda x: torch.var_mean(x, (0, 2), correction=0, keepdim=True),
        lambda x: torch.std_mean(x, -1),
    ],
)
def test_var_mean(fn, rng):
    check_against_torch(fn, _floats(rng, 4, 9, 5) * 3 + 10)


@pytest.mark.parametrize("descending", [False, True])
def test_stable_sort_keeps_equal_elements_in_order(descending, rng):
    x = rng.integers(0, 3, (3, 17)).astype("float32")  # many ties
    check_against_torch(lambda x: torch.sort(x, stable=True, descending=descending), x)


@pytest.mark.parametrize("right", [False, True])
def test_searchsorted_over_a_sorted_sequence(right, rng):
    edges = np.sort(rng.standard_normal(9)).astype("float32")
    x = np.concatenate([_floats(rng, 3, 4), edges[[1, 5, 7, 2]].reshape(1, 4)])  # exact hits
    check_against_torch(lambda e, v: torch.searchsorted(e, v, right=right), edges, x)


def test_pairwise_interactions_over_triangle_indices(rng):
    """DLRM's interaction layer: the strict upper (or lower) triangle of ``x @ x^T``."""

    def interact(x):
        z = torch.bmm(x, x.transpose(1, 2))
        li, lj = torch.tril_indices(5, 5, offset=-1)
        ui, uj = torch.triu_indices(5, 6, 1)
        return z[:, li, lj], (z[:, :, :1].expand(3, 5, 6) * 0 + 1)[:, ui, uj]

    check_against_torch(interact, _floats(rng, 3, 5, 8))


@pytest.mark.parametrize(
    "mask_shape",
    [(2, 5, 4), (2, 5, 1)],  # elementwise; whole rows, as a multimodal model
)
def test_masked_scatter_takes_the_source_in_order(mask_shape, rng):
    x, source = _floats(rng, 2, 5, 4), _floats(rng, 60)
    mask = rng.random(mask_shape) > 0.5
    mask.flat[0] = False  # unmasked leading positions take nothing
    check_against_torch(lambda x, m, s: x.masked_scatter(m, s), x, mask, source)


@pytest.mark.parametrize("p", [2.0, 1.0, 3.0, float("inf"), 0.0])
def test_cdist(p, rng):
    a, b = _floats(rng, 2, 6, 3), _floats(rng, 2, 5, 3)
    b[0, 0] = a[0, 0]  # a zero distance (p = 0 counts differing coordinates)
    check_against_torch(lambda a, b: torch.cdist(a, b, p=p), a, b)


@pytest.mark.parametrize(
    "fn, shape",
    [
        (lambda x: x.unfold(1, 4, 2), (2, 11)),  # frames of 4, hop 2; the last sample unused
        (lambda x: x.unfold(0, 3, 3) * 2, (7, 2, 3)),  # a leading dim
        (lambda x: x.unfold(-1, 5, 1), (2, 3, 8)),
        (lambda x: torch.exp2(x), (3, 4)),
    ],
)
def test_unfold_and_exp2(fn, shape, rng):
    check_against_torch(fn, _floats(rng, *shape))


@pytest.mark.parametrize("fn", [torch.fmax, torch.fmin])
def test_fmax_and_fmin_ignore_nan(fn, rng):
    a, b = _floats(rng, 3, 4), _floats(rng, 3, 4)
    a[0, 0], b[1, 1], a[2, 2], b[2, 2] = np.nan, np.nan, np.nan, np.nan  # NaN on one side, both
    check_against_torch(fn, a, b, levels=("O0",))
