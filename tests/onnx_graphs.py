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
