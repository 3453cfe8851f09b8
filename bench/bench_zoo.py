"""The model zoo (bench/zoo_models.py) through tvmamp O0/O1/O2 against torch and onnxruntime.

For each model: import with ``tvmamp.from_torch``, build every level for the host, check each
against torch fp32 on ``--inputs`` random inputs (max abs error, normwise relative error, an
elementwise check, top-1 agreement), then time tvmamp O0/O1/O2, torch fp32, torch autocast,
torch ``model.to(low dtype)`` and onnxruntime fp32 interleaved in one process
(``tvmamp.benchmark.paired_medians``: each timed call follows 50 ms of untimed calls of the same
variant, so that the pool of the runtime timed before it has gone idle), once per thread count,
and profile the kernels of the
last level (``tvmamp.debugging.profile``: each kernel's time, share and % of the machine's
peak). ``--check-only`` builds and checks only: the robustness sweep. The thread count reaches
all three runtimes: ``TVM_NUM_THREADS``, ``torch.set_num_threads`` and onnxruntime's
``intra_op_num_threads``.

Each (model, thread count) runs in a worker subprocess, so that a crash (a segfault in a
kernel, an abort in LLVM) is recorded against the level being built or run, and the sweep goes
on with the other levels and models. The markdown goes to ``--out`` (bench/results/zoo.md),
replacing only this mode's section.

Run: python bench/bench_zoo.py [--check-only] [--models resnet50,bert] [--threads 1,2]
[--dtype bfloat16] [--inputs 8] [--repeat 10]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import platform
import re
import shlex
import subprocess
import sys
import tempfile
import time
from collections import deque
from pathlib import Path

from zoo_families import FAMILIES
from zoo_models import ZOO  # bench/ is on sys.path when run as a script
from zoo_transformers import TRANSFORMERS

# Every model bench_zoo runs: the zoo, the op-family models (``--models families``) and more
# Hugging Face architectures (``--models transformers``).
MODELS = {**ZOO, **FAMILIES, **TRANSFORMERS}
GROUPS = {"families": FAMILIES, "transformers": TRANSFORMERS}

HERE = Path(__file__).resolve().parent
SECTIONS = {True: "check", False: "timing"}
TORCH_LABELS = ("torch fp32", "torch autocast", "torch low", "onnxruntime fp32")


def log(msg: str) -> None:
    """Progress on stderr."""
    print(msg, file=sys.stderr, flush=True)


# ------------------------------------------------------------------ worker: one model, one T


class Events:
    """JSON lines that the worker appends and the parent reads, even after a crash."""

    def __init__(self, path: str):
        self.path = path

    def emit(self, kind: str, **data) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps({"kind": kind, **data}) + "\n")


def _first(out):
    """A model's single output as a float64 numpy array (tuples of one unwrapped)."""
    import numpy as np

    while isinstance(out, (tuple, list)) and len(out) == 1:
        out = out[0]
    if hasattr(out, "detach"):
        out = out.detach().float().numpy()
    return np.asarray(out, dtype=np.float64)


def accuracy(outs, refs, kind: str, tol: float) -> dict:
    """Errors of ``outs`` against the fp32 ``refs`` (lists of float64 arrays, one per input).

    ``elementwise`` is the fraction of elements with ``|out - ref| <= tol * (max|ref| + |ref|)``
    (atol scaled by the output's magnitude, rtol ``tol``); ``top1`` the fraction of inputs (of
    positions, for a language model) whose argmax equals fp32's.
    """
    import numpy as np

    res = dict(abs_err=0.0, rel_err=0.0, within=0, total=0, finite=True, shape_ok=True)
    hits = []
    for out, ref in zip(outs, refs):
        if out.shape != ref.shape:
            return dict(res, shape_ok=False, note=f"shape {out.shape} != torch {ref.shape}")
        scale = float(np.abs(ref).max()) or 1.0
        err = np.nan_to_num(np.abs(out - ref), nan=np.inf)
        res["finite"] &= bool(np.isfinite(out).all())
        res["abs_err"] = max(res["abs_err"], float(err.max()))
        res["rel_err"] = max(res["rel_err"], float(err.max()) / scale)
        res["within"] += int((err <= tol * (scale + np.abs(ref))).sum())
        res["total"] += err.size
        if kind != "encoder":
            hits.append((out.argmax(-1) == ref.argmax(-1)).reshape(-1))
    res["top1"] = float(np.concatenate(hits).mean()) if hits else None
    return res


def _torch_variants(model, low: str):
    """(label, callable on torch inputs) for torch fp32, autocast and ``model.to(low)``."""
    import copy

    import torch

    low_t = getattr(torch, low)
    low_model = copy.deepcopy(model).to(low_t).eval()

    def cast(xs):
        return [x.to(low_t) if x.is_floating_point() else x for x in xs]

    def autocast(*xs):
        with torch.autocast("cpu", dtype=low_t):
            return model(*xs)

    return [
        ("torch fp32", model),
        ("torch autocast", autocast),
        ("torch low", lambda *xs: low_model(*cast(xs))),
    ]


def _onnx_session(model, example, threads: int, workdir: str):
    """An onnxruntime fp32 session of ``model`` (exported with the TorchScript exporter)."""
    import onnxruntime as ort
    import torch

    path = os.path.join(workdir, "model.onnx")
    names = [f"input{i}" for i in range(len(example))]
    torch.onnx.export(model, tuple(example), path, dynamo=False, input_names=names)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    sess = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
    return lambda *xs: sess.run(None, {n: x.numpy() for n, x in zip(names, xs)})


def worker(args) -> None:
    """Build, check and (unless --check-only) time one model at one thread count."""
    import torch

    ev = Events(args.events)
    torch.set_num_threads(args.threads)
    entry = MODELS[args.model]
    ev.emit("step", step="torch model")
    model = entry.build()
    inputs = [entry.inputs(100 + i) for i in range(args.inputs)]
    with torch.inference_mode():
        refs = [_first(model(*x)) for x in inputs]
    variants = _torch_variants(model, args.dtype)
    baseline = {}
    variants = variants[:1] + check_variants(ev, variants[1:], inputs, refs, entry.kind, baseline)
    classes = "n/a"
    if entry.kind != "encoder":
        classes = len({int(i) for r in refs for i in r.reshape(-1, r.shape[-1]).argmax(-1)})
    ev.emit("ref", classes=classes, baseline=baseline, shape=list(refs[0].shape))
    ev.emit("step", step="import")
    try:
        mod, params = tvmamp_import(model, inputs[0])
    except Exception:  # any import failure is a result of the sweep, recorded with its text
        ev.emit("fail", level="all", step="import", error=_tb())
        return
    exes = {}
    for level in args.levels:
        exe = build_and_check(ev, entry, level, mod, params, inputs, refs, args)
        if exe is not None:
            exes[level] = exe
    if args.check_only or not exes:
        return
    with tempfile.TemporaryDirectory(prefix="zoo_onnx_") as tmp:
        ev.emit("step", step="onnx export")
        try:
            ort = [("onnxruntime fp32", _onnx_session(model, inputs[0], args.threads, tmp))]
        except Exception:  # an export failure leaves the other variants to time
            ev.emit("fail", level="onnxruntime fp32", step="onnx export", error=_tb())
            ort = []
        variants += check_variants(ev, ort, inputs, refs, entry.kind, baseline, tol=1e-5)
        ev.emit("ref", classes=classes, baseline=baseline, shape=list(refs[0].shape))
        time_variants(ev, exes, variants, inputs[0], args)


def _tb() -> str:
    import traceback

    return traceback.format_exc(limit=-8)


def check_variants(ev, variants, inputs, refs, kind, baseline, tol=1e-2) -> list:
    """Run each (label, fn) variant on every input, fill ``baseline[label]`` with its accuracy.

    A variant that raises (torch has no bf16 kernel for some ops) is reported and dropped.
    """
    import torch

    kept = []
    for label, fn in variants:
        try:
            with torch.inference_mode():
                outs = [_first(fn(*x)) for x in inputs]
        except Exception:  # recorded; the model is timed without this variant
            ev.emit("fail", level=label, step="run", error=_tb())
            continue
        baseline[label] = accuracy(outs, refs, kind, tol)
        kept.append((label, fn))
    return kept


def tvmamp_import(model, example):
    """``tvmamp.from_torch`` on the eval-mode model."""
    import tvmamp

    return tvmamp.from_torch(model, tuple(example))


def build_and_check(ev, entry, level, mod, params, inputs, refs, args):
    """Build ``level``, run it on every input and emit its accuracy.

    Returns the executable, or None after emitting the failure (exception text and step).
    """
    import tvmamp

    step = "build"
    try:
        ev.emit("step", step=step, level=level)
        start = time.perf_counter()
        exe = tvmamp.build(mod, level, args.target, dtype=args.dtype, params=params)
        seconds = time.perf_counter() - start
        step = "run"
        ev.emit("step", step=step, level=level)
        outs = [_first(exe(*[x.numpy() for x in xs])) for xs in inputs]
    except Exception:  # a failing level is a result of the sweep; the other levels go on
        ev.emit("fail", level=level, step=step, error=_tb())
        return None
    tol = 1e-5 if level == "O0" else 1e-2
    ev.emit("level", level=level, build_s=seconds, **accuracy(outs, refs, entry.kind, tol))
    return exe


def time_variants(ev, exes, variants, example, args) -> None:
    """Interleaved medians of every tvmamp level and torch/onnxruntime variant, one example."""
    import numpy as np
    import torch
    import tvm

    from tvmamp import debugging
    from tvmamp.benchmark import SETTLE_S, paired_medians

    dev = tvm.cpu()
    tensors = [tvm.runtime.tensor(np.ascontiguousarray(x.numpy()), dev) for x in example]
    fns = [(f"tvmamp {lv}", lambda e=e: e.vm["main"](*tensors)) for lv, e in exes.items()]
    fns += [(label, lambda fn=fn: fn(*example)) for label, fn in variants]
    ev.emit("step", step=f"timing {len(fns)} variants x {args.repeat} rounds")
    with torch.inference_mode():
        times = paired_medians([fn for _, fn in fns], repeat=args.repeat)
    ms = {label: t * 1e3 for (label, _), t in zip(fns, times)}
    ev.emit("times", ms=ms, settle_s=SETTLE_S)
    last = list(exes)[-1]
    ev.emit("step", step=f"kernel profile {last}")
    prof = debugging.profile(exes[last], tensors)
    top = [dataclasses.asdict(r) for r in prof.records[:3]]
    flagged = [dataclasses.asdict(r) for r in prof.flagged]
    ev.emit("kernels", level=last, top=top, count=len(prof.records), flagged=flagged)


# ------------------------------------------------------------------ parent: run the workers


def run_worker(name: str, threads: int, levels: list[str], args) -> list[dict]:
    """Run one worker, echo its progress, return its events plus a crash event if it died."""
    fd, events = tempfile.mkstemp(prefix=f"zoo_{name}_", suffix=".jsonl")
    os.close(fd)
    cmd = [sys.executable, "-W", "ignore", str(Path(__file__)), "--worker", "--model", name]
    cmd += ["--threads", str(threads), "--levels", ",".join(levels), "--events", events]
    cmd += ["--inputs", str(args.inputs), "--repeat", str(args.repeat), "--dtype", args.dtype]
    cmd += ["--target", args.target]
    cmd += ["--check-only"] if args.check_only else []
    env = dict(os.environ, TVM_NUM_THREADS=str(threads), PYTHONWARNINGS="ignore")
    tail: deque[str] = deque(maxlen=40)
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True, cwd=HERE)
    for line in proc.stderr:
        tail.append(line.rstrip())
    try:
        rc = proc.wait(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = "timeout"
    with open(events) as f:
        out = [json.loads(line) for line in f if line.strip()]
    os.unlink(events)
    if rc != 0:
        last = next((e for e in reversed(out) if e["kind"] == "step"), {"step": "start"})
        sig = f"signal {-rc}" if isinstance(rc, int) and rc < 0 else f"exit {rc}"
        out.append(
            dict(
                kind="fail",
                level=last.get("level", "all"),
                step=last["step"],
                error=f"worker died ({sig})\n" + "\n".join(tail),
            )
        )
    return out


def sweep_model(name: str, threads: int, args) -> dict:
    """All levels of one model at one thread count; a crashed level is retried without it."""
    result = dict(model=name, threads=threads, levels={}, fails=[])
    todo = list(args.levels)
    while todo:
        start = time.perf_counter()
        events = run_worker(name, threads, todo, args)
        for e in events:
            if e["kind"] == "step":
                log(f"[{name} T={threads}] {e['step']} {e.get('level', '')}".rstrip())
            elif e["kind"] == "level":
                result["levels"][e["level"]] = e
                log(
                    f"[{name} T={threads}] {e['level']}: {verdict(e, result)} "
                    f"(rel err {e['rel_err']:.1e}, top-1 {_pct(e.get('top1'))})"
                )
            elif e["kind"] == "fail":
                result["fails"].append(e)
                log(
                    f"[{name} T={threads}] FAILED {e['level']} at {e['step']}: "
                    f"{e['error'].strip().splitlines()[-1]}"
                )
            else:  # ref, times, kernels
                result[e["kind"]] = e
        log(f"[{name} T={threads}] worker done in {time.perf_counter() - start:.0f} s")
        dead = {e["level"] for e in events if e["kind"] == "fail" and "died" in e["error"]}
        done = set(result["levels"]) | {f["level"] for f in result["fails"]}
        if "all" in dead or not dead:
            break
        todo = [lv for lv in todo if lv not in done]
    return result


def verdict(level: dict, result: dict) -> str:
    """ok / suspect / WRONG for one level, against fp32 and torch autocast's own error.

    fp32 (O0) must match torch within 1e-4 (normwise); a low-precision level is ok within
    max(3e-2, 3x torch autocast's error), suspect up to 0.3, WRONG beyond (or non-finite).
    """
    if not level.get("shape_ok", True):
        return "WRONG (" + level["note"] + ")"
    if not level["finite"]:
        return "WRONG (non-finite outputs)"
    err = level["rel_err"]
    if level["level"] == "O0":
        return "ok" if err <= 1e-4 else f"WRONG (fp32 rel err {err:.1e})"
    auto = result.get("ref", {}).get("baseline", {}).get("torch autocast", {}).get("rel_err", 0)
    if err <= max(3e-2, 3 * auto):
        return "ok"
    return f"suspect ({err:.1e})" if err <= 0.3 else f"WRONG (rel err {err:.1e})"


# ------------------------------------------------------------------ markdown


def _pct(x) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def check_rows(res: dict) -> list[str]:
    """Accuracy rows of one model: one per level, failures included."""
    name, ref = res["model"], res.get("ref", {})
    base = ref.get("baseline", {})
    auto = base.get("torch autocast", {}).get("rel_err")
    low = base.get("torch low", {}).get("rel_err")
    yard = " / ".join("n/a" if e is None else f"{e:.1e}" for e in (auto, low))
    rows = []
    for f in res["fails"]:
        if f["level"] in ("all", "onnxruntime") or f["level"] not in res["levels"]:
            what = "CRASH" if "died" in f["error"] else "ERROR"
            last = f["error"].strip().splitlines()[-1].replace("|", "\\|")[:160]
            rows.append(
                f"| {name} | {f['level']} | **{what} at {f['step']}**: {last} | | | | | | {yard} |"
            )
    for lv, e in sorted(res["levels"].items()):
        within = e["within"] / e["total"] if e.get("total") else None
        rows.append(
            f"| {name} | {lv} | {verdict(e, res)} | {e['build_s']:.0f} | {e['abs_err']:.2e} "
            f"| {e['rel_err']:.2e} | {_pct(within)} | {_pct(e.get('top1'))} "
            f"| {ref.get('classes', '')} | {yard} |"
        )
    return rows


CHECK_HEAD = [
    "| model | level | result | build s | max abs err | max rel err | elementwise ok "
    "| top-1 = fp32 | fp32 classes | torch autocast / low rel err |",
    "|---|---|---|---|---|---|---|---|---|---|",
]
LEVEL_COLS = ("tvmamp O0", "tvmamp O1", "tvmamp O2")


def _ratio(ms: dict, a: str, b: str) -> str:
    return f"{ms[a] / ms[b]:.2f}" if a in ms and b in ms else "-"


def timing_rows(results: list[dict]) -> list[str]:
    """One row per model: medians in ms, then same-run ratios and the worst O2 kernel."""
    rows, speedups = [], []
    for res in results:
        ms = res.get("times", {}).get("ms", {})
        if not ms:
            rows.append(f"| {res['model']} | " + " | ".join(["-"] * 11) + " |")
            continue
        cells = [f"{ms[c]:.2f}" if c in ms else "-" for c in LEVEL_COLS + TORCH_LABELS]
        cells += [_ratio(ms, "tvmamp O2", b) for b in ("onnxruntime fp32", "tvmamp O1")]
        cells.append(_ratio(ms, "tvmamp O2", "torch autocast"))
        if "tvmamp O2" in ms and "onnxruntime fp32" in ms:
            speedups.append(ms["onnxruntime fp32"] / ms["tvmamp O2"])
        kern = res.get("kernels", {}).get("top") or []
        if kern:
            cells.append(f"`{kern[0]['name']}` {kern[0]['ms']:.2f} ms ({kern[0]['share']:.0%})")
        rows.append(f"| {res['model']} | " + " | ".join(cells) + " |")
    if speedups:
        geo = math.exp(sum(math.log(x) for x in speedups) / len(speedups))
        rows.append(
            f"| geomean of onnxruntime time / O2 time over {len(speedups)} models "
            f"(> 1: O2 faster): **{geo:.2f}x** | " + " | ".join([""] * 11) + " |"
        )
    return rows


def kernel_lines(results: list[dict]) -> list[str]:
    """The three slowest kernels of each model's last level, with calls and argument shapes."""
    lines = []
    for res in results:
        kern = res.get("kernels") or {}
        for k in kern.get("top", []):
            if "shapes" not in k:
                return []  # results from before the shapes were recorded
            shapes = " ".join("x".join(map(str, s)) or "scalar" for s in k["shapes"])
            rate = ""
            if k.get("efficiency") is not None:
                rate = f", {k['efficiency']:.0%} of the {k['bound']}-bound peak"
            lines.append(
                f"- {res['model']} {kern['level']}: `{k['name']}` {k['ms']:.2f} ms "
                f"({k['share']:.0%}, {k['calls']} call(s)){rate}, arguments {shapes}"
            )
    for res in results:
        kern = res.get("kernels") or {}
        slow = [k for k in kern.get("flagged", []) if k["share"] >= 0.01]
        if slow:
            named = ", ".join(
                f"`{k['name']}` ({k['share']:.0%} of the time, {k['efficiency']:.1%} of peak)"
                for k in slow
            )
            lines.append(f"- {res['model']} {kern['level']}: below 10% of peak: {named}")
    head = "Slowest kernels (tvmamp.debugging.profile: VM instrumentation, one call):"
    return [head, "", *lines, ""] if lines else []


def timing_head(low: str) -> list[str]:
    short = {"bfloat16": "bf16", "float16": "fp16"}[low]
    cols = [
        "tvmamp O0 fp32",
        f"tvmamp O1 {short}",
        f"tvmamp O2 {short}",
        "torch fp32",
        f"torch autocast {short}",
        f"torch `.to({short})`",
        "onnxruntime fp32",
    ]
    return [
        "| model | " + " | ".join(f"{c} ms" for c in cols) + " | O2 / ort | O2 / O1 "
        "| O2 / autocast | worst O2 kernel (share) |",
        "|---|" + "---|" * 11,
    ]


def failure_notes(results: list[dict]) -> list[str]:
    """The full error text of every distinct failure of each model, with where it happened."""
    by_text: dict[tuple[str, str], list[str]] = {}
    for res in results:
        for f in res["fails"]:
            where = f"{f['level']} (at {f['step']}, {res['threads']} thread(s))"
            by_text.setdefault((res["model"], f["error"].strip()), []).append(where)
    notes = []
    for (model, text), where in by_text.items():
        notes += [f"**{model}**: {', '.join(where)}:", "", "```", text, "```", ""]
    return notes


def header(args, meta: dict) -> list[str]:
    """Date, CPU, versions, load and the command of the run."""
    import onnxruntime
    import torch
    import tvm

    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    cpu = re.search(r"Model name:\s*(.+)", lscpu)
    return [
        f"Date {meta['date']} UTC; CPU {cpu.group(1).strip() if cpu else platform.processor()} "
        f"({os.cpu_count()} vCPUs); torch {torch.__version__}, onnxruntime "
        f"{onnxruntime.__version__}, apache-tvm {tvm.__version__}; target `{args.target}`, "
        f"low dtype {args.dtype}; {args.inputs} random inputs per model; load average "
        f"(1/5/15 min) at start {meta['load_start']}, at end {meta['load_end']}.",
        "",
        f"`{meta['command']}`",
        "",
    ]


def _load() -> str:
    return " / ".join(f"{x:.2f}" for x in os.getloadavg())


def section(args) -> str:
    """The section of the markdown this run replaces: one per mode, dtype and target."""
    key = SECTIONS[args.check_only]
    if (args.dtype, args.target) != ("bfloat16", "llvm"):
        key += f" {args.dtype} {args.target}"
    return key


def write_section(path: Path, mode: str, lines: list[str]) -> None:
    """Replace this mode's section of ``path`` (between its markers), keeping the others."""
    begin, end = f"<!-- zoo:{mode} -->", f"<!-- /zoo:{mode} -->"
    text = (
        path.read_text()
        if path.exists()
        else "# Model zoo: tvmamp against torch and onnxruntime\n\n"
    )
    block = "\n".join([begin, *lines, end])
    if begin in text:
        text = text[: text.index(begin)] + block + text[text.index(end) + len(end) :]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    path.write_text(text)


def report(args, results_by_t: dict, meta: dict) -> list[str]:
    """The markdown section for this run."""
    title = "Robustness sweep (--check-only)" if args.check_only else "Timing"
    if section(args) != SECTIONS[args.check_only]:
        title += f", {args.dtype}, target `{args.target}`"
    lines = [f"## {title}", ""] + header(args, meta)
    for t, results in results_by_t.items():
        lines += [f"### Accuracy against torch fp32, {t} thread(s)", ""] + CHECK_HEAD
        lines += [row for res in results for row in check_rows(res)] + [""]
        if not args.check_only:
            settle = {r.get("times", {}).get("settle_s") for r in results} - {None}
            how = "interleaved" + (
                f", {1e3 * max(settle):.0f} ms of untimed calls before each timed one"
                if settle
                else ""
            )
            lines += [f"### Median ms per batch-1 call, {t} thread(s), same run ({how})", ""]
            lines += timing_head(args.dtype) + timing_rows(results) + [""]
            lines += kernel_lines(results)
    notes = failure_notes([r for rs in results_by_t.values() for r in rs])
    return lines + (["### Failures", ""] + notes if notes else [])


def parse_args(argv=None):
    """Command line of the parent and of the worker."""
    cpus = os.cpu_count() or 1
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--models",
        default=",".join(ZOO),
        help="comma-separated: "
        + ",".join(MODELS)
        + "; 'families' for all of "
        + ",".join(FAMILIES)
        + "; 'transformers' for all of "
        + ",".join(TRANSFORMERS),
    )
    p.add_argument("--levels", default="O0,O1,O2")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    p.add_argument("--threads", default=",".join(dict.fromkeys(["1", str(cpus)])))
    p.add_argument("--check-only", action="store_true", help="build and check accuracy only")
    p.add_argument("--inputs", type=int, default=8, help="random inputs for the accuracy check")
    p.add_argument("--repeat", type=int, default=10, help="interleaved timing rounds")
    p.add_argument("--target", default="llvm")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per worker")
    p.add_argument("--out", default=str(HERE / "results" / "zoo.md"))
    p.add_argument("--report-from", help="rewrite the markdown from a raw results JSON")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--events", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.levels = [lv.strip() for lv in args.levels.split(",") if lv.strip()]
    return args


def main() -> None:
    """Sweep the models (parent) or run one model (worker)."""
    args = parse_args()
    if args.worker:
        args.threads = int(args.threads)
        worker(args)
        return
    if args.report_from:
        saved = json.loads(Path(args.report_from).read_text())
        results_by_t = {int(t): rs for t, rs in saved.pop("results").items()}
    else:
        saved, results_by_t = sweep(args)
    lines = report(args, results_by_t, saved)
    write_section(Path(args.out), section(args), lines)
    print("\n".join(lines))


def sweep(args) -> tuple[dict, dict]:
    """Every model at every thread count; the raw results are saved as they come."""
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    names = [m for n in names for m in GROUPS.get(n, [n])]
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        raise ValueError(
            f"bench_zoo: models {unknown} are not in the zoo: {', '.join(MODELS)} (or "
            f"{' or '.join(GROUPS)})"
        )
    threads = [int(t) for t in args.threads.split(",")]
    if args.check_only:
        threads = threads[:1]
    meta = dict(
        command=f"python bench/{Path(sys.argv[0]).name} "
        + " ".join(map(shlex.quote, sys.argv[1:])),
        date=f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M}",
        load_start=_load(),
    )
    raw = (
        Path(tempfile.gettempdir()) / f"bench_zoo_{re.sub(r'[^a-z0-9]+', '_', section(args))}.json"
    )
    results_by_t: dict[int, list] = {}
    for t in threads:
        results_by_t[t] = []
        for name in names:
            results_by_t[t].append(sweep_model(name, t, args))
            meta["load_end"] = _load()
            raw.write_text(json.dumps(dict(meta, results=results_by_t)))
    log(f"raw results in {raw} (rewrite the markdown with --report-from {raw})")
    return meta, results_by_t


if __name__ == "__main__":
    main()
