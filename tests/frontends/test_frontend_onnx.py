"""tvmamp.from_onnx: the suite CNN, zoo-style files, shape_dict checks, bad files, bad ops."""

import numpy as np
import pytest

import tvmamp
from tvmamp.frontends import UnsupportedOperatorError, from_onnx

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from tvmamp.suite.onnx_models import run_reference, small_cnn, zoo_style  # noqa: E402

TARGET = "llvm -num-cores=1"


@pytest.fixture(scope="module")
def cnn():
    return small_cnn(channels=8, image_size=16)


def _image(rng, batch=2):
    return rng.standard_normal((batch, 3, 16, 16)).astype("float32")


def test_import_names_params_and_matches_the_reference(cnn, rng, tmp_path):
    path = tmp_path / "cnn.onnx"
    onnx.save(cnn, path)
    mod, params = from_onnx(str(path), shape_dict={"image": (2, 3, 16, 16)})
    assert [p.name for p in mod["main"].params][:2] == ["image", "conv1.weight"]
    assert set(params) == {t.name for t in cnn.graph.initializer}
    assert mod["main"].attrs["num_input"] == 1
    x = _image(rng)
    ref = run_reference(cnn, [x])
    np.testing.assert_allclose(
        tvmamp.build(mod, "O0", TARGET, params=params)(x), ref, rtol=1e-5, atol=1e-5
    )
    low = tvmamp.build(mod, "O1", TARGET, dtype="bfloat16", params=params)(x)
    np.testing.assert_allclose(low, ref, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("as_file", [False, True], ids=["model", "file"])
def test_zoo_style_file_with_initializers_in_graph_input_imports(cnn, rng, tmp_path, as_file):
    old = zoo_style(cnn)
    assert len(old.graph.input) == 1 + len(old.graph.initializer)
    snapshot = old.SerializeToString()
    if as_file:
        onnx.save(old, tmp_path / "zoo.onnx")
    source = str(tmp_path / "zoo.onnx") if as_file else old
    mod, params = from_onnx(source, shape_dict={"image": (2, 3, 16, 16)})
    names = [t.name for t in cnn.graph.initializer]
    assert [p.name for p in mod["main"].params] == ["image", *names]
    assert mod["main"].attrs["num_input"] == 1
    assert sorted(params) == sorted(names)
    np.testing.assert_array_equal(
        params["conv1.weight"], onnx.numpy_helper.to_array(cnn.graph.initializer[0])
    )
    assert old.SerializeToString() == snapshot  # the caller's model is not modified
    x = _image(rng)
    exe = tvmamp.build(mod, "O0", TARGET, params=params)
    np.testing.assert_allclose(exe(x), run_reference(cnn, [x]), rtol=1e-5, atol=1e-5)


def test_shape_dict_keys_must_name_inputs(cnn):
    with pytest.raises(ValueError, match=r"shape_dict keys \['img'\] name no input.*\['image'\]"):
        from_onnx(cnn, shape_dict={"img": (1, 3, 16, 16)})
    with pytest.raises(ValueError, match=r"dtype_dict keys \['x'\]"):
        from_onnx(cnn, dtype_dict={"x": "float32"})


def _single_node_model(op_type, shape=(3, 3)):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [])
    graph = helper.make_graph([helper.make_node(op_type, ["x"], ["y"])], "g", [x], [y])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_unsupported_op_is_named():
    with pytest.raises(UnsupportedOperatorError, match="does not support the operators Det"):
        from_onnx(_single_node_model("Det"))


def test_invalid_model_is_a_value_error():
    with pytest.raises(ValueError, match="the model is not a valid ONNX model.*NoSuchOp"):
        from_onnx(_single_node_model("NoSuchOp"))


def test_bad_and_missing_files(tmp_path):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"\x00 this is not a protobuf \xff" * 8)
    with pytest.raises(ValueError, match="bad.onnx"):
        from_onnx(str(bad))
    with pytest.raises(FileNotFoundError, match="no such model file"):
        from_onnx(str(tmp_path / "missing.onnx"))
    with pytest.raises(TypeError, match="expected a path or an onnx.ModelProto"):
        from_onnx(42)
    (tmp_path / "empty.onnx").write_bytes(b"")
    with pytest.raises(ValueError, match="empty.onnx' is an empty file"):
        from_onnx(str(tmp_path / "empty.onnx"))
    (tmp_path / "folder.onnx").mkdir()
    with pytest.raises(ValueError, match="folder.onnx' is a directory"):
        from_onnx(str(tmp_path / "folder.onnx"))


def _relu_model(in_shape=(2, 3), out_shape=(2, 3)):
    """``relu(x)``; a shape of None leaves the value's shape out (unknown rank)."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, in_shape)
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, out_shape)
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_inputs_and_outputs_of_unknown_rank(rng):
    """ONNX's checker wants their shapes; onnxruntime and TVM do not (the input's rank comes
    from shape_dict)."""
    x = rng.standard_normal((2, 3)).astype("float32")
    for model, shapes in ((_relu_model(out_shape=None), None), (_relu_model(None), {"x": (2, 3)})):
        mod, params = from_onnx(model, shape_dict=shapes)
        out = tvmamp.build(mod, "O0", TARGET, params=params)(x)
        np.testing.assert_array_equal(out, np.maximum(x, 0))


def test_a_shape_dict_of_another_rank_is_refused():
    """TVM took ``(6,)`` for a ``[2, 3]`` input and built a model of rank 1 without a word."""
    with pytest.raises(ValueError, match=r"shape_dict\['x'\] has 1 dimensions, .* has 2"):
        from_onnx(_relu_model(), shape_dict={"x": (6,)})


def test_external_data_is_read_from_the_model_directory_only(cnn, rng, tmp_path, monkeypatch):
    """A model loaded without its external data would read a file of the same name from the
    working directory: refused."""
    folder = tmp_path / "model"
    folder.mkdir()
    path = folder / "cnn.onnx"
    copy = onnx.ModelProto()
    copy.CopyFrom(cnn)  # saving with external data moves the copy's weights out of it
    onnx.save_model(copy, path, save_as_external_data=True, location="w.bin", size_threshold=0)
    (tmp_path / "w.bin").write_bytes(b"\x01" * (folder / "w.bin").stat().st_size)
    monkeypatch.chdir(tmp_path)  # holds another w.bin
    mod, params = from_onnx(str(path), shape_dict={"image": (2, 3, 16, 16)})
    x = _image(rng)
    out = tvmamp.build(mod, "O0", TARGET, params=params)(x)
    np.testing.assert_allclose(out, run_reference(cnn, [x]), rtol=1e-5, atol=1e-5)
    unloaded = onnx.load(str(path), load_external_data=False)
    with pytest.raises(ValueError, match="external files that were not loaded"):
        from_onnx(unloaded)


def test_ops_are_read_with_their_domain():
    """TVM's importer converts by op type alone: a custom ``Relu`` would be the standard one."""
    model = _relu_model()
    model.graph.node[0].domain = "my.custom"
    model.opset_import.append(helper.make_opsetid("my.custom", 1))
    with pytest.raises(UnsupportedOperatorError, match="my.custom::Relu"):
        from_onnx(model)


def test_a_converter_failure_is_a_value_error_naming_the_op():
    """TVM's Attention converter asserts on a node with rotary embeddings."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4, 8])
    inits = [
        numpy_helper.from_array(np.ones((8, 24), "float32"), "w"),
        numpy_helper.from_array(np.ones(24, "float32"), "b"),
    ]
    node = helper.make_node(
        "Attention", ["x", "w", "b"], ["y"], domain="com.microsoft", num_heads=2, do_rotary=1
    )
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4, 8])
    model = helper.make_model(
        helper.make_graph([node], "g", [x], [y], inits),
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)],
    )
    with pytest.raises(UnsupportedOperatorError, match="converter for Attention"):
        from_onnx(model)


def test_nodes_out_of_topological_order_are_sorted(rng):
    """onnxruntime's fp16 converter (keep_io_types) writes such models; the checker refused
    them, onnxruntime runs them. The model given is left as it was."""
    shape = [2, 3]
    nodes = [
        helper.make_node("Mul", ["h", "x"], ["y"]),
        helper.make_node("Relu", ["c"], ["h"]),
        helper.make_node("Cast", ["x"], ["c"], to=TensorProto.FLOAT),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    mod, params = from_onnx(model)
    x = rng.standard_normal(shape).astype("float32")
    out = tvmamp.build(mod, params=params, level="O0", target="llvm")(x)
    np.testing.assert_allclose(out, np.maximum(x, 0) * x, rtol=1e-6)
    assert [n.op_type for n in model.graph.node] == ["Mul", "Relu", "Cast"]
