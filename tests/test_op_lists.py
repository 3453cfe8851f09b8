"""The default op lists cover every Relax op, once, and agree with TVM and the anchors."""

import pytest
import tvm

from tvmamp import op_lists
from tvmamp.policy import DEFAULT_CATEGORIES, Category

LISTS = {
    "WHITE": op_lists.WHITE,
    "BLACK": op_lists.BLACK,
    "PROMOTE": op_lists.PROMOTE,
    "FOLLOW": op_lists.FOLLOW,
    "FIXED": op_lists.FIXED,
}


def _registry():
    return {n for n in tvm.ir.Op.list_op_names() if n.startswith("relax.")}


def test_every_registered_op_is_in_exactly_one_list():
    registry = _registry()
    for name in sorted(registry):
        homes = [list_name for list_name, ops in LISTS.items() if name in ops]
        assert len(homes) == 1, f"{name} is in {homes or 'no list'}"


def test_lists_name_only_registered_ops_without_duplicates():
    registry = _registry()
    for list_name, ops in LISTS.items():
        assert len(ops) == len(set(ops)), f"duplicates in {list_name}"
        assert set(ops) <= registry, f"{list_name} names unknown ops {set(ops) - registry}"


def test_tvm_always_ops_are_white():
    for name in _registry():
        if tvm.ir.Op.get(name).get_attr("TMixedPrecisionPolicy") == 0:
            assert DEFAULT_CATEGORIES[name] is Category.WHITE, name


def test_tvm_follow_ops_only_leave_follow_for_a_listed_reason():
    corrected = set(op_lists.BLACK) | set(op_lists.PROMOTE) | set(op_lists.FIXED)
    for name in _registry():
        if tvm.ir.Op.get(name).get_attr("TMixedPrecisionPolicy") == 1:
            assert name in op_lists.FOLLOW or name in corrected, name


@pytest.mark.parametrize(
    "name",
    [
        "relax.nn.softmax",
        "relax.exp",
        "relax.log",
        "relax.sum",
        "relax.mean",
        "relax.nn.layer_norm",
        "relax.nn.batch_norm",
        "relax.nn.cross_entropy_with_logits",
        "relax.nn.nll_loss",
        "relax.nn.log_softmax",
        "relax.power",
        "relax.cumsum",
        "relax.median",
    ],
)
def test_anchor_black_list_ops_stay_fp32(name):
    assert DEFAULT_CATEGORIES[name] is Category.BLACK


@pytest.mark.parametrize("name", ["relax.matmul", "relax.nn.conv2d", "relax.einsum"])
def test_anchor_white_list_ops_run_low(name):
    assert DEFAULT_CATEGORIES[name] is Category.WHITE


def test_aliases_point_at_registered_ops():
    registry = _registry()
    for alias, targets in op_lists.OP_ALIASES.items():
        assert alias == alias.lower(), alias
        assert set(targets) <= registry, alias


def test_sorts_and_argmax_run_in_fp32_and_match_torch_at_o2():
    """TVM's bf16 sort kernels returned torch.sort's 8 values unsorted, and its bf16 argmax
    failed to compile: these ops are black-listed, so at O2 they see fp32 values."""
    torch = pytest.importorskip("torch")
    import numpy as np

    import tvmamp

    class SortAndPick(torch.nn.Module):
        def forward(self, x):
            y = torch.relu(x) * 3  # a low-precision op in front, as in a model
            top = torch.topk(y, 3, dim=-1).values.sum(-1)
            return torch.sort(y, -1, descending=True).values[:, 0] + top + torch.argmax(y, -1)

    x = np.random.default_rng(0).standard_normal((16, 9)).astype("float32")
    mod, params = tvmamp.from_torch(SortAndPick().eval(), (x,))
    out = tvmamp.build(mod, "O2", "llvm", params=params)(x)
    with torch.no_grad():
        ref = SortAndPick()(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(out, ref, rtol=2e-2, atol=2e-2)
    for name in ("relax.sort", "relax.argsort", "relax.topk", "relax.argmax", "relax.argmin"):
        assert DEFAULT_CATEGORIES[name] is Category.BLACK, name


def test_ops_without_bf16_lowering_stay_fp32_at_o3_bf16_only():
    """NO_BFLOAT16 names registered ops; bf16 keeps them fp32 even at O3, fp16 does not."""
    from tvmamp.policy import Policy

    assert len(op_lists.NO_BFLOAT16) == len(set(op_lists.NO_BFLOAT16))
    assert set(op_lists.NO_BFLOAT16) <= _registry()
    bf16 = Policy.for_level("O3", "bfloat16")
    fp16 = Policy.for_level("O3", "float16")
    for name in op_lists.NO_BFLOAT16:
        assert bf16.compute_dtype(name, ["bfloat16"]) == "float32", name
        assert fp16.compute_dtype(name, ["float16"]) == "float16", name
    for name in ("relax.isnan", "relax.mod", "relax.slice_scatter", "relax.median"):
        assert name in op_lists.NO_BFLOAT16, name
