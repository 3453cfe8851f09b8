"""Folding ONNX shape arithmetic before TVM's import: torch exports that now import; the pass."""

import io
import warnings

import numpy as np
import pytest

import tvmamp
from tvmamp.frontends import from_onnx

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from tvmamp.frontends.onnx_fold import fold_shape_constants  # noqa: E402

TARGET = "llvm -num-cores=1"


def _model(nodes, inputs, outputs, initializers=(), opset=17):
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    onnx.checker.check_model(model)
    return model


def _float(name, shape):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


def _int(name, shape):
    return helper.make_tensor_value_info(name, TensorProto.INT64, shape)


def _const(name, value):
    value = np.asarray(value)
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(value, name))


def _ops(model):
    return [n.op_type for n in model.graph.node]


def _constant_value(model, name):
    node = next(n for n in model.graph.node if name in n.output)
    assert node.op_type == "Constant"
    return numpy_helper.to_array(node.attribute[0].t)


# ---- the pass on hand-built graphs -------------------------------------------------------


def test_static_shape_chain_folds_and_the_caller_model_is_unchanged():
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        _const("i", np.array(2, dtype=np.int64)),
        helper.make_node("Gather", ["s", "i"], ["d"], axis=0),
        _const("two", np.array(2, dtype=np.int64)),
        helper.make_node("Div", ["d", "two"], ["h"]),
        _const("zero", np.array([0], dtype=np.int64)),
        helper.make_node("Unsqueeze", ["h", "zero"], ["h1"]),
        _const("axis", np.array([2], dtype=np.int64)),
        helper.make_node("Slice", ["x", "zero", "h1", "axis"], ["y"]),
    ]
    model = _model(nodes, [_float("x", [2, 3, 8])], [_float("y", [2, 3, None])])
    snapshot = model.SerializeToString()
    folded = fold_shape_constants(model, {})
    assert model.SerializeToString() == snapshot
    assert folded is not model
    assert _ops(folded) == ["Constant", "Constant", "Constant", "Slice"]
    np.testing.assert_array_equal(_constant_value(folded, "h1"), [4])
    # the user's shape_dict is applied before inference
    again = fold_shape_constants(model, {"x": [2, 3, 6]})
    np.testing.assert_array_equal(_constant_value(again, "h1"), [3])


def test_shape_start_end_size_and_graph_outputs_are_kept():
    nodes = [
        helper.make_node("Shape", ["x"], ["s"], start=1, end=-1),
        helper.make_node("Size", ["x"], ["n"]),
        helper.make_node("Relu", ["x"], ["y"]),
    ]
    outputs = [_int("s", [1]), _int("n", []), _float("y", [2, 3, 4])]
    folded = fold_shape_constants(_model(nodes, [_float("x", [2, 3, 4])], outputs), {})
    assert [o.name for o in folded.graph.output] == ["s", "n", "y"]
    np.testing.assert_array_equal(_constant_value(folded, "s"), [3])
    assert _constant_value(folded, "n") == 24
    assert _constant_value(folded, "n").dtype == np.int64


def test_symbolic_dim_keeps_its_shape_and_folds_static_picks():
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        _const("i0", np.array(0, dtype=np.int64)),
        _const("i2", np.array(-1, dtype=np.int64)),
        helper.make_node("Gather", ["s", "i0"], ["batch"], axis=0),
        helper.make_node("Gather", ["s", "i2"], ["last"], axis=0),
        _const("one", np.array([1], dtype=np.int64)),
        _const("end", np.array([3], dtype=np.int64)),
        helper.make_node("Slice", ["s", "one", "end"], ["tail"]),
    ]
    outputs = [_int("batch", []), _int("last", []), _int("tail", [2])]
    model = _model(nodes, [_float("x", ["N", 3, 5])], outputs)
    folded = fold_shape_constants(model, {})
    assert "Shape" in _ops(folded)  # the batch is still read at run time
    batch = next(n for n in folded.graph.node if "batch" in n.output)
    assert batch.op_type == "Gather"
    assert _constant_value(folded, "last") == 5
    np.testing.assert_array_equal(_constant_value(folded, "tail"), [3, 5])
    # with the batch given, all of it folds
    static = fold_shape_constants(model, {"x": [4, 3, 5]})
    assert set(_ops(static)) == {"Constant"}
    assert _constant_value(static, "batch") == 4


def test_folded_scalars_keep_their_rank(rng):
    # A folded scalar was written as a [1] constant (numpy's ascontiguousarray makes 0-d arrays
    # 1-d): timm's CoaT-Lite then unsqueezed a product of two dims to [1, 1], and TVM failed to
    # concatenate it into a reshape's shape. A scalar output read [1] where onnxruntime has [].
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        _const("i1", np.array(1, dtype=np.int64)),
        _const("i2", np.array(2, dtype=np.int64)),
        helper.make_node("Gather", ["s", "i1"], ["rows"], axis=0),
        helper.make_node("Gather", ["s", "i2"], ["cols"], axis=0),
        helper.make_node("Mul", ["rows", "cols"], ["n"]),
        helper.make_node("Cast", ["n"], ["nf"], to=TensorProto.FLOAT),
        helper.make_node("ReduceSum", ["x"], ["total"], keepdims=0),
        helper.make_node("Div", ["total", "nf"], ["y"]),
    ]
    outputs = [_int("n", []), _float("y", [])]
    model = _model(nodes, [_float("x", ["N", 3, 5])], outputs)
    folded = fold_shape_constants(model, {})
    assert _constant_value(folded, "n").shape == ()
    mod, params = from_onnx(model)
    exe = tvmamp.build(mod, "O0", TARGET, params=params)
    x = rng.standard_normal((2, 3, 5)).astype("float32")
    n, y = (np.asarray(v) for v in exe(x))
    assert n.shape == () and y.shape == ()
    assert int(n) == 15
    np.testing.assert_allclose(y, x.sum() / 15, rtol=1e-5)


def test_no_foldable_node_returns_the_same_model():
    nodes = [helper.make_node("Relu", ["x"], ["y"])]
    model = _model(nodes, [_float("x", [2, 3])], [_float("y", [2, 3])])
    assert fold_shape_constants(model, {}) is model


def test_big_initializer_computation_is_not_folded(rng):
    w = rng.standard_normal((256, 256)).astype("float32")
    nodes = [
        helper.make_node("Transpose", ["w"], ["wt"], perm=[1, 0]),
        helper.make_node("MatMul", ["x", "wt"], ["y"]),
    ]
    init = [numpy_helper.from_array(w, "w")]
    model = _model(nodes, [_float("x", [2, 256])], [_float("y", [2, 256])], init)
    assert fold_shape_constants(model, {}) is model
    mod, params = from_onnx(model)
    assert [p.shape for p in params.values()] == [(256, 256)]
    x = rng.standard_normal((2, 256)).astype("float32")
    out = tvmamp.build(mod, "O0", TARGET, params=params)(x)
    np.testing.assert_allclose(out, x @ w.T, rtol=1e-4, atol=1e-4)


def test_small_initializer_computation_folds_and_drops_what_only_fed_it(rng):
    w = rng.standard_normal((4, 4)).astype("float32")
    nodes = [
        helper.make_node("Transpose", ["w"], ["wt"], perm=[1, 0]),
        helper.make_node("MatMul", ["x", "wt"], ["y"]),
    ]
    init = [numpy_helper.from_array(w, "w"), numpy_helper.from_array(w, "unused")]
    model = _model(nodes, [_float("x", [2, 4])], [_float("y", [2, 4])], init)
    folded = fold_shape_constants(model, {})
    assert _ops(folded) == ["Constant", "MatMul"]
    np.testing.assert_array_equal(_constant_value(folded, "wt"), w.T)
    assert [t.name for t in folded.graph.initializer] == ["unused"]  # only "w" became unread


def test_shapes_known_after_a_first_fold_fold_in_a_second_round():
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        _const("i", np.array(1, dtype=np.int64)),
        helper.make_node("Gather", ["s", "i"], ["d"]),
        _const("three", np.array(3, dtype=np.int64)),
        helper.make_node("Mod", ["d", "three"], ["h"]),  # ONNX's inference does not propagate it
        _const("axis", np.array([0], dtype=np.int64)),
        helper.make_node("Unsqueeze", ["h", "axis"], ["h1"]),
        _const("pre", np.array([2], dtype=np.int64)),
        _const("post", np.array([-1], dtype=np.int64)),
        helper.make_node("Concat", ["pre", "h1", "post"], ["target"], axis=0),
        helper.make_node("Reshape", ["x", "target"], ["r"]),
        helper.make_node("Shape", ["r"], ["rs"]),
        helper.make_node("Reshape", ["x", "rs"], ["y"]),
    ]
    model = _model(nodes, [_float("x", [2, 8])], [_float("y", [2, 2, 4])])
    folded = fold_shape_constants(model, {})
    assert _ops(folded) == ["Constant", "Reshape"]
    np.testing.assert_array_equal(_constant_value(folded, "rs"), [2, 2, 4])


def test_ops_that_must_not_fold_are_left():
    then = helper.make_graph(
        [_const("t", np.array([1.0], dtype=np.float32))], "then", [], [_float("t", [1])]
    )
    other = helper.make_graph(
        [_const("e", np.array([2.0], dtype=np.float32))], "else", [], [_float("e", [1])]
    )
    nodes = [
        _const("c", np.array(True)),
        helper.make_node("If", ["c"], ["r"], then_branch=then, else_branch=other),
        helper.make_node("RandomNormal", [], ["n"], shape=[1]),
        _const("shape", np.array([100_000], dtype=np.int64)),
        helper.make_node("ConstantOfShape", ["shape"], ["big"]),
        helper.make_node("ReduceSum", ["big"], ["total"]),
        helper.make_node("Add", ["r", "n"], ["rn"]),
        helper.make_node("Add", ["rn", "total"], ["y"]),
    ]
    model = _model(nodes, [], [_float("y", [1])])
    assert fold_shape_constants(model, {}) is model


def test_values_feeding_a_subgraph_fold_and_stay_defined():
    then = helper.make_graph(
        [helper.make_node("Identity", ["k"], ["t"])], "then", [], [_int("t", [1])]
    )
    other = helper.make_graph([helper.make_node("Neg", ["k"], ["e"])], "else", [], [_int("e", [1])])
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        _const("i", np.array([1], dtype=np.int64)),
        helper.make_node("Gather", ["s", "i"], ["k"], axis=0),
        helper.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other),
    ]
    inputs = [_float("x", [2, 7]), helper.make_tensor_value_info("c", TensorProto.BOOL, [])]
    folded = fold_shape_constants(_model(nodes, inputs, [_int("y", [1])]), {})
    onnx.checker.check_model(folded)
    assert _ops(folded) == ["Constant", "If"]
    np.testing.assert_array_equal(_constant_value(folded, "k"), [7])


# ---- torch exports ------------------------------------------------------------------------

torch = pytest.importorskip("torch")


def _export(module, x, dynamic_batch=False):
    buffer = io.BytesIO()
    axes = {"x": {0: "batch"}} if dynamic_batch else None
    with warnings.catch_warnings():  # torch warns about its legacy exporter
        warnings.simplefilter("ignore")
        torch.onnx.export(
            module.eval(), (x,), buffer, dynamo=False, opset_version=17, input_names=["x"],
            dynamic_axes=axes,
        )  # fmt: skip
    return onnx.load_from_string(buffer.getvalue())


class _ChunkEinsum(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(32, 64)

    def forward(self, x):
        k, v = self.linear(x).chunk(2, dim=-1)
        return torch.einsum("bkd,bke->bde", k, v)


def test_chunk_then_einsum_matches_torch():
    torch.manual_seed(0)
    module = _ChunkEinsum()
    x = torch.randn(2, 30, 32)
    model = _export(module, x)
    snapshot = model.SerializeToString()
    mod, params = from_onnx(model)
    assert model.SerializeToString() == snapshot
    with torch.no_grad():
        want = module(x).numpy()
    scale = np.abs(want).max()
    for level, tol in (("O0", 1e-5), ("O2", 2e-2)):
        got = tvmamp.build(mod, level, TARGET, params=params)(x.numpy())
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol * scale)


class _TopTwo(torch.nn.Module):
    def forward(self, x):
        return torch.argsort(x, dim=-1)[:, :2], torch.topk(x, x.shape[-1] // 2, dim=-1)[0]


def test_argsort_slice_and_topk_with_computed_k_match_torch(rng):
    module = _TopTwo()
    model = _export(module, torch.zeros(3, 6), dynamic_batch=True)  # torch leaves k computed
    assert _ops(model).count("Shape") == 2
    mod, params = from_onnx(model)  # k reads the static last dim of a dynamic-batch shape
    exe = tvmamp.build(mod, "O0", TARGET, params=params)
    for batch in (1, 3):
        x = torch.from_numpy(rng.standard_normal((batch, 6)).astype("float32"))
        indices, values = exe(x.numpy())
        want_indices, want_values = module(x)
        np.testing.assert_array_equal(indices, want_indices.numpy())
        np.testing.assert_allclose(values, want_values.numpy(), rtol=1e-6)


class _ReshapeByShape(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x):
        batch = x.shape[0]
        k, v = self.linear(x).chunk(2, dim=-1)
        return (k * v).reshape(batch, -1, 2, 2).sum(-1).reshape(batch, -1)


def test_symbolic_batch_reshape_from_shape_runs_two_batch_sizes(rng):
    torch.manual_seed(0)
    module = _ReshapeByShape()
    model = _export(module, torch.randn(2, 5, 8), dynamic_batch=True)
    mod, params = from_onnx(model)
    exe = tvmamp.build(mod, "O0", TARGET, params=params)
    for batch in (1, 3):
        x = rng.standard_normal((batch, 5, 8)).astype("float32")
        with torch.no_grad():
            want = module(torch.from_numpy(x)).numpy()
        np.testing.assert_allclose(exe(x), want, rtol=1e-5, atol=1e-5)


class _SamePadConvs(torch.nn.Module):
    """Five strided convs padded "same" at run time, as timm's TensorFlow ports do
    (``pad_same``): each pad is computed from the size its input came out of the last one."""

    def __init__(self):
        super().__init__()
        self.convs = torch.nn.ModuleList(torch.nn.Conv2d(4, 4, 3, stride=2) for _ in range(5))

    def forward(self, x):
        for conv in self.convs:
            height, width = x.shape[-2:]
            pads = []
            for size in (width, height):  # traced, the sizes are tensors
                if isinstance(size, torch.Tensor):
                    total = torch.clamp(((size / 2).ceil() - 1) * 2 + 3 - size, min=0).long()
                else:
                    total = max((-(-size // 2) - 1) * 2 + 3 - size, 0)
                pads += [total // 2, total - total // 2]
            x = conv(torch.nn.functional.pad(x, pads))
        return x


@pytest.mark.parametrize("dynamic_batch", [False, True], ids=["static", "dynamic batch"])
def test_a_chain_of_run_time_same_pads_folds(rng, dynamic_batch):
    """The chain resolves one pad per round of shape inference: with three rounds, the last
    pads stayed computed and the import failed (timm's tf_efficientnet_b0 too)."""
    torch.manual_seed(0)
    module = _SamePadConvs()
    model = _export(module, torch.randn(2, 4, 67, 61), dynamic_batch=dynamic_batch)
    assert _ops(model).count("Pad") == 5
    folded = fold_shape_constants(model, {} if dynamic_batch else {"x": (2, 4, 67, 61)})
    assert "Shape" not in _ops(folded)
    mod, params = from_onnx(model)
    exe = tvmamp.build(mod, "O0", TARGET, params=params)
    for batch in (1, 3) if dynamic_batch else (2,):
        x = rng.standard_normal((batch, 4, 67, 61)).astype("float32")
        with torch.no_grad():
            want = module(torch.from_numpy(x)).numpy()
        np.testing.assert_allclose(exe(x), want, rtol=1e-5, atol=1e-5)
