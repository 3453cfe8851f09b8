"""bf16 on the CPU: tvmamp's vdpbf16ps / AMX / fp32-FMA kernels against torch (oneDNN), same run.

Measures the hardware peaks with tiny C loops compiled by gcc here (fp32 FMA, vdpbf16ps, AMX
tdpbf16ps), then GEMMs, SimpleNet (batch 256 and 1) and a conv net, each timed interleaved with
its comparisons (``tvmamp.benchmark.paired_medians``).

Run: TVM_NUM_THREADS=1 python bench/bench_cpu_bf16.py [--threads 1] [--skip-large]
[--only gemm|simplenet|convnet] [--shapes 1024x1024x1024,128x768x3072] [--mcpu cooperlake]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile

from bench_simplenet import torch_simplenet  # bench/ is on sys.path when run as a script

SECTIONS = ("gemm", "simplenet", "convnet")

_PEAK_C = r"""
#include <immintrin.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <sys/syscall.h>
static double now(void){
  struct timespec t; clock_gettime(CLOCK_MONOTONIC,&t); return t.tv_sec+t.tv_nsec*1e-9;}
#define REP 24
__attribute__((noinline)) static double fma_peak(long n){
  __m512 acc[REP]; for(int i=0;i<REP;i++) acc[i]=_mm512_set1_ps(0.f);
  __m512 a=_mm512_set1_ps(1e-3f), b=_mm512_set1_ps(1.f); double t=now();
  for(long it=0;it<n;it++){
    #pragma GCC unroll 24
    for(int i=0;i<REP;i++) acc[i]=_mm512_fmadd_ps(a,b,acc[i]); }
  t=now()-t; float s=0; for(int i=0;i<REP;i++) s+=_mm512_reduce_add_ps(acc[i]);
  if(s==1.2345f) puts(""); return n*REP*32.0/t/1e9;}
__attribute__((noinline)) static double dp_peak(long n){
  __m512 acc[REP]; for(int i=0;i<REP;i++) acc[i]=_mm512_set1_ps(0.f);
  __m512bh a=(__m512bh)_mm512_set1_epi32(0x3f803f80), b=(__m512bh)_mm512_set1_epi32(0x3c003c00);
  double t=now();
  for(long it=0;it<n;it++){
    #pragma GCC unroll 24
    for(int i=0;i<REP;i++) acc[i]=_mm512_dpbf16_ps(acc[i],a,b); }
  t=now()-t; float s=0; for(int i=0;i<REP;i++) s+=_mm512_reduce_add_ps(acc[i]);
  if(s==1.2345f) puts(""); return n*REP*64.0/t/1e9;}
typedef struct {
  unsigned char palette, start, res[14]; unsigned short colsb[16]; unsigned char rows[16];
} cfg_t;
__attribute__((noinline)) static double amx_peak(long n){
  if(syscall(SYS_arch_prctl, 0x1023, 18)) return 0;
  cfg_t c; memset(&c,0,sizeof c); c.palette=1; for(int i=0;i<8;i++){c.colsb[i]=64;c.rows[i]=16;}
  static char buf[1024] __attribute__((aligned(64)));
  _tile_loadconfig(&c); _tile_zero(0);_tile_zero(1);_tile_zero(2);_tile_zero(3);
  _tile_loadd(4,buf,64);_tile_loadd(5,buf,64);_tile_loadd(6,buf,64);_tile_loadd(7,buf,64);
  double t=now();
  for(long i=0;i<n;i++){
    _tile_dpbf16ps(0,4,6);_tile_dpbf16ps(1,4,7);_tile_dpbf16ps(2,5,6);_tile_dpbf16ps(3,5,7);}
  t=now()-t; _tile_release(); return n*4.0*16*16*32*2/t/1e9;}
int main(void){
  for(int r=0;r<5;r++) printf("%f %f %f\n", fma_peak(4000000), dp_peak(4000000), amx_peak(400000));
  return 0;}
"""


def measure_peaks() -> dict[str, float]:
    """Compile and run the C peak loops; return the best GFLOP/s of each over 5 rounds."""
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = os.path.join(tmp, "peak.c"), os.path.join(tmp, "peak")
        with open(src, "w", encoding="utf-8") as f:
            f.write(_PEAK_C)
        flags = ["-O2", "-mavx512f", "-mavx512bf16", "-mamx-tile", "-mamx-bf16"]
        subprocess.run(["gcc", *flags, src, "-o", exe], check=True)
        out = subprocess.run([exe], check=True, capture_output=True, text=True).stdout
    rows = [[float(v) for v in line.split()] for line in out.strip().splitlines()]
    names = ("fp32 FMA", "vdpbf16ps", "AMX tdpbf16ps")
    return {name: max(r[i] for r in rows) for i, name in enumerate(names)}


def main() -> None:
    """Parse options, set the thread count before TVM starts, run every section."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--skip-large", action="store_true", help="skip the 4096^3 GEMM")
    parser.add_argument(
        "--kernel",
        choices=("auto", "vdpbf16ps"),
        default="auto",
        help="vdpbf16ps: AMX off, the kernels of an avx512_bf16 CPU without AMX (on Intel, "
        "GEMMs of 8 rows or more then take fp32 FMAs: vdpbf16ps runs at half their rate)",
    )
    parser.add_argument("--only", choices=SECTIONS, help="run one section (default: all)")
    parser.add_argument(
        "--mcpu",
        help="compile for this LLVM CPU instead of the host's (one the host can run: "
        "cooperlake measures Intel's avx512_bf16 path without AMX on an AMD host)",
    )
    parser.add_argument(
        "--shapes",
        help="GEMM shapes m x k x n, comma-separated (e.g. 1024x1024x1024,128x768x3072); "
        "default: 1024^3, 4096^3 and 257x4096x1024",
    )
    args = parser.parse_args()
    os.environ["TVM_NUM_THREADS"] = str(args.threads)  # before TVM starts its thread pool
    peaks = measure_peaks()
    print("| peak (C loop, best of 5) | GFLOP/s |\n|---|---|")
    for name, value in peaks.items():
        print(f"| {name} | {value:.1f} |")
    import torch

    torch.set_num_threads(args.threads)
    target = _target(args.threads, args.kernel, args.mcpu)
    print(f"\ntarget: {target}\n")
    sections = {
        "gemm": lambda: bench_gemms(target, args, peaks),
        "simplenet": lambda: bench_simplenet(target, args),
        "convnet": lambda: bench_convnet(target, args),
    }
    for name in [args.only] if args.only else SECTIONS:
        sections[name]()


def _target(threads: int, kernel: str, mcpu: str | None = None):
    """The host target (or ``mcpu``'s); ``kernel="vdpbf16ps"`` turns AMX off to measure the
    kernels of an avx512_bf16 CPU without AMX."""
    import tvm

    from tvmamp.targets.llvm import host_cpu

    spec = {"kind": "llvm", "mcpu": mcpu or host_cpu(), "num-cores": threads}
    if kernel == "vdpbf16ps":
        spec["mattr"] = ["-amx-bf16", "-amx-tile"]
    return tvm.target.Target(spec)


def _gemm_module(m: int, k: int, n: int, weight):
    """``x[m, k] @ W[k, n]`` in bf16 with fp32 output; ``W`` bound as a constant if given."""
    from tvm import relax

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((m, k), "bfloat16"))
    w = relax.Var("w", relax.TensorType((k, n), "bfloat16"))
    with bb.function("main", [x, w]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.matmul(x, w, out_dtype="float32"))
        bb.emit_func_output(out)
    mod = bb.get()
    if weight is not None:
        mod["main"] = mod["main"].bind_params({"w": relax.const(weight, "bfloat16")})
    return mod


def bench_gemms(target, args, peaks: dict[str, float]) -> None:
    """bf16 GEMMs: weight pre-packed at compile time, and both operands at run time."""
    shapes = [(1024, 1024, 1024), (257, 4096, 1024)]
    if not args.skip_large:
        shapes.insert(1, (4096, 4096, 4096))
    if args.shapes:
        shapes = [tuple(int(d) for d in s.split("x")) for s in args.shapes.split(",")]
    from tvmamp.schedules.cpu.bf16_common import bf16_dot_at_half_rate, has_amx_bf16

    # the AMX peak is 0 where the host has no AMX: the kernels are the vdpbf16ps ones then, or
    # fp32 FMAs on a CPU whose vdpbf16ps runs at half their rate (Intel's)
    amx = has_amx_bf16(target) and peaks.get("AMX tdpbf16ps", 0) > 0
    fma = not amx and bf16_dot_at_half_rate(target)
    # the C loops measure one core: the peak of ``threads`` cores is that many times it
    peak = peaks["AMX tdpbf16ps" if amx else "fp32 FMA" if fma else "vdpbf16ps"] * args.threads
    print(
        "\n| GEMM m x k x n (bf16 in, fp32 out) | tvmamp GFLOP/s | torch bf16 GFLOP/s "
        "| tvmamp / torch | % of peak | rel err |\n|---|---|---|---|---|---|"
    )
    for shape in shapes:
        for constant in (True, False):
            _gemm_row(shape, constant, target, args.repeat, peak)


def _gemm_row(shape, constant: bool, target, repeat: int, peak: float) -> None:
    """Time one GEMM against ``torch.mm`` on bf16 tensors and print its table row."""
    import ml_dtypes
    import numpy as np
    import torch
    import tvm

    from tvmamp.benchmark import max_rel_error, paired_medians

    m, k, n = shape
    rng = np.random.default_rng(0)
    a = rng.standard_normal((m, k)).astype(ml_dtypes.bfloat16)
    b = rng.standard_normal((k, n)).astype(ml_dtypes.bfloat16)
    ta, tb = (torch.from_numpy(v.astype("float32")).bfloat16() for v in (a, b))
    exe = _compile(_gemm_module(m, k, n, b if constant else None), target)
    inputs = [tvm.runtime.tensor(a)] + ([] if constant else [tvm.runtime.tensor(b)])
    err = max_rel_error(exe["main"](*inputs).numpy(), a.astype("float64") @ b.astype("float64"))
    repeat = max(3, repeat // (4 if m * n * k > 1 << 32 else 1))
    ours, ref = paired_medians([lambda: exe["main"](*inputs), lambda: torch.mm(ta, tb)], repeat)
    gflops = 2.0 * m * n * k / 1e9
    label = "W constant (packed at compile time)" if constant else "W at run time"
    print(
        f"| {m} x {k} x {n}, {label} | {gflops / ours:.1f} | {gflops / ref:.1f} "
        f"| {ref / ours:.2f} | {100 * gflops / ours / peak:.0f} | {err:.1e} |"
    )


def _compile(mod, target):
    """Schedule ``mod`` with tvmamp's CPU pipeline (no AMP pass) and return a VM."""
    import tvm
    from tvm import relax

    from tvmamp.pipeline import legalize_passes
    from tvmamp.schedules.cpu import cpu_schedule_passes
    from tvmamp.targets.llvm_lowering import tir_pipeline

    with target:
        mod = tvm.transform.Sequential([*legalize_passes(), *cpu_schedule_passes(target)])(mod)
    # tvmamp's TIR pipeline, as tvmamp.build uses: TVM's default one moves the register tiles
    # of a parallel kernel to the heap (2-thread GEMMs ran at a third of their speed)
    exe = tvm.compile(mod, target=target, tir_pipeline=tir_pipeline(target))
    return relax.VirtualMachine(exe, tvm.cpu())


def _autocast(net, x):
    import torch

    def run():
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            return net(x)

    return run


def bench_simplenet(target, args) -> None:
    """SimpleNet 9 x Linear(1024) at batch 256 and 1: tvmamp O2 bf16 vs fp32 and torch."""
    for batch in (256, 1):
        _simplenet_table(batch, target, args.repeat)


def _simplenet_table(batch: int, target, repeat: int) -> None:
    """Time SimpleNet at ``batch`` through tvmamp (O2 bf16, O0 fp32) and torch; print a table."""
    import copy

    import numpy as np
    import torch
    import tvm

    import tvmamp
    from tvmamp import models
    from tvmamp.benchmark import max_rel_error, paired_medians

    mod, params = models.simple_net(batch=batch)
    x = np.random.default_rng(1).standard_normal((batch, 1024)).astype("float32")
    fp32 = tvmamp.build(mod, "O0", target, params=params)
    bf16 = tvmamp.build(mod, "O2", target, "bfloat16", params=params)
    net = torch_simplenet(params, 9)
    net_bf16 = copy.deepcopy(net).to(torch.bfloat16)
    tx, tx16 = torch.from_numpy(x), torch.from_numpy(x).bfloat16()
    arg = [tvm.runtime.tensor(x)]
    fns = {
        "tvmamp O2 bf16": lambda: bf16.vm["main"](*arg),
        "tvmamp O0 fp32": lambda: fp32.vm["main"](*arg),
        "torch model.to(bfloat16)": lambda: net_bf16(tx16),
        "torch autocast bf16": _autocast(net, tx),
        "torch fp32": lambda: net(tx),
    }
    with torch.no_grad():
        times = paired_medians(list(fns.values()), repeat)
        err = max_rel_error(np.asarray(bf16(x)), net(tx).numpy())
    print(f"\nSimpleNet batch {batch} (tvmamp O2 bf16 max rel err {err:.1e})\n")
    _table(dict(zip(fns, times, strict=True)), "tvmamp O2 bf16")


def bench_convnet(target, args) -> None:
    """4 x (conv3x3 64ch + BN + ReLU) on 1x64x56x56: tvmamp O2 bf16 vs torch autocast."""
    import numpy as np
    import torch
    import tvm
    from tvm.relax.frontend.torch import from_exported_program

    import tvmamp
    from tvmamp.benchmark import max_rel_error, paired_medians

    torch.manual_seed(0)
    layers = []
    for _ in range(4):
        layers += [torch.nn.Conv2d(64, 64, 3, padding=1), torch.nn.BatchNorm2d(64)]
        layers += [torch.nn.ReLU()]
    net = torch.nn.Sequential(*layers).eval()
    for layer in net:
        if isinstance(layer, torch.nn.BatchNorm2d):
            layer.running_mean.normal_(0, 0.1)
            layer.running_var.uniform_(0.5, 1.5)
    x = torch.randn(1, 64, 56, 56)
    mod = from_exported_program(torch.export.export(net, (x,)), unwrap_unit_return_tuple=True)
    fp32 = tvmamp.build(mod, "O0", target)
    bf16 = tvmamp.build(mod, "O2", target, "bfloat16")
    arg = [tvm.runtime.tensor(x.numpy())]
    fns = {
        "tvmamp O2 bf16": lambda: bf16.vm["main"](*arg),
        "tvmamp O0 fp32": lambda: fp32.vm["main"](*arg),
        "torch autocast bf16": _autocast(net, x),
        "torch fp32": lambda: net(x),
    }
    with torch.no_grad():
        times = paired_medians(list(fns.values()), args.repeat)
        err = max_rel_error(np.asarray(bf16(x.numpy())), net(x).numpy())
    print(f"\nConvNet 4 x conv3x3 64ch + BN + ReLU, 1x64x56x56 (bf16 max rel err {err:.1e})\n")
    _table(dict(zip(fns, times, strict=True)), "tvmamp O2 bf16")


def _table(times: dict[str, float], ours: str) -> None:
    """Print a markdown table of median ms and the time relative to ``ours``."""
    print(f"| variant | median ms | time / {ours} |\n|---|---|---|")
    for name, sec in times.items():
        print(f"| {name} | {sec * 1e3:.2f} | {sec / times[ours]:.2f} |")


if __name__ == "__main__":
    main()
