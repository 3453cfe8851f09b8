"""Non-GEMM op families on the CPU: tvmamp O0/O2 against onnxruntime and torch fp32, same run.

Softmax, layer norm, GELU (tanh and erf), SiLU, sigmoid, max/avg/global pooling, AlexNet's LRN,
concat, split, channel shuffle, an unfolded BatchNorm + ReLU6, and a transpose, each at a
shape taken from the model zoo. Every figure is nanoseconds per output element of one call
(median of interleaved rounds), one thread. The tvmamp O2 build keeps its inputs and outputs
bf16 (``keep_io_types=False``), as the op sees them inside a bf16 model; O0 is fp32.
``--rules`` also prints which default CPU rule schedules each kernel of the O2 build.

Run with ``TVM_NUM_THREADS=1 python bench/bench_ops.py [--ops softmax,lrn] [--rules]``.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
import tvm
from torch import nn

import tvmamp
from tvmamp.benchmark import paired_medians
from tvmamp.tensors import np_dtype


class _Fn(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *xs):
        return self.fn(*xs)


def _shuffle(x, groups=3):
    n, c, h, w = x.shape
    return x.reshape(n, groups, c // groups, h, w).transpose(1, 2).reshape(n, c, h, w)


def _bn_relu6(channels):
    bn = nn.BatchNorm2d(channels)
    with torch.no_grad():
        bn.running_mean.uniform_(-1, 1)
        bn.running_var.uniform_(0.5, 2)
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-0.5, 0.5)
    return nn.Sequential(bn, nn.ReLU6())


# name -> (module, input shapes): shapes from bench/zoo_models.py's models
OPS = {
    "softmax": (_Fn(lambda x: torch.softmax(x, -1)), [(1, 6, 197, 197)]),
    "layer_norm": (nn.LayerNorm(384), [(197, 384)]),
    "gelu_tanh": (nn.GELU("tanh"), [(128, 1536)]),
    "gelu_erf": (nn.GELU(), [(197, 1536)]),
    "silu": (nn.SiLU(), [(1, 144, 56, 56)]),
    "sigmoid": (nn.Sigmoid(), [(1, 144, 56, 56)]),
    "max_pool": (nn.MaxPool2d(3, 2, 1), [(1, 64, 112, 112)]),
    "avg_pool": (nn.AvgPool2d(3, 1, 1), [(1, 192, 28, 28)]),
    "global_avg_pool": (nn.AdaptiveAvgPool2d(1), [(1, 2048, 7, 7)]),
    "lrn": (nn.LocalResponseNorm(5, 1e-4, 0.75, 2.0), [(1, 96, 55, 55)]),
    "concat": (_Fn(lambda a, b: torch.cat([a, b], 1)), [(1, 256, 28, 28), (1, 32, 28, 28)]),
    "split": (_Fn(lambda x: torch.split(x, [116, 116], 1)), [(1, 232, 28, 28)]),
    "channel_shuffle": (_Fn(_shuffle), [(1, 240, 28, 28)]),
    "bn_relu6": (_bn_relu6(144), [(1, 144, 56, 56)]),
    "transpose": (_Fn(lambda x: x.permute(0, 2, 1, 3).contiguous()), [(1, 6, 197, 64)]),
    # MobileNetV2's rows -> NCHW layout change, and a square matrix transpose
    "transpose_3136x144": (_Fn(lambda x: x.t().contiguous()), [(3136, 144)]),
    "transpose_1024x1024": (_Fn(lambda x: x.t().contiguous()), [(1024, 1024)]),
}


def _outputs(out) -> list:
    return list(out) if isinstance(out, (tuple, list)) else [out]


def _ort_session(model, example, workdir):
    import onnxruntime as ort

    path = os.path.join(workdir, "op.onnx")
    names = [f"x{i}" for i in range(len(example))]
    torch.onnx.export(model, tuple(example), path, dynamo=False, input_names=names)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.inter_op_num_threads = 1
    sess = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
    feed = {n: x.numpy() for n, x in zip(names, example)}
    return lambda: sess.run(None, feed)


def _tvmamp_call(model, example, level):
    """A no-argument callable running the tvmamp build of ``model`` at ``level``, and its exe."""
    mod, params = tvmamp.from_torch(model, tuple(example))
    exe = tvmamp.build(mod, level, "llvm", "bfloat16", params, keep_io_types=level == "O0")
    dtype = "float32" if level == "O0" else "bfloat16"
    args = [tvm.runtime.tensor(x.numpy().astype(np_dtype(dtype))) for x in example]
    vm = exe.vm
    return (lambda: vm["main"](*args)), exe


def _rules(level: str, model, example) -> list[str]:
    """``kernel: rule`` for each kernel of the ``level`` build (``none`` = naive loops)."""
    from tvmamp.pipeline import run_front_phases
    from tvmamp.schedules.cpu import default_cpu_rules

    mod, params = tvmamp.from_torch(model, tuple(example))
    converted = tvmamp.convert(mod, level, "llvm", "bfloat16", params, keep_io_types=False)
    lowered = run_front_phases(converted)
    rules = default_cpu_rules(converted.target)
    lines = []
    for gvar, func in lowered.functions_items():
        if not isinstance(func, tvm.tirx.PrimFunc):
            continue
        with converted.target:
            hit = next((r for r in rules if r.apply(func, converted.target, False)), None)
        lines.append(f"{gvar.name_hint}: {type(hit.rule).__name__ if hit else 'none'}")
    return lines


def bench_op(name: str, repeat: int, show_rules: bool) -> str:
    """One markdown row: ns per output element for each runtime."""
    model, shapes = OPS[name]
    model.eval()
    torch.manual_seed(0)
    example = [torch.randn(*s) for s in shapes]
    with torch.no_grad():
        refs = _outputs(model(*example))
    elements = sum(r.numel() for r in refs)
    o0, _ = _tvmamp_call(model, example, "O0")
    o2, _ = _tvmamp_call(model, example, "O2")
    with tempfile.TemporaryDirectory() as workdir, torch.no_grad():
        ort = _ort_session(model, example, workdir)
        fns = [o0, o2, ort, lambda: model(*example)]
        secs = paired_medians(fns, repeat, 5)
    ns = [s * 1e9 / elements for s in secs]
    shape = " + ".join("x".join(map(str, s)) for s in shapes)
    row = f"| {name} | {shape} | " + " | ".join(f"{v:.2f}" for v in ns)
    row += f" | {ns[0] / ns[2]:.2f} | {ns[1] / ns[2]:.2f} |"
    if show_rules:
        row += " " + ", ".join(_rules("O2", model, example))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--ops", default=",".join(OPS), help="comma-separated, from: " + ",".join(OPS)
    )
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--rules", action="store_true", help="name each O2 kernel's rule")
    args = parser.parse_args()
    torch.set_num_threads(1)
    ops = args.ops.split(",")
    unknown = [op for op in ops if op not in OPS]
    if unknown:
        raise ValueError(f"bench_ops: ops {unknown} are not among {', '.join(OPS)}")
    print(
        f"ns per output element, 1 thread (TVM_NUM_THREADS={os.environ.get('TVM_NUM_THREADS')})\n"
    )
    print(
        "| op | input shape | tvmamp O0 | tvmamp O2 bf16 | onnxruntime | torch | O0/ort | O2/ort |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for op in ops:
        print(bench_op(op, args.repeat, args.rules), flush=True)


if __name__ == "__main__":
    main()
