"""fp32 GEMV and small-batch Linear: tvmamp O0/O2 against onnxruntime and torch fp32, same run.

Times ``relu(Linear(K, N)(x))`` for ``x`` of ``batch x K`` on the large-FC shapes of the zoo
(AlexNet 9216x4096, VGG 4608x4096, 4096x4096, 4096x1000) through tvmamp O0 (fp32, the GEMV
schedule of ``schedules/cpu/gemv.py``), the same O0 build without that schedule (``--baseline``,
the generic matmul rule it replaced), tvmamp O2 in bf16 and fp16, onnxruntime fp32 (one ``Gemm``
with ``transB=1`` plus ``Relu``) and torch fp32 eager. The models come through
``tvmamp.from_torch`` (the weight arrives as ``permute_dims(W)``). Each thread count runs in its
own worker process (``TVM_NUM_THREADS`` is read once); within it the variants are timed
interleaved (at more than one thread each timed call follows one untimed call, as
``bench_zoo.py`` explains) and the medians reported; "(min)" is the O0 / onnxruntime ratio of
the fastest calls, steadier on a loaded machine. GB/s counts the fp32 weight bytes.

Run: python bench/bench_gemv.py [--threads 1,2] [--batches 1,2,4,8] [--repeat 30]
     [--shapes 9216x4096,4608x4096,4096x4096,4096x1000] [--baseline] [--out FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import statistics
import subprocess
import sys
import time

SHAPES = "9216x4096,4608x4096,4096x4096,4096x1000"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", default="1,2")
    p.add_argument("--batches", default="1,2,4,8")
    p.add_argument("--shapes", default=SHAPES, help="KxN weight shapes, comma separated")
    p.add_argument("--repeat", type=int, default=30)
    p.add_argument("--low-batches", default="1", help="batches that also time O2 bf16/fp16")
    p.add_argument("--baseline", action="store_true", help="also time O0 without the GEMV rule")
    p.add_argument("--out", default=None, help="also write the markdown here")
    p.add_argument("--worker", type=int, default=0, help=argparse.SUPPRESS)
    return p.parse_args(argv)


@contextlib.contextmanager
def without_gemv_rule():
    """Build with the GEMV schedule off: fp32 Linears go to the generic CPUMatmul tiles."""
    from tvmamp.schedules.cpu import gemv

    saved = dict(gemv.GEMV_CONFIGS)
    for bits, config in saved.items():
        gemv.GEMV_CONFIGS[bits] = dataclasses.replace(config, max_rows=0)
    try:
        yield
    finally:
        gemv.GEMV_CONFIGS.update(saved)


def onnx_session(weight, bias, batch: int, threads: int):
    """onnxruntime session of ``Relu(Gemm(x, W, b, transB=1))``."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    n, k = weight.shape
    nodes = [
        helper.make_node("Gemm", ["x", "w", "b"], ["y"], transB=1),
        helper.make_node("Relu", ["y"], ["z"]),
    ]
    graph = helper.make_graph(
        nodes,
        "linear",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, k])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, [batch, n])],
        [numpy_helper.from_array(weight, "w"), numpy_helper.from_array(bias, "b")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def interleaved_samples(fns, repeat: int, warmup: int) -> list[list[float]]:
    """Seconds per call of each of ``fns``, timed in turn, ``warmup`` untimed calls first."""
    for fn in fns:
        fn()
    samples = [[] for _ in fns]
    for _ in range(repeat):
        for fn, out in zip(fns, samples, strict=True):
            for _ in range(warmup):
                fn()
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
    return samples


def build_variants(torch_model, x, batch: int, args) -> dict:
    """The tvmamp builds of ``torch_model`` at ``x``'s shape: label -> Executable."""
    import tvmamp

    mod, params = tvmamp.from_torch(torch_model, (x,))
    exes = {"O0": tvmamp.build(mod, level="O0", params=params)}
    if args.baseline:
        with without_gemv_rule():
            exes["O0 generic"] = tvmamp.build(mod, level="O0", params=params)
    if batch in args.low_batch_set:
        for label, dtype in (("O2 bf16", "bfloat16"), ("O2 fp16", "float16")):
            exes[label] = tvmamp.build(mod, level="O2", dtype=dtype, params=params)
    return exes


def time_shape(k: int, n: int, batch: int, args) -> dict:
    """Build, check and time every variant of one Linear; return ms per call and errors."""
    import numpy as np
    import torch
    import tvm

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(k, n), torch.nn.ReLU()).eval()
    x = torch.randn(batch, k)
    with torch.inference_mode():
        ref = model(x).numpy()
    exes = build_variants(model, x, batch, args)
    weight, bias = (p.detach().numpy() for p in (model[0].weight, model[0].bias))
    sess = onnx_session(weight, bias, batch, args.worker)
    x_np, dev = x.numpy(), tvm.cpu()
    x_tvm = tvm.runtime.tensor(x_np, dev)
    errors = {}
    for label, exe in exes.items():
        out = exe.vm["main"](x_tvm)
        out = out[0] if isinstance(out, (list, tuple)) or not hasattr(out, "numpy") else out
        errors[label] = float(np.abs(out.numpy() - ref).max() / np.abs(ref).max())
    fns = {f"tvmamp {label}": (lambda e=exe: e.vm["main"](x_tvm)) for label, exe in exes.items()}
    fns["onnxruntime fp32"] = lambda: sess.run(None, {"x": x_np})
    fns["torch fp32"] = lambda: model(x)
    with torch.inference_mode():
        samples = interleaved_samples(list(fns.values()), args.repeat, int(args.worker > 1))
    ms = {lb: statistics.median(t) * 1e3 for lb, t in zip(fns, samples, strict=True)}
    best = {lb: min(t) * 1e3 for lb, t in zip(fns, samples, strict=True)}
    return dict(k=k, n=n, batch=batch, ms=ms, best=best, err=errors)


def worker(args) -> None:
    """One thread count: every shape and batch; one JSON line each on stdout."""
    import torch

    torch.set_num_threads(args.worker)
    for shape in args.shapes.split(","):
        k, n = (int(v) for v in shape.split("x"))
        for batch in (int(b) for b in args.batches.split(",")):
            print(json.dumps(time_shape(k, n, batch, args)), flush=True)


def run_worker(threads: int, argv: list[str]) -> list[dict]:
    """Run the worker for ``threads`` in a subprocess; return its records."""
    env = dict(os.environ, TVM_NUM_THREADS=str(threads), OMP_NUM_THREADS=str(threads))
    cmd = [sys.executable, __file__, *argv, "--worker", str(threads)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"bench_gemv: worker for {threads} thread(s) failed:\n{proc.stderr}")
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def table(records: list[dict], threads: int) -> list[str]:
    """Markdown table of one thread count."""
    labels = list(records[0]["ms"])
    tv = [lb for lb in labels if lb.startswith("tvmamp")]
    head = ["K x N", "batch", *(f"{lb} ms" for lb in labels), "O0 / ort", "(min)", "O0 / torch"]
    head += [f"{lb.split()[-1]} / ort" for lb in tv if "O2" in lb]
    head += ["O0 GB/s", "O0 ms per row / batch 1", "max rel err (O0, O2 bf16)"]
    lines = [f"### {threads} thread(s), median ms per call", ""]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    batch1 = {(r["k"], r["n"]): r["ms"]["tvmamp O0"] for r in records if r["batch"] == 1}
    for r in records:
        ms, ort = r["ms"], r["ms"]["onnxruntime fp32"]
        cells = [f"{r['k']} x {r['n']}", str(r["batch"])]
        cells += [f"{ms[lb]:.3f}" if lb in ms else "-" for lb in labels]
        best = r["best"]["tvmamp O0"] / r["best"]["onnxruntime fp32"]
        cells += [f"{ms['tvmamp O0'] / ort:.2f}", f"{best:.2f}"]
        cells += [f"{ms['tvmamp O0'] / ms['torch fp32']:.2f}"]
        cells += [f"{ms[lb] / ort:.2f}" if lb in ms else "-" for lb in tv if "O2" in lb]
        gbs = r["k"] * r["n"] * 4 / ms["tvmamp O0"] / 1e6
        base = batch1.get((r["k"], r["n"]))
        per_row = f"{ms['tvmamp O0'] / r['batch'] / base:.2f}" if base else "-"
        errs = ", ".join(f"{r['err'][lb]:.1e}" for lb in ("O0", "O2 bf16") if lb in r["err"])
        cells += [f"{gbs:.1f}", per_row, errs]
        lines.append("| " + " | ".join(cells) + " |")
    return lines + [""]


def header() -> list[str]:
    """Date, machine and versions."""
    import onnxruntime
    import torch
    import tvm

    cpu = "unknown CPU"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    load = " / ".join(f"{v:.2f}" for v in os.getloadavg())
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return [
        f"Date {now}; CPU {cpu} ({os.cpu_count()} vCPUs); torch {torch.__version__}, "
        f"onnxruntime {onnxruntime.__version__}, apache-tvm {tvm.__version__}; target `llvm` "
        f"(host CPU); load average at start {load}.",
        "",
        "`" + " ".join(["python bench/bench_gemv.py", *sys.argv[1:]]) + "`",
        "",
    ]


def main() -> None:
    args = parse_args()
    args.low_batch_set = {int(b) for b in args.low_batches.split(",") if b}
    if args.worker:
        worker(args)
        return
    argv = sys.argv[1:]
    lines = ["## fp32 GEMV / small-batch Linear (bench/bench_gemv.py)", "", *header()]
    for threads in (int(t) for t in args.threads.split(",")):
        lines += table(run_worker(threads, argv), threads)
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
