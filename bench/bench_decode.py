"""One decode step of a GPT-2-shaped decoder with a key-value cache, against onnxruntime.

The model is an ONNX file as onnxruntime's GPT-2 optimiser writes decoders exported with
``past_key_values``: per layer a ``LayerNormalization``, onnxruntime's fused ``Attention``
(``com.microsoft``, causal, a raw attention mask over all keys, the cache ``past_i``
``(2, batch, heads, past_seq, head_size)`` in and ``present_i`` out), the output projection, a
second ``LayerNormalization`` and a GELU MLP, with residuals; random weights. Its batch,
sequence and cache lengths are symbolic: tvmamp builds it once (``from_onnx`` with no
``shape_dict``) and runs every step of a growing cache with that build, as a deployed decoder
does. Each step feeds one new position after ``past`` cached ones; the cache comes from
random values.

Printed per cache length: tvmamp O0 (fp32) and O2 (bf16) against onnxruntime fp32 (one
intra-op thread), timed interleaved in one process (``paired_medians``), and their errors
against onnxruntime on the hidden state and the present cache.

Run: TVM_NUM_THREADS=1 python bench/bench_decode.py [--layers 4] [--hidden 768] [--heads 12]
     [--past 128,512] [--repeat 15] [--levels O0,O2]
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np


def decoder_model(layers: int, hidden: int, heads: int, seed: int = 0):
    """The ONNX decoder described in the module docstring."""
    from onnx import TensorProto
    from onnx import helper as h
    from onnx import numpy_helper as nh

    rng = np.random.default_rng(seed)
    size = hidden // heads
    inits, nodes = [], []

    def weight(name, shape, scale):
        inits.append(nh.from_array((rng.standard_normal(shape) * scale).astype("float32"), name))
        return name

    inputs = [
        h.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", hidden]),
        h.make_tensor_value_info("mask", TensorProto.INT32, ["batch", "total_seq"]),
    ]
    outputs = []
    x = "x"
    for i in range(layers):
        past = f"past_{i}"
        inputs.append(
            h.make_tensor_value_info(past, TensorProto.FLOAT, [2, "batch", heads, "past_seq", size])
        )
        ln1 = f"ln1_{i}"
        gamma, beta = weight(f"g1_{i}", (hidden,), 0.1), weight(f"b1_{i}", (hidden,), 0.1)
        nodes.append(h.make_node("LayerNormalization", [x, gamma, beta], [ln1], axis=-1))
        qkv_w = weight(f"wqkv_{i}", (hidden, 3 * hidden), hidden**-0.5)
        qkv_b = weight(f"bqkv_{i}", (3 * hidden,), 0.1)
        attn, present = f"attn_{i}", f"present_{i}"
        nodes.append(
            h.make_node(
                "Attention",
                [ln1, qkv_w, qkv_b, "mask", past],
                [attn, present],
                domain="com.microsoft",
                num_heads=heads,
                unidirectional=1,
            )
        )
        outputs.append(
            h.make_tensor_value_info(present, TensorProto.FLOAT, [2, "batch", heads, None, size])
        )
        x = _linear(nodes, weight, attn, f"proj_{i}", hidden, hidden, residual=x)
        ln2 = f"ln2_{i}"
        gamma, beta = weight(f"g2_{i}", (hidden,), 0.1), weight(f"b2_{i}", (hidden,), 0.1)
        nodes.append(h.make_node("LayerNormalization", [x, gamma, beta], [ln2], axis=-1))
        up = _linear(nodes, weight, ln2, f"fc_{i}", hidden, 4 * hidden)
        gelu = f"gelu_{i}"
        nodes.append(h.make_node("Gelu", [up], [gelu], domain="com.microsoft"))
        x = _linear(nodes, weight, gelu, f"down_{i}", 4 * hidden, hidden, residual=x)
    outputs.insert(0, h.make_tensor_value_info(x, TensorProto.FLOAT, ["batch", "seq", hidden]))
    graph = h.make_graph(nodes, "decoder", inputs, outputs, inits)
    opsets = [h.make_opsetid("", 17), h.make_opsetid("com.microsoft", 1)]
    model = h.make_model(graph, opset_imports=opsets)
    model.ir_version = 8
    return model


def _linear(nodes, weight, x: str, name: str, fan_in: int, fan_out: int, residual=None) -> str:
    from onnx import helper as h

    w = weight(f"w_{name}", (fan_in, fan_out), fan_in**-0.5)
    b = weight(f"b_{name}", (fan_out,), 0.1)
    nodes.append(h.make_node("MatMul", [x, w], [f"{name}_mm"]))
    nodes.append(h.make_node("Add", [f"{name}_mm", b], [f"{name}_out"]))
    if residual is None:
        return f"{name}_out"
    nodes.append(h.make_node("Add", [residual, f"{name}_out"], [f"{name}_res"]))
    return f"{name}_res"


def step_feeds(model, past: int, rng, batch: int = 1) -> dict:
    """Inputs of one decode step after ``past`` cached positions (random cache values)."""
    hidden = model.graph.input[0].type.tensor_type.shape.dim[2].dim_value
    feeds = {
        "x": rng.standard_normal((batch, 1, hidden)).astype("float32"),
        "mask": np.ones((batch, past + 1), "int32"),
    }
    for value in model.graph.input[2:]:
        dims = value.type.tensor_type.shape.dim
        heads, size = dims[2].dim_value, dims[4].dim_value
        feeds[value.name] = rng.standard_normal((2, batch, heads, past, size)).astype("float32")
    return feeds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--past", default="128,512", help="cache lengths, comma-separated")
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--levels", default="O0,O2")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    os.environ.setdefault("TVM_NUM_THREADS", str(args.threads))
    import onnxruntime as ort
    import tvm

    import tvmamp
    from tvmamp.benchmark import max_rel_error, paired_medians

    sys.stdout.reconfigure(line_buffering=True)
    model = decoder_model(args.layers, args.hidden, args.heads)
    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = args.threads
    session = ort.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
    mod, params = tvmamp.from_onnx(model)
    levels = args.levels.split(",")
    builds = {
        level: tvmamp.build(mod, level=level, target="llvm", dtype="bfloat16", params=params)
        for level in levels
    }
    print(
        f"decoder: {args.layers} layers of {args.hidden}, {args.heads} heads, batch 1, one new "
        f"position a step; {args.threads} thread(s); symbolic lengths, one build per level\n"
    )
    print(
        "| cached positions | onnxruntime fp32, ms | "
        + " | ".join(f"tvmamp {lv}, ms (time / onnxruntime) | {lv} rel err" for lv in levels)
        + " |"
    )
    print("|---|---|" + "---|---|" * len(levels))
    rng = np.random.default_rng(1)
    for past in (int(p) for p in args.past.split(",")):
        feeds = step_feeds(model, past, rng)
        want = session.run(None, feeds)
        order = [i.name for i in model.graph.input]
        cells, fns = [], []
        for level in levels:
            exe = builds[level]
            got = exe(*[feeds[n] for n in order])
            err = max(max_rel_error(np.asarray(g), w) for g, w in zip(got, want, strict=True))
            cells.append(err)
            tensors = [tvm.runtime.tensor(feeds[n], exe.device) for n in order]
            fns.append(lambda main=exe.vm["main"], t=tensors: main(*t))
        reference = lambda feeds=feeds: session.run(None, feeds)  # noqa: E731
        times = paired_medians([*fns, reference], args.repeat, number=5)
        ref = times[-1]
        row = [f"{past}", f"{ref * 1e3:.3f}"]
        for t, err in zip(times[:-1], cells, strict=True):
            row += [f"{t * 1e3:.3f} ({t / ref:.2f})", f"{err:.1e}"]
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
