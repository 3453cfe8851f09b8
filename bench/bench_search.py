"""Precision search across the model suite: O1, O2 and the searched plan, measured in one run.

For each model: error on the calibration inputs and on held-out inputs (max relative output
error against the fp32 build), and single-thread latency, all timed interleaved.

The classifiers (ResNet-18, MobileNetV2) are judged by top-1 agreement with fp32 on 16 images
(``--top1-budget``, 0 = every arg-max class kept); the other models by the output budget.

Run: TVM_NUM_THREADS=1 python bench/bench_search.py [--models simplenet,transformer,...]
     [--dtype bfloat16] [--budget 5e-3] [--top1-budget 0] [--time-limit 300]
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

import tvmamp
from tvmamp import models
from tvmamp.benchmark import paired_medians
from tvmamp.search import ErrorBudget

TARGET = "llvm -num-cores=1"


def _builtin(name, make, shape_of):
    def load(seed):
        mod, params = make()
        shape = shape_of(mod)
        rng = np.random.default_rng(seed)
        return mod, params, [rng.standard_normal(shape).astype("float32") for _ in range(8)]

    return load


def _suite(name, **kwargs):
    def load(seed):
        from tvmamp import suite

        mod, params = suite.load(name, **kwargs)
        samples = [suite.example_inputs(name, seed=seed + i, **kwargs)[0] for i in range(16)]
        return mod, params, samples

    return load


def _shape(mod):
    from tvmamp.tensors import static_shape

    return static_shape(mod["main"].params[0].ty)


MODELS = {
    "simplenet": _builtin("simplenet", lambda: models.simple_net(batch=64), _shape),
    "convnet": _builtin("convnet", lambda: models.conv_net(batch=1, channels=32, size=32), _shape),
    "transformer": _builtin("transformer", models.transformer_layer, _shape),
    "transformer_l": _builtin(
        "transformer_l", lambda: models.transformer_layer(batch=4, seq=128, dim=256), _shape
    ),
    "overflow(fp16)": _builtin("overflow", models.overflow_net, _shape),
    "resnet18": _suite("resnet18", batch=1, image_size=64),
    "mobilenet_v2": _suite("mobilenet_v2", batch=1, image_size=64),
}


CLASSIFIERS = ("resnet18", "mobilenet_v2")


def run_model(name, load, dtype, budget, time_limit):
    """One table row per level: (level, calib err, held-out err, ms)."""
    mod, params, samples = load(seed=3)
    dtype = "float16" if "fp16" in name else dtype
    n_held = len(samples) // 4
    calib, held = samples[:-n_held], samples[-n_held:]
    start = time.perf_counter()
    plan = tvmamp.search_precision(
        mod,
        samples,
        TARGET,
        dtype,
        budget,
        params,
        time_limit_s=time_limit,
        holdout=n_held / len(samples),
        progress=False,
    )
    search_s = time.perf_counter() - start
    ref = tvmamp.build(mod, "O0", TARGET, params=params)
    exes = {
        "O1": tvmamp.build(mod, "O1", TARGET, dtype, params),
        "O2": tvmamp.build(mod, "O2", TARGET, dtype, params),
        "O3": tvmamp.build(mod, "O3", TARGET, dtype, params),
        "plan": tvmamp.build(mod, target=TARGET, params=params, plan=plan),
        "fp32": ref,
    }
    times = paired_medians([lambda e=e: e(calib[0]) for e in exes.values()], repeat=15)
    rows = []
    for (level, exe), t in zip(exes.items(), times):
        err = budget.measure([ref(x) for x in calib], [exe(x) for x in calib])
        held_err = budget.measure([ref(x) for x in held], [exe(x) for x in held])
        rows.append((level, err, held_err, t * 1e3))
    return dtype, plan, search_s, rows


def main() -> None:
    """Print one block per model."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--budget", type=float, default=5e-3)
    parser.add_argument("--top1-budget", type=float, default=0.0)
    parser.add_argument("--time-limit", type=float, default=300.0)
    args = parser.parse_args()
    os.environ.setdefault("TVM_NUM_THREADS", "1")
    print(
        f"budget: max relative output error {args.budget:g}, classifiers top-1 changes "
        f"{args.top1_budget:g}; one thread; target {TARGET}"
    )
    print(
        f"{'model':<16} {'dtype':<9} {'level':<5} {'calib err':>10} {'held err':>10} "
        f"{'ms':>9} {'fp32 nodes':>10}"
    )
    for name in args.models.split(","):
        budget = (
            ErrorBudget(args.top1_budget, "top1")
            if name in CLASSIFIERS
            else ErrorBudget(args.budget)
        )
        dtype, plan, search_s, rows = run_model(
            name, MODELS[name], args.dtype, budget, args.time_limit
        )
        for level, err, held, ms in rows:
            extra = f"{len(plan.fp32_nodes)}/{len(plan.node_dtypes)}" if level == "plan" else ""
            print(
                f"{name:<16} {dtype:<9} {level:<5} {err:>10.2e} {held:>10.2e} {ms:>9.3f} "
                f"{extra:>10}"
            )
        print(
            f"{name:<16} search took {search_s:.0f} s, {plan.metrics['builds']} builds; "
            f"metric {budget.name}; plans compared (ms): {plan.metrics.get('compared_ms')}"
        )


if __name__ == "__main__":
    main()
