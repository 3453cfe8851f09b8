"""Attention (``softmax(q k^T / sqrt(d) [+ mask]) v``) on the CPU: tvmamp O2 against torch.

Each shape is ``F.scaled_dot_product_attention`` imported with ``tvmamp.from_torch`` and built
at O2 bf16 twice: as ``tvmamp.build`` does (the scores GEMM and its softmax merged into one
kernel, ``relay_passes/gemm_softmax.py``, ragged keys padded to whole vectors where that pays,
``relay_passes/attention_keys.py``) and with the llvm target's fusion passes switched off and
no padding (two kernels, the fp32 scores written out and read back). torch runs the same call
in fp32 and in bf16 (its fused CPU attention). All variants are timed in one process with
``paired_medians``; the error of each against torch fp32 is printed beside its time.

Run: TVM_NUM_THREADS=1 python bench/bench_attention.py [--threads 1] [--repeat 15]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os

import numpy as np
import torch
import torch.nn.functional as F

import tvmamp
from tvmamp.benchmark import max_rel_error, paired_medians
from tvmamp.relay_passes import attention_keys
from tvmamp.targets import registry

# (name, batch, heads, query rows, keys, head dim, causal)
SHAPES = (
    ("TransformerEncoderLayer(512, 8)", 8, 8, 128, 128, 64, False),
    ("BERT-base, 128 tokens", 1, 12, 128, 128, 64, False),
    ("GPT-2, 128 tokens, causal", 1, 12, 128, 128, 64, True),
    ("512 tokens", 1, 8, 512, 512, 64, False),
    ("ViT-S/16, 197 tokens (not merged: 0.9 MiB of scores)", 1, 6, 197, 197, 64, False),
    ("ViT-B/16 at 384 px, 577 tokens (keys padded to 592)", 1, 12, 577, 577, 64, False),
    ("Whisper encoder, 1500 frames (keys padded to 1504)", 1, 6, 1500, 1500, 64, False),
)


class Attention(torch.nn.Module):
    def __init__(self, causal: bool):
        super().__init__()
        self.causal = causal

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)


@contextlib.contextmanager
def unmerged():
    """Build with the llvm target's fusion passes switched off and ragged keys left unpadded
    (the kernels before the merge)."""
    entry, padding = registry.REGISTRY["llvm"], attention_keys.MAX_KEY_PADDING
    registry.REGISTRY["llvm"] = dataclasses.replace(entry, fusion_passes=lambda target: [])
    attention_keys.MAX_KEY_PADDING = -1.0
    try:
        yield
    finally:
        registry.REGISTRY["llvm"] = entry
        attention_keys.MAX_KEY_PADDING = padding


def bench(shape, threads: int, repeat: int) -> list[str]:
    name, batch, heads, rows, keys, dim, causal = shape
    torch.manual_seed(0)
    q = torch.randn(batch, heads, rows, dim)
    k, v = (torch.randn(batch, heads, keys, dim) for _ in range(2))
    model = Attention(causal).eval()
    mod, _ = tvmamp.from_torch(model, (q, k, v))
    target = f"llvm -num-cores={threads}"
    merged = tvmamp.build(mod, "O2", target, dtype="bfloat16")
    with unmerged():
        two = tvmamp.build(mod, "O2", target, dtype="bfloat16")
    args = [np.ascontiguousarray(t.numpy()) for t in (q, k, v)]
    low = [t.bfloat16() for t in (q, k, v)]
    fns = {
        "tvmamp O2 (merged)": lambda: merged(*args),
        "tvmamp O2 (two kernels)": lambda: two(*args),
        "torch fp32": lambda: model(q, k, v),
        "torch bf16": lambda: model(*low),
    }
    with torch.inference_mode():
        ref = model(q, k, v).numpy()
        errors = {n: max_rel_error(_float32(fn()), ref) for n, fn in fns.items()}
        times = paired_medians(list(fns.values()), repeat=repeat)
    base = times[list(fns).index("torch bf16")]
    rows_out = [f"\n{name}: [{batch}, {heads}, {rows}, {dim}] x {keys} keys\n"]
    rows_out.append("| variant | ms | / torch bf16 | max rel err vs torch fp32 |")
    rows_out.append("|---|---|---|---|")
    for (variant, _), t in zip(fns.items(), times):
        rows_out.append(f"| {variant} | {t * 1e3:.3f} | {t / base:.2f} | {errors[variant]:.1e} |")
    return rows_out


def _float32(out) -> np.ndarray:
    out = out.float().numpy() if isinstance(out, torch.Tensor) else out
    return np.asarray(out, dtype="float32")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=int(os.environ.get("TVM_NUM_THREADS", 1)))
    parser.add_argument("--repeat", type=int, default=15)
    args = parser.parse_args()
    if os.environ.get("TVM_NUM_THREADS") != str(args.threads):
        parser.error(f"set TVM_NUM_THREADS={args.threads} (TVM reads it when it starts)")
    torch.set_num_threads(args.threads)
    for shape in SHAPES:
        print("\n".join(bench(shape, args.threads, args.repeat)))


if __name__ == "__main__":
    main()
