"""Every conv family (dense, 1x1, strided, stem, grouped, depthwise, transposed) against ORT.

Each case is one conv + bias + ReLU, built by tvmamp at O0 (fp32) and O2 (the target's low
dtype, bf16 on avx512_bf16 hosts) and timed interleaved with onnxruntime fp32 and torch fp32
in the same process, one thread each. Prints a markdown table of median times and ratios.

Run with ``TVM_NUM_THREADS=1 python bench/bench_conv.py [--cases NAME ...] [--repeat N]``.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
import tvm
from tvm import relax

import tvmamp
from tvmamp.benchmark import max_rel_error, paired_medians

# name: (input NCHW, out channels, kernel, stride, padding, groups, dilation, transposed)
CASES = {
    "dense 3x3": ((1, 64, 56, 56), 64, 3, 1, 1, 1, 1, False),
    "dense 1x1": ((1, 256, 56, 56), 64, 1, 1, 0, 1, 1, False),
    "dense 3x3 s2": ((1, 128, 56, 56), 256, 3, 2, 1, 1, 1, False),
    "stem 7x7 s2": ((1, 3, 224, 224), 64, 7, 2, 3, 1, 1, False),
    "alexnet g2 5x5": ((1, 96, 27, 27), 256, 5, 1, 2, 2, 1, False),
    "alexnet g2 3x3": ((1, 384, 13, 13), 384, 3, 1, 1, 2, 1, False),
    "shufflenet g3 1x1": ((1, 480, 14, 14), 120, 1, 1, 0, 3, 1, False),
    "shufflenet g3 1x1 up": ((1, 120, 14, 14), 480, 1, 1, 0, 3, 1, False),
    "resnext g32 3x3": ((1, 512, 7, 7), 512, 3, 1, 1, 32, 1, False),
    "resnext g32 3x3 s2": ((1, 512, 14, 14), 512, 3, 2, 1, 32, 1, False),
    "resnext g32 3x3 w4": ((1, 128, 56, 56), 128, 3, 1, 1, 32, 1, False),
    "dw 3x3 c32": ((1, 32, 112, 112), 32, 3, 1, 1, 32, 1, False),
    "dw 3x3 c96 s2": ((1, 96, 112, 112), 96, 3, 2, 1, 96, 1, False),
    "dw 3x3 c144": ((1, 144, 56, 56), 144, 3, 1, 1, 144, 1, False),
    "dw 3x3 c144 s2": ((1, 144, 56, 56), 144, 3, 2, 1, 144, 1, False),
    "dw 3x3 c384": ((1, 384, 14, 14), 384, 3, 1, 1, 384, 1, False),
    "dw 3x3 c960": ((1, 960, 7, 7), 960, 3, 1, 1, 960, 1, False),
    "dw 3x3 x2 c32": ((1, 32, 56, 56), 64, 3, 1, 1, 32, 1, False),
    "transposed 4x4 s2": ((1, 64, 28, 28), 32, 4, 2, 1, 1, 1, True),  # DCGAN-like
    "transposed 2x2 s2": ((1, 128, 28, 28), 64, 2, 2, 0, 1, 1, True),  # U-Net up-sampling
    "transposed 3x3 s2": ((1, 64, 28, 28), 32, 3, 2, 1, 1, 1, True),
    "transposed 3x3 s3": ((1, 32, 20, 20), 32, 3, 3, 1, 1, 1, True),
}


def torch_module(case) -> torch.nn.Module:
    """The case as a seeded torch conv (with bias) + ReLU, in eval mode."""
    shape, f, k, s, p, g, d, transposed = case
    torch.manual_seed(0)
    if transposed:
        conv = torch.nn.ConvTranspose2d(shape[1], f, k, s, p, groups=g, dilation=d)
    else:
        conv = torch.nn.Conv2d(shape[1], f, k, s, p, groups=g, dilation=d)
    return torch.nn.Sequential(conv, torch.nn.ReLU()).eval()


def relax_module(model: torch.nn.Module, case) -> tvm.IRModule:
    """The same conv + bias + ReLU as a Relax function with the weights as constants."""
    shape, _, _, s, p, g, d, transposed = case
    conv = model[0]
    weight = relax.const(conv.weight.detach().numpy())
    bias = relax.const(conv.bias.detach().numpy().reshape(1, -1, 1, 1))
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(shape, "float32"))
    op = relax.op.nn.conv2d_transpose if transposed else relax.op.nn.conv2d
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(op(x, weight, strides=s, padding=p, dilation=d, groups=g))
            y = bb.emit(relax.op.nn.relu(relax.op.add(y, bias)))
            out = bb.emit_output(y)
        bb.emit_func_output(out)
    return bb.get()


def onnx_session(model, x: torch.Tensor, workdir: str):
    """An onnxruntime fp32 session of ``model``, one intra-op thread."""
    import onnxruntime as ort

    path = os.path.join(workdir, "conv.onnx")
    torch.onnx.export(model, (x,), path, dynamo=False, input_names=["x"])
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.inter_op_num_threads = 1
    sess = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
    feed = {"x": x.numpy()}
    return lambda: sess.run(None, feed)


def flops(case) -> float:
    """Multiply-adds x 2 of the case (the transposed conv counted on its input)."""
    shape, f, k, s, p, g, d, transposed = case
    n, c, h, w = shape
    if transposed:
        return 2.0 * n * c * h * w * (f // g) * k * k
    oh = (h + 2 * p - d * (k - 1) - 1) // s + 1
    ow = (w + 2 * p - d * (k - 1) - 1) // s + 1
    return 2.0 * n * f * oh * ow * (c // g) * k * k


def run_case(name: str, case, levels: list[str], repeat: int, workdir: str) -> dict:
    """Median ms of every tvmamp level, onnxruntime and torch, and each level's error."""
    model = torch_module(case)
    x = torch.randn(case[0], generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(x).numpy()
    fns, labels, errors = [], [], {}
    for level in levels:
        exe = tvmamp.build(relax_module(model, case), level, "llvm")
        args = [tvm.runtime.tensor(x.numpy(), exe.device)]
        errors[level] = max_rel_error(exe.vm["main"](*args).numpy(), ref)
        fns.append(lambda exe=exe, args=args: exe.vm["main"](*args))
        labels.append(f"tvmamp {level}")
    fns.append(onnx_session(model, x, workdir))
    labels.append("onnxruntime fp32")
    with torch.no_grad():
        fns.append(lambda: model(x))
    labels.append("torch fp32")
    times = paired_medians(fns, repeat=repeat, number=3)
    return {"name": name, "ms": dict(zip(labels, (t * 1e3 for t in times))), "err": errors}


def table(rows: list[dict], levels: list[str]) -> str:
    """The markdown table: times, GFLOP/s of each tvmamp level and ratios to onnxruntime."""
    head = [f"tvmamp {lv} ms" for lv in levels] + ["onnxruntime ms", "torch ms"]
    head += [f"{lv} GFLOP/s" for lv in levels] + [f"ort / {lv}" for lv in levels]
    lines = ["| case | " + " | ".join(head) + " | max rel err |"]
    lines.append("|" + "---|" * (len(head) + 2))
    for row in rows:
        ms = row["ms"]
        cells = [f"{ms[f'tvmamp {lv}']:.3f}" for lv in levels]
        cells += [f"{ms['onnxruntime fp32']:.3f}", f"{ms['torch fp32']:.3f}"]
        cells += [f"{flops(CASES[row['name']]) / ms[f'tvmamp {lv}'] / 1e6:.0f}" for lv in levels]
        cells += [f"{ms['onnxruntime fp32'] / ms[f'tvmamp {lv}']:.2f}x" for lv in levels]
        err = ", ".join(f"{lv} {e:.1e}" for lv, e in row["err"].items())
        lines.append(f"| {row['name']} | " + " | ".join(cells) + f" | {err} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    parser.add_argument("--levels", nargs="*", default=["O0", "O2"])
    parser.add_argument("--repeat", type=int, default=15)
    args = parser.parse_args()
    if os.environ.get("TVM_NUM_THREADS") != "1":
        raise SystemExit("bench_conv: run with TVM_NUM_THREADS=1 (the table is one-thread)")
    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_conv_") as workdir:
        for name in args.cases:
            rows.append(run_case(name, CASES[name], args.levels, args.repeat, workdir))
            print(table(rows[-1:], args.levels).splitlines()[-1], flush=True)
    print()
    print(table(rows, args.levels))


if __name__ == "__main__":
    main()
