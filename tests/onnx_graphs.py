"""Small ONNX graphs for the importer tests, and their reference run on onnxruntime."""

from __future__ import annotations


def onnx_model(nodes, inputs, outputs, inits=(), opset=13):
    """A one-graph model of ``nodes`` (IR version 8, the default domain at ``opset``)."""
    from onnx import helper as h

    graph = h.make_graph(nodes, "g", inputs, outputs, list(inits))
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", opset)])
    model.ir_version = 8
    return model


def run_ort(model, **feeds):
    """The first output of ``model`` on onnxruntime's CPU provider."""
    import onnxruntime as ort

    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)[0]


def resize_by_shape():
    """``Resize`` to sizes computed from ``Shape(x)`` over a symbolic batch: a model TVM's
    importer refuses (it needs the sizes static)."""
    import numpy as np
    from onnx import TensorProto, numpy_helper
    from onnx import helper as h

    nodes = [
        h.make_node("Shape", ["x"], ["shp"]),
        h.make_node("Mul", ["shp", "two"], ["sizes"]),
        h.make_node("Resize", ["x", "", "", "sizes"], ["y"], mode="nearest"),
    ]
    return onnx_model(
        nodes,
        [h.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 2, 4, 4])],
        [h.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 2, 8, 8])],
        [numpy_helper.from_array(np.array([1, 1, 2, 2], np.int64), "two")],
    )
