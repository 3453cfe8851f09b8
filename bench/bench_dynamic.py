"""Symbolic shapes on the CPU: dynamic-batch builds against static ones, and MoE layers.

- A Linear-GELU-Linear MLP and BERT-4L (``zoo_models``), each imported once with static
  shapes and once with ``from_torch(..., dynamic_batch=True)``, built at O2 bf16 and run at
  batch 1. The ratio is dynamic / static: what a symbolic batch costs. Errors are against
  torch fp32.
- Tiny mixture-of-experts language models from their Hugging Face configs (2 layers, hidden
  256, 8 experts, top-2, random weights, 128 tokens): each expert is a matmul over a run-time
  number of rows (``tvmamp/frontends/torch_moe.py``). Against torch autocast bf16, with each
  one's error against torch fp32.

All variants of a row are timed in one process with ``paired_medians``.

Run: TVM_NUM_THREADS=1 python bench/bench_dynamic.py [--threads 1] [--repeat 9]
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import torch
import tvm

import tvmamp
from tvmamp.benchmark import max_rel_error, paired_medians

sys.path.insert(0, os.path.dirname(__file__))
from zoo_models import ZOO, OutputOf  # noqa: E402

MOE = {
    "Mixtral": ("MixtralConfig", {"num_local_experts": 8}),
    "Qwen2-MoE": (
        "Qwen2MoeConfig",
        {"num_experts": 8, "moe_intermediate_size": 256, "shared_expert_intermediate_size": 512},
    ),
    "OLMoE": ("OlmoeConfig", {"num_experts": 8}),
    "Qwen3-MoE": ("Qwen3MoeConfig", {"num_experts": 8, "moe_intermediate_size": 256}),
}


def _tensors(xs):
    return [tvm.runtime.tensor(np.ascontiguousarray(x.numpy())) for x in xs]


def _mlp():
    torch.manual_seed(0)
    layers = [torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256)]
    return torch.nn.Sequential(*layers).eval(), [torch.randn(1, 64, 256)]


def _bert():
    entry = ZOO["bert"]
    return entry.build(), entry.inputs(100)


def dynamic_rows(repeat: int) -> None:
    print("| model | static | dynamic batch | dynamic / static | error static | error dynamic |")
    print("|---|---|---|---|---|---|")
    for name, make in (("MLP 256-1024-256, 64 tokens", _mlp), ("BERT-4L, 128 tokens", _bert)):
        model, xs = make()
        with torch.inference_mode():
            want = model(*xs).float().numpy()
        runs, outs = [], []
        for dynamic in (False, True):
            example = [torch.cat([x, x]) for x in xs] if dynamic else xs
            mod, params = tvmamp.from_torch(model, tuple(example), dynamic_batch=dynamic)
            exe = tvmamp.build(mod, "O2", "llvm", dtype="bfloat16", params=params)
            args = _tensors(xs)
            outs.append(np.asarray(exe(*[x.numpy() for x in xs]), dtype="float32"))
            runs.append(lambda exe=exe, args=args: exe.vm["main"](*args))
        static, dynamic = paired_medians(runs, repeat=repeat)
        errors = " | ".join(f"{max_rel_error(out, want):.1e}" for out in outs)
        print(
            f"| {name} | {static * 1e3:.3f} ms | {dynamic * 1e3:.3f} ms | "
            f"{dynamic / static:.2f} | {errors} |"
        )


def mixture_of_experts(repeat: int) -> None:
    import transformers

    print()
    print("| model | tvmamp O2 | torch autocast | O2 / autocast | error O2 | error autocast |")
    print("|---|---|---|---|---|---|")
    for name, (config_name, extra) in MOE.items():
        config = getattr(transformers, config_name)(
            vocab_size=32000,
            hidden_size=256,
            intermediate_size=1024,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_experts_per_tok=2,
            use_cache=False,
            **extra,
        )
        config._attn_implementation = "eager"
        torch.manual_seed(0)
        inner = transformers.AutoModel.from_config(config).eval()
        model = OutputOf(inner, "last_hidden_state", ("input_ids",)).eval()
        ids = torch.randint(0, 32000, (1, 128), generator=torch.Generator().manual_seed(1))
        with torch.inference_mode():
            want = model(ids).numpy()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                autocast = model(ids).float().numpy()
        mod, params = tvmamp.from_torch(model, (ids,))
        exe = tvmamp.build(mod, "O2", "llvm", dtype="bfloat16", params=params)
        got = np.asarray(exe(ids.numpy()), dtype="float32")
        args = _tensors([ids])

        def run_autocast(model=model, ids=ids):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                model(ids)

        with torch.inference_mode():
            ours, theirs = paired_medians(
                [lambda exe=exe, args=args: exe.vm["main"](*args), run_autocast], repeat=repeat
            )
        print(
            f"| {name} | {ours * 1e3:.2f} ms | {theirs * 1e3:.2f} ms | {ours / theirs:.2f} | "
            f"{max_rel_error(got, want):.1e} | {max_rel_error(autocast, want):.1e} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=int(os.environ.get("TVM_NUM_THREADS", 1)))
    parser.add_argument("--repeat", type=int, default=9)
    args = parser.parse_args()
    if os.environ.get("TVM_NUM_THREADS") != str(args.threads):
        parser.error(f"set TVM_NUM_THREADS={args.threads} (TVM reads it when it starts)")
    torch.set_num_threads(args.threads)
    dynamic_rows(args.repeat)
    mixture_of_experts(args.repeat)


if __name__ == "__main__":
    main()
