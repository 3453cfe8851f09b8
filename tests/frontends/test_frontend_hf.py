"""Hugging Face transformers (random weights, tiny configs, no downloads) through from_torch.

GPT-2 and Llama are decoders with causal masks; GPT-2 keeps its default ``use_cache=True``, so
its KV cache starts as ``torch.tensor([])`` and is concatenated to the 4-D keys (the legacy
``torch.cat`` rule that TVM's importer did not follow). BERT is the encoder baseline.
"""

import numpy as np
import pytest

import tvmamp
from tvmamp.frontends import from_torch

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TARGET = "llvm -num-cores=1"
VOCAB, HIDDEN, LAYERS, HEADS, SEQ = 100, 64, 2, 4, 8


def gpt2():
    config = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_positions=32,
        n_embd=HIDDEN,
        n_layer=LAYERS,
        n_head=HEADS,
        bos_token_id=0,
        eos_token_id=0,
    )
    return transformers.GPT2LMHeadModel(config)


def llama():
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS // 2,  # grouped-query attention
        max_position_embeddings=32,
        use_cache=False,
    )
    return transformers.LlamaForCausalLM(config)


def bert():
    config = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        max_position_embeddings=32,
    )
    return transformers.BertModel(config)


class Logits(torch.nn.Module):
    """The first output (logits, or BERT's last hidden state) of a Hugging Face model."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask):
        return self.model(input_ids=input_ids, attention_mask=attention_mask)[0]


def _model(factory):
    torch.manual_seed(0)
    model = factory()
    model.config._attn_implementation = "eager"
    return Logits(model.eval())


def _inputs(pad):
    rng = np.random.default_rng(20261123)
    ids = rng.integers(0, VOCAB, size=(2, SEQ)).astype("int64")
    mask = np.ones((2, SEQ), "int64")
    mask[1, :pad] = 0  # left padding in the second sequence
    return {"input_ids": ids, "attention_mask": mask}


def _eager(model, inputs):
    with torch.no_grad():
        return model(**{k: torch.from_numpy(v) for k, v in inputs.items()}).numpy()


@pytest.fixture(scope="module", params=[gpt2, llama, bert], ids=lambda f: f.__name__)
def imported(request):
    """``(name, model, mod, params)``: the model imported once for the tests below."""
    model = _model(request.param)
    mod, params = from_torch(model, _inputs(pad=0))
    return request.param.__name__, model, mod, params


def test_imports_and_matches_torch_in_fp32(imported):
    _name, model, mod, params = imported
    assert [p.name for p in mod["main"].params][:2] == ["input_ids", "attention_mask"]
    # tied weights (GPT-2's lm_head and wte) keep both names
    assert set(params) == {n for n, _ in model.named_parameters(remove_duplicate=False)}
    exe = tvmamp.build(mod, "O0", TARGET, params=params)
    for pad in (0, 3):  # the padding mask reaches the attention, not only the shapes
        inputs = _inputs(pad)
        out = exe(*inputs.values())
        np.testing.assert_allclose(out, _eager(model, inputs), rtol=1e-4, atol=1e-4)


def test_builds_at_o2_bf16_within_bf16_tolerance(imported):
    _name, model, mod, params = imported
    inputs = _inputs(pad=0)
    out = tvmamp.build(mod, "O2", TARGET, dtype="bfloat16", params=params)(*inputs.values())
    want = _eager(model, inputs)
    # bf16 keeps 8 bits of mantissa; logits are O(1) after two layers
    np.testing.assert_allclose(out, want, rtol=5e-2, atol=5e-2)
    assert np.abs(out - want).mean() < 1e-2


def test_left_padded_batch_at_o2_bf16_is_finite():
    model = _model(llama)
    mod, params = from_torch(model, _inputs(pad=0))
    exe = tvmamp.build(mod, "O2", TARGET, dtype="bfloat16", params=params)
    inputs = _inputs(pad=3)
    out = exe(*inputs.values())
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, _eager(model, inputs), rtol=5e-2, atol=5e-2)


def test_a_model_returning_its_kv_cache_gets_a_hint():
    torch.manual_seed(0)
    model = gpt2().eval()  # called directly, it returns its KV cache
    ids = _inputs(pad=0)["input_ids"]
    with torch.no_grad():
        cache = model(input_ids=torch.from_numpy(ids)).past_key_values
    if not isinstance(cache, transformers.Cache):
        pytest.skip("this transformers returns the KV cache as tensors, which torch.export takes")
    with pytest.raises(RuntimeError, match=r"use_cache = False"):
        from_torch(model, {"input_ids": ids})


class IdsOnly(torch.nn.Module):
    """A decoder called with token ids alone: it makes its own mask and position ids (cumsum)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids)[0]


@pytest.mark.parametrize("factory", [gpt2, llama], ids=lambda f: f.__name__)
def test_decoder_called_with_ids_only_builds_at_o2_bf16(factory):
    torch.manual_seed(0)
    model = factory()
    model.config._attn_implementation = "eager"
    model.config.use_cache = False
    model = IdsOnly(model.eval())
    ids = _inputs(pad=0)["input_ids"]
    mod, params = from_torch(model, (ids,))
    with torch.no_grad():
        want = model(torch.from_numpy(ids)).numpy()
    out = tvmamp.build(mod, "O2", TARGET, dtype="bfloat16", params=params)(ids)
    np.testing.assert_allclose(out, want, rtol=5e-2, atol=5e-2)
