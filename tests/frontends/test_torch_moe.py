"""tvmamp.from_torch on mixture-of-experts layers: ``aten.histc`` and the grouped matmul
(``transformers::grouped_mm_fallback``, ``aten._grouped_mm``), which TVM's importer lacks.

Each against eager torch at O0 (exact to fp32 rounding) and O2 (bf16), with run-time group
sizes that differ from the ones the model was exported with: empty experts, one expert taking
every row, and rows past the last offset (zeros).
"""

import numpy as np
import pytest

import tvmamp
from tvmamp.frontends.common import UnsupportedOperatorError

torch = pytest.importorskip("torch")
nn = torch.nn

TARGET = "llvm -num-cores=1"
O0_TOL = 1e-5
O2_TOL = 3e-2


def _build(model, *xs, level):
    mod, params = tvmamp.from_torch(model, tuple(torch.from_numpy(x) for x in xs))
    return tvmamp.build(mod, level, TARGET, params=params)


def _close(got, want, level):
    tol = O0_TOL if level == "O0" else O2_TOL
    scale = max(float(np.abs(want).max()), 1.0)
    np.testing.assert_allclose(got, want, rtol=0, atol=tol * scale, err_msg=level)


class Histc(nn.Module):
    def __init__(self, bins, low, high):
        super().__init__()
        self.bins, self.low, self.high = bins, low, high

    def forward(self, x):
        return torch.histc(x, bins=self.bins, min=self.low, max=self.high)


@pytest.mark.parametrize(
    "bins, low, high",
    [(7, -1.5, 2.0), (4, 0.0, 3.0), (5, 0.0, 0.0)],  # (5, 0, 0): the data's own range
)
def test_histc_counts_like_torch(bins, low, high):
    rng = np.random.default_rng(bins)
    x = (rng.standard_normal((6, 9)) * 1.5).astype("float32")
    x[0, :4] = [high, low, -9.0, 9.0]  # edges count, values outside do not
    if bins == 4:  # expert ids, as a MoE layer counts them
        x = rng.integers(0, 4, (6, 9)).astype("float32")
    model = Histc(bins, low, high)
    want = model(torch.from_numpy(x)).numpy()
    for level in ("O0", "O2"):
        got = _build(model, x, level=level)(x)
        np.testing.assert_array_equal(got, want, err_msg=level)


class GroupedLinear(nn.Module):
    """The expert half of a Hugging Face MoE layer: rows sorted by expert, counted with
    ``histc``, then one grouped matmul over the experts' weights."""

    def __init__(self, experts, k, n, grouped_mm):
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.weight = nn.Parameter(torch.randn(experts, k, n, generator=generator) * 0.2)
        self.experts, self.grouped_mm = experts, grouped_mm

    def forward(self, x, ids):
        ids, order = torch.sort(ids)
        counts = torch.histc(ids.float(), bins=self.experts, min=0, max=self.experts - 1)
        offsets = torch.cumsum(counts, 0, dtype=torch.int32)
        out = self.grouped_mm(x[order], self.weight, offsets)
        return out[torch.argsort(order)]  # rows back in order: ties may sort either way


def _fallback(x, w, offs):
    pytest.importorskip("transformers.integrations.moe")
    return torch.ops.transformers.grouped_mm_fallback(x, w, offs)


def _aten(x, w, offs):
    # torch.export's shape function takes bf16 operands only, as Hugging Face passes them
    return torch._grouped_mm(x.bfloat16(), w.bfloat16(), offs=offs).float()


ROUTINGS = {
    "mixed": [3, 0, 0, 2, 3, 3, 0, 2, 3, 0, 1],
    "one expert": [1] * 11,
    "unrouted tail": [0, 2, 2, 1, 9, 9, 0, 1, 2, 2, 0],  # ids past the experts: zero rows
}


@pytest.mark.parametrize("grouped_mm", [_fallback, _aten], ids=["fallback", "aten"])
def test_grouped_matmul_with_run_time_group_sizes(grouped_mm):
    rng = np.random.default_rng(1)
    model = GroupedLinear(4, 24, 32, grouped_mm).eval()
    x = rng.standard_normal((11, 24)).astype("float32")
    mod, params = tvmamp.from_torch(model, (torch.from_numpy(x), torch.tensor(ROUTINGS["mixed"])))
    for level in ("O0", "O2"):
        exe = tvmamp.build(mod, level, TARGET, params=params)
        for name, routing in ROUTINGS.items():
            if name == "unrouted tail" and grouped_mm is _aten:
                continue  # torch's kernel leaves those rows unwritten
            ids = np.array(routing, dtype="int64")
            with torch.no_grad():
                want = model(torch.from_numpy(x), torch.from_numpy(ids)).numpy()
            _close(np.asarray(exe(x, ids)), want, "O2" if grouped_mm is _aten else level)


def test_group_sizes_past_the_bf16_integers():
    """601 rows for one expert: a count bf16 cannot hold (its integers stop at 256), so the
    counts and offsets must stay exact at O2."""
    model = GroupedLinear(4, 24, 32, _fallback).eval()
    rng = np.random.default_rng(6)
    x = rng.standard_normal((1203, 24)).astype("float32")
    ids = rng.integers(0, 4, 1203)
    ids[:601] = 1
    mod, params = tvmamp.from_torch(model, (torch.from_numpy(x), torch.from_numpy(ids)))
    with torch.no_grad():
        want = model(torch.from_numpy(x), torch.from_numpy(ids)).numpy()
    got = tvmamp.build(mod, "O2", TARGET, params=params)(x, ids)
    _close(np.asarray(got), want, "O2")


def test_other_grouped_matmul_forms_are_refused():
    """The batched form (3-D by 3-D, no offsets) is not a MoE layer's; it gets a clear error."""

    class Batched(nn.Module):
        def forward(self, x, w):
            return torch._grouped_mm(x.bfloat16(), w.bfloat16()).float()

    x, w = torch.randn(2, 6, 16), torch.randn(2, 16, 8)
    with pytest.raises(UnsupportedOperatorError, match=r"input \[S, K\], weight \[E, K, N\]"):
        tvmamp.from_torch(Batched(), (x, w))


def test_unsorted_topk():
    """``topk(sorted=False)`` (DeepSeek-V3's router), which TVM's importer refused: the same
    set of values and indices as torch, in some order."""

    def fn(x):
        values, indices = torch.topk(x, 3, dim=-1, sorted=False)
        picked = torch.gather(x, -1, indices)
        return torch.sort(values, dim=-1).values + torch.sort(picked, dim=-1).values

    x = np.random.default_rng(3).standard_normal((5, 11)).astype("float32")

    class Fn(nn.Module):
        def forward(self, x):
            return fn(x)

    want = Fn()(torch.from_numpy(x)).numpy()
    for level in ("O0", "O2"):
        _close(np.asarray(_build(Fn(), x, level=level)(x)), want, level)


MOE_CONFIGS = {
    "MixtralConfig": {"num_local_experts": 4},
    # a shared expert beside the routed ones; its sizes once made the VM fail to build
    "Qwen2MoeConfig": {
        "num_experts": 4,
        "moe_intermediate_size": 48,
        "shared_expert_intermediate_size": 96,
    },
}


@pytest.mark.parametrize("config_name", sorted(MOE_CONFIGS))
def test_moe_model_end_to_end(config_name):
    """A tiny MoE language model (2 layers, 4 experts, top-2) from its config, random weights,
    at O0 against eager torch."""
    transformers = pytest.importorskip("transformers")
    config = getattr(transformers, config_name)(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts_per_tok=2,
        use_cache=False,
        **MOE_CONFIGS[config_name],
    )
    torch.manual_seed(0)
    model = transformers.AutoModel.from_config(config).eval()

    class Hidden(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, ids):
            return self.inner(input_ids=ids).last_hidden_state

    wrapped = Hidden(model).eval()
    ids = np.random.default_rng(2).integers(0, 256, (1, 24)).astype("int64")
    with torch.no_grad():
        want = wrapped(torch.from_numpy(ids)).numpy()
    got = _build(wrapped, ids, level="O0")(ids)
    _close(np.asarray(got), want, "O0")
