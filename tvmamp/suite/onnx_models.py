"""A small ONNX CNN classifier built node by node with ``onnx.helper`` (seeded random weights)."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17


def small_cnn(channels: int = 16, num_classes: int = 10, image_size: int = 32, seed: int = 0):
    """Conv-BN-Relu, Conv-Relu, MaxPool, Conv-Relu, GlobalAveragePool, Flatten, Gemm.

    The input ``image`` has a symbolic batch dimension ``batch`` (pass a ``shape_dict``).
    """
    rng = np.random.default_rng(seed)
    c = channels

    def weight(name, shape, fan_in):
        return numpy_helper.from_array(
            (rng.standard_normal(shape) / np.sqrt(fan_in)).astype("float32"), name
        )

    inits = [
        weight("conv1.weight", (c, 3, 3, 3), 27),
        weight("conv1.bias", (c,), 1e4),
        numpy_helper.from_array((1 + 0.1 * rng.standard_normal(c)).astype("float32"), "bn.scale"),
        numpy_helper.from_array((0.1 * rng.standard_normal(c)).astype("float32"), "bn.bias"),
        numpy_helper.from_array((0.1 * rng.standard_normal(c)).astype("float32"), "bn.mean"),
        numpy_helper.from_array((0.5 + rng.random(c)).astype("float32"), "bn.var"),
        weight("conv2.weight", (2 * c, c, 3, 3), 9 * c),
        weight("conv3.weight", (2 * c, 2 * c, 3, 3), 18 * c),
        weight("fc.weight", (num_classes, 2 * c), 2 * c),
        weight("fc.bias", (num_classes,), 1e4),
    ]
    pad = {"pads": [1, 1, 1, 1]}
    nodes = [
        helper.make_node("Conv", ["image", "conv1.weight", "conv1.bias"], ["c1"], **pad),
        helper.make_node(
            "BatchNormalization", ["c1", "bn.scale", "bn.bias", "bn.mean", "bn.var"], ["b1"]
        ),
        helper.make_node("Relu", ["b1"], ["r1"]),
        helper.make_node("Conv", ["r1", "conv2.weight"], ["c2"], strides=[2, 2], **pad),
        helper.make_node("Relu", ["c2"], ["r2"]),
        helper.make_node("MaxPool", ["r2"], ["p2"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Conv", ["p2", "conv3.weight"], ["c3"], **pad),
        helper.make_node("Relu", ["c3"], ["r3"]),
        helper.make_node("GlobalAveragePool", ["r3"], ["g"]),
        helper.make_node("Flatten", ["g"], ["f"]),
        helper.make_node("Gemm", ["f", "fc.weight", "fc.bias"], ["logits"], transB=1),
    ]
    image = helper.make_tensor_value_info(
        "image", TensorProto.FLOAT, ["batch", 3, image_size, image_size]
    )
    logits = helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", num_classes])
    graph = helper.make_graph(nodes, "tvmamp_small_cnn", [image], [logits], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def zoo_style(model, opset: int = 8):
    """A copy of ``model`` laid out as the classic model-zoo files are (IR version 3).

    Every initializer is listed in ``graph.input`` too, after the data inputs, and the opset is
    ``opset`` (``small_cnn``'s operators mean the same from opset 8 on).
    """
    old = onnx.ModelProto()
    old.CopyFrom(model)
    old.graph.input.extend(
        helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
        for t in old.graph.initializer
    )
    del old.opset_import[:]
    old.opset_import.append(helper.make_opsetid("", opset))
    old.ir_version = 3
    onnx.checker.check_model(old)
    return old


def run_reference(model, inputs) -> np.ndarray:
    """fp32 output of ``onnx.reference.ReferenceEvaluator`` (ONNX's own interpreter)."""
    from onnx.reference import ReferenceEvaluator

    names = [i.name for i in model.graph.input]
    return ReferenceEvaluator(model).run(None, dict(zip(names, inputs)))[0]
