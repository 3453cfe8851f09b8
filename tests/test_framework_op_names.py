"""Framework op lists paste unchanged: every name of Paddle's, MindSpore's and PyTorch's AMP lists
(as in REFERENCE.md) resolves case-insensitively to Relax ops, or is a framework op without a Relax
op and warns once."""

import warnings

import pytest

import tvmamp
from tvmamp import op_lists
from tvmamp.policy import (
    Category,
    Policy,
    UnmappedOpWarning,
    _lookup,
    _relax_name_index,
    resolve_op_names,
)

F16 = "float16"

FRAMEWORK_LISTS = {
    # Paddle, python/paddle/amp/amp_lists.py
    "paddle_fp16_white": (
        "conv2d einsum matmul matmul_v2 max_pool2d_with_index mul fused_gemm_epilogue "
        "fused_attention fused_feedforward"
    ),
    "paddle_fp16_black": (
        "tan acos asin sinh cosh atanh cos_sim erfinv exp expm1 log log10 log2 reciprocal rsqrt "
        "pow square reduce_sum mean reduce_mean reduce_prod cumprod cumsum dist pnorm "
        "frobenius_norm renorm group_norm layer_norm softmax softmin softplus log_softmax "
        "softmax_with_cross_entropy sigmoid_cross_entropy_with_logits cross_entropy "
        "cross_entropy2 nll_loss huber_loss"
    ),
    "paddle_extra_black": (
        "bilinear_interp_v2 nearest_interp_v2 trilinear_interp_v2 lookup_table lookup_table_v2 "
        "scatter"
    ),
    "paddle_bf16_white": "conv2d einsum matmul_v2",
    # MindSpore, mindspore/train/amp.py
    "mindspore_o1_white": (
        "Conv1d Conv2d Conv3d Conv1dTranspose Conv2dTranspose Conv3dTranspose Dense LSTMCell "
        "RNNCell GRUCell MatMul BatchMatMul PReLU ReLU Ger"
    ),
    "mindspore_o2_black": "BatchNorm1d BatchNorm2d BatchNorm3d LayerNorm",
    "mindspore_auto_white": (  # MatMulExt and BatchMatMulExt: newer MindSpore releases
        "Conv2D Conv3D Conv2DTranspose Conv3DTranspose Convolution MatMul BatchMatMul PReLU "
        "Einsum Dense Addmm MatMulExt BatchMatMulExt"
    ),
    "mindspore_auto_black": (
        "Pow ACos Asin Cosh Erfinv Exp Expm1 Log Log1p Reciprocal Rsqrt Sinh Tan Softplus "
        "LayerNorm BatchNorm GroupNorm KLDivLoss SmoothL1Loss MultilabelMarginLoss SoftMarginLoss "
        "TripletMarginLoss MultiMarginLoss BCEWithLogitsLoss Pdist Cdist Renorm ReduceProd "
        "Softmax LogSoftmax CumProd CumSum Prod Sum Norm"
    ),
    "mindspore_auto_promote": "Addcdiv Addcmul Cross Dot GridSampler2D GridSampler3D BiasAdd",
    # PyTorch autocast (CUDA), aten/src/ATen/autocast_mode.h
    "torch_lower_precision": (
        "matmul mm bmm addmm addbmm baddbmm addmv addr linear conv1d conv2d conv3d "
        "conv_transpose1d conv_transpose2d conv_transpose3d prelu einsum "
        "scaled_dot_product_attention GRUCell LSTMCell RNNCell"
    ),
    "torch_fp32": (
        "pow acos asin cosh erfinv exp expm1 log log10 log2 log1p reciprocal rsqrt sinh tan "
        "softplus softmax softmin log_softmax layer_norm group_norm norm cumsum cumprod prod sum "
        "cdist pdist dist renorm logsumexp cosine_similarity cross_entropy nll_loss mse_loss "
        "l1_loss kl_div nll_loss2d smooth_l1_loss huber_loss binary_cross_entropy_with_logits "
        "margin_ranking_loss hinge_embedding_loss cosine_embedding_loss poisson_nll_loss "
        "soft_margin_loss multilabel_margin_loss multi_margin_loss triplet_margin_loss "
        "frobenius_norm nuclear_norm"
    ),
    "torch_promote": (
        "addcdiv addcmul atan2 bilinear cross dot grid_sample index_put scatter_add tensordot"
    ),
}

CASES = [
    (list_name, name) for list_name, names in FRAMEWORK_LISTS.items() for name in names.split()
]
NO_RELAX_OP = {n.lower() for n in op_lists.NO_RELAX_OP}


def _variants(name):
    return sorted({name, name.lower(), name.upper(), name.swapcase()})


def _policy(**lists):
    """Build an O1 float16 policy; returns it and the UnmappedOpWarnings raised."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        policy = Policy.for_level("O1", F16, **lists)
    return policy, [w for w in caught if issubclass(w.category, UnmappedOpWarning)]


@pytest.mark.parametrize("list_name,name", CASES)
def test_every_framework_name_is_accepted_in_any_case(list_name, name):
    for variant in _variants(name):
        for which, category in (("white", Category.WHITE), ("black", Category.BLACK)):
            policy, warned = _policy(**{f"custom_{which}_list": [variant]})
            if name.lower() in NO_RELAX_OP:
                assert len(warned) == 1, f"{variant} ({list_name}): expected one warning"
                assert repr(variant) in str(warned[0].message)
                assert policy.categories == Policy.for_level("O1", F16).categories
            else:
                assert not warned, f"{variant} ({list_name}) warned: {warned[0].message}"
                ops = resolve_op_names([variant])
                assert ops, f"{variant} ({list_name}) resolved to nothing"
                assert all(policy.category(op) is category for op in ops), (variant, which)


@pytest.mark.parametrize(
    "name,expected",
    [
        ("Exp", {"relax.exp"}),
        ("EXP", {"relax.exp"}),
        ("Relax.Exp", {"relax.exp"}),
        ("LogSoftmax", {"relax.nn.log_softmax"}),
        ("nn.Softmax", {"relax.nn.softmax"}),
        ("Einsum", {"relax.einsum"}),
        ("MatMulExt", {"relax.matmul"}),
        ("BatchMatMulExt", {"relax.matmul"}),
        ("Convolution", {f"relax.nn.conv{d}d{t}" for d in (1, 2, 3) for t in ("", "_transpose")}),
        ("Ger", {"relax.outer"}),
        ("Log1p", {"relax.log"}),
        ("Expm1", {"relax.exp"}),
        ("GridSampler2D", {"relax.image.grid_sample"}),
        ("grid_sample", {"relax.image.grid_sample"}),
        ("scatter_add", {"relax.scatter_elements"}),
        ("fused_attention", {"relax.nn.attention"}),
    ],
)
def test_names_resolve_to_their_relax_op(name, expected):
    assert resolve_op_names([name]) == expected


def test_a_name_without_relax_op_warns_once_per_call_and_names_it():
    with pytest.warns(UnmappedOpWarning) as caught:
        ops = resolve_op_names(["LSTMCell", "lstmcell", "Exp", "LSTMCELL", "KLDivLoss"], "lists")
    assert ops == {"relax.exp"}
    messages = [str(w.message) for w in caught]
    assert len(messages) == 2
    assert "'LSTMCell'" in messages[0] and "no Relax op" in messages[0]
    assert messages[0].startswith("lists: ")
    assert "'KLDivLoss'" in messages[1]


@pytest.mark.parametrize(
    "typo,close",
    [("Sofmax", "softmax"), ("LSTMCel", "lstmcell"), ("Expp", "exp"), ("KLDivLos", "kldivloss")],
)
def test_a_name_of_no_framework_raises_with_close_matches(typo, close):
    with pytest.raises(ValueError, match=rf"custom_black_list: unknown op name '{typo}'.*{close}"):
        Policy.for_level("O1", F16, custom_black_list=[typo])


def test_a_nonsense_name_raises_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValueError, match="unknown op name 'qqqqqqqq'"):
            resolve_op_names(["qqqqqqqq"])


def test_a_string_instead_of_a_list_is_refused():
    with pytest.raises(TypeError, match="expected a list of op names, got the string 'Exp'"):
        Policy.for_level("O1", F16, custom_black_list="Exp")


def test_the_same_op_in_both_lists_in_two_spellings_is_refused():
    with pytest.raises(ValueError, match="relax.exp is in both"):
        Policy.for_level("O1", F16, custom_white_list=["Exp"], custom_black_list=["exp"])


@pytest.mark.parametrize("list_name", sorted(FRAMEWORK_LISTS))
def test_whole_lists_paste_and_get_lists_agree(list_name):
    names = FRAMEWORK_LISTS[list_name].split()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnmappedOpWarning)
        ops = resolve_op_names(names)
        white = tvmamp.get_white_list("O1", F16, custom_white_list=names)
        black = tvmamp.get_black_list("O1", F16, custom_black_list=names)
        other_black = tvmamp.get_black_list("O1", F16, custom_white_list=names)
        other_white = tvmamp.get_white_list("O1", F16, custom_black_list=names)
    assert ops <= set(white) and ops <= set(black)
    assert not ops & set(other_black) and not ops & set(other_white)


def test_no_relax_op_names_are_not_relax_ops_or_aliases():
    assert len(NO_RELAX_OP) == len(op_lists.NO_RELAX_OP), "NO_RELAX_OP repeats a name"
    index = _relax_name_index()
    for name in op_lists.NO_RELAX_OP:
        assert _lookup(name, index) is None, f"{name} has a Relax op: take it out of NO_RELAX_OP"
