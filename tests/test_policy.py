"""Policy: level semantics (table-driven), list edits, aliases, per-node rules and bad input."""

import pytest

import tvmamp
from tvmamp.policy import Category, Policy, resolve_op_names

F32, F16, BF16 = "float32", "float16", "bfloat16"

# (level, op, nominal input dtypes) -> compute dtype (None: unchanged)
SEMANTICS = [
    # O1: white low, black fp32, others low only when all their float inputs are low
    ("O1", "relax.matmul", [F32, F32], F16),
    ("O1", "relax.nn.softmax", [F16], F32),
    ("O1", "relax.nn.relu", [F16], F16),
    ("O1", "relax.nn.relu", [F32], F32),
    ("O1", "relax.add", [F16, F32], F32),
    ("O1", "relax.atan2", [F16, F16], F16),
    # O2: everything low except black
    ("O2", "relax.nn.relu", [F32], F16),
    ("O2", "relax.add", [F16, F32], F16),
    ("O2", "relax.nn.layer_norm", [F16, F32, F32], F32),
    ("O2", "relax.atan2", [F16, F32], F32),  # promote: widest input
    # O3: everything low
    ("O3", "relax.nn.softmax", [F32], F16),
    ("O3", "relax.exp", [F32], F16),
    # OD: only white low
    ("OD", "relax.matmul", [F32, F32], F16),
    ("OD", "relax.nn.relu", [F16], F32),
    ("OD", "relax.add", [F16, F16], F32),
    # auto: white low, black fp32, promote widest, others keep their input dtype
    ("auto", "relax.matmul", [F32, F32], F16),
    ("auto", "relax.exp", [F16], F32),
    ("auto", "relax.nn.relu", [F16], F16),
    ("auto", "relax.nn.relu", [F32], F32),
    ("auto", "relax.ewise_fma", [F16, F16, F32], F32),
    # O0 and fixed ops never change
    ("O0", "relax.matmul", [F32, F32], None),
    ("O2", "relax.call_tir", [F32], None),
    ("O3", "relax.shape_of", [F32], None),
    ("O2", "relax.zeros", [], None),
]


@pytest.mark.parametrize("level,op,inputs,expected", SEMANTICS)
def test_level_semantics(level, op, inputs, expected):
    assert Policy.for_level(level, F16).compute_dtype(op, inputs) == expected


def test_bf16_policy_uses_bf16():
    assert Policy.for_level("O2", BF16).compute_dtype("relax.nn.relu", [F32]) == BF16


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_ops_without_bf16_kernels_stay_fp32(level):
    """TVM lowers layer_norm only in fp32/fp16: in bf16 it is fp32 even at O3."""
    assert Policy.for_level(level, BF16).compute_dtype("relax.nn.layer_norm", [BF16]) == F32
    assert Policy.for_level(level, F16).compute_dtype("relax.nn.layer_norm", [F16]) in (F16, F32)
    assert Policy.for_level("O3", F16).compute_dtype("relax.nn.layer_norm", [F32]) == F16


def test_target_unsupported_ops_stay_fp32_at_o3_and_refuse_white_list():
    policy = Policy.for_level("O3", F16, unsupported_low_ops=["relax.exp"])
    assert policy.compute_dtype("relax.exp", [F16]) == F32
    with pytest.raises(ValueError, match="relax.exp cannot run in float16"):
        Policy.for_level("O1", F16, custom_white_list=["exp"], unsupported_low_ops=["relax.exp"])


@pytest.mark.parametrize(
    "alias,relax_name",
    [
        ("conv2d", "relax.nn.conv2d"),  # Paddle
        ("matmul_v2", "relax.matmul"),
        ("elementwise_add", "relax.add"),
        ("softmax", "relax.nn.softmax"),
        ("Conv2D", "relax.nn.conv2d"),  # MindSpore
        ("MatMul", "relax.matmul"),
        ("Dense", "relax.matmul"),
        ("LayerNorm", "relax.nn.layer_norm"),
        ("BatchNorm2d", "relax.nn.batch_norm"),
        ("linear", "relax.matmul"),  # PyTorch
        ("mm", "relax.matmul"),
        ("bmm", "relax.matmul"),
        ("layer_norm", "relax.nn.layer_norm"),
        ("relax.nn.softmax", "relax.nn.softmax"),  # Relax names
        ("exp", "relax.exp"),
    ],
)
def test_aliases_resolve(alias, relax_name):
    assert relax_name in resolve_op_names([alias])


def test_custom_lists_move_ops():
    policy = Policy.for_level("O1", F16, custom_white_list=["softmax"], custom_black_list=["mm"])
    assert policy.category("relax.nn.softmax") is Category.WHITE
    assert policy.category("relax.matmul") is Category.BLACK
    assert policy.compute_dtype("relax.matmul", [F16, F16]) == F32


def test_unknown_op_name_lists_close_matches():
    with pytest.raises(ValueError, match=r"unknown op name 'sofmax'.*softmax"):
        Policy.for_level("O1", F16, custom_black_list=["sofmax"])


def test_op_in_both_lists_is_refused():
    with pytest.raises(ValueError, match="both custom_white_list and custom_black_list"):
        Policy.for_level("O1", F16, custom_white_list=["matmul"], custom_black_list=["linear"])


def test_fixed_op_cannot_be_listed():
    with pytest.raises(ValueError, match="fixed dtype"):
        Policy.for_level("O1", F16, custom_white_list=["relax.shape_of"])


@pytest.mark.parametrize("level", ["O4", "o1", "", "fast"])
def test_bad_level_lists_choices(level):
    with pytest.raises(ValueError, match="is not one of O0, O1, O2, O3, OD, auto"):
        Policy.for_level(level, F16)


@pytest.mark.parametrize("dtype", ["float8", "fp16", "float32", "int8"])
def test_bad_dtype_lists_choices(dtype):
    with pytest.raises(ValueError, match="is not one of float16, bfloat16"):
        Policy.for_level("O1", dtype)


def test_node_patterns():
    policy = Policy.for_level("O2", F16, custom_fp32_nodes=["head*"], custom_low_nodes=["ln*"])
    assert policy.node_override(["head_out"]) == F32
    assert policy.node_override(["x", "ln1.weight"]) == F16
    assert policy.node_override(["body"]) is None
    with pytest.raises(TypeError, match="list of glob patterns"):
        Policy.for_level("O2", F16, custom_fp32_nodes="head*")


def test_effective_lists():
    white = tvmamp.get_white_list("O1", "float16")
    black = tvmamp.get_black_list("O1", "float16")
    assert "relax.matmul" in white and "relax.nn.softmax" in black
    assert not set(white) & set(black)
    assert tvmamp.get_white_list("O0", "float16") == ()
    assert tvmamp.get_black_list("O3", "float16") == ()
    assert "relax.nn.relu" in tvmamp.get_black_list("OD", "float16")
    assert "relax.nn.softmax" in tvmamp.get_white_list(
        "O1", "float16", custom_white_list=["softmax"]
    )
