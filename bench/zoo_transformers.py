"""Hugging Face architectures for bench/bench_zoo.py beyond the zoo's BERT, GPT-2 and ViT.

Each is built from its ``transformers`` config with random weights (seeded, no downloads),
4 layers of width 384 where the architecture allows, eager attention, and its
``last_hidden_state`` compared as an "encoder" output. They cover what the zoo's three do not:
rotary embeddings and grouped-query attention (Llama, Qwen2, Mistral, Gemma), RMSNorm (T5,
Llama), relative position buckets (T5), ALiBi (BLOOM), partial rotary (GPT-NeoX, Phi),
Falcon's parallel attention and MLP, shifted windows (Swin), efficient attention with a
reduced key sequence (SegFormer), CLIP's quick GELU, a conv feature extractor with group
norm and a positional conv (wav2vec 2.0), and long sequences (Whisper's encoder: 1500
frames).

Mixture-of-experts models (Mixtral, Qwen2-MoE with its shared expert, DeepSeek-V3 with its
latent attention and unsorted top-k) have 8 experts, 2 a token: transformers (5.x) runs the
experts with ``aten.histc`` and its ``grouped_mm_fallback`` op, which
``tvmamp/frontends/torch_moe.py`` imports as one matmul per expert over a run-time number of
rows.

``python bench/bench_zoo.py --models transformers`` runs them all.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from zoo_models import MASKED, OutputOf, ZooModel, _hf, _image, _tokens

_WIDTH = dict(hidden_size=384, num_hidden_layers=4, num_attention_heads=6, intermediate_size=1536)
_DECODER = dict(vocab_size=32000, num_key_value_heads=2, **_WIDTH)


def _features(shape: tuple[int, ...], scale: float) -> Callable[[int], tuple]:
    """Random features (a log-mel spectrogram, a waveform) of ``shape``."""

    def make(seed: int) -> tuple:
        gen = torch.Generator().manual_seed(seed)
        return (scale * torch.randn(shape, generator=gen),)

    return make


def _encoder(name, config, model, seed, inputs, names=("input_ids",), **kwargs) -> ZooModel:
    build = _hf(config, model, "last_hidden_state", seed, names, **kwargs)
    return ZooModel(name, build, inputs, 1, "encoder")


def _whisper_encoder(seed: int):
    def build():
        import transformers

        torch.manual_seed(seed)
        config = transformers.WhisperConfig(
            d_model=384, encoder_layers=4, encoder_attention_heads=6, encoder_ffn_dim=1536
        )
        config._attn_implementation = "eager"
        encoder = transformers.WhisperModel(config).get_encoder()
        return OutputOf(encoder.eval(), "last_hidden_state", ("input_features",)).eval()

    return build


_TOKENS = _tokens(128, 32000)
_BERT_TOKENS = _tokens(128, 30522)
TRANSFORMERS = {
    m.name: m
    for m in (
        _encoder("llama", "LlamaConfig", "LlamaModel", 40, _TOKENS, **_DECODER),
        _encoder("qwen2", "Qwen2Config", "Qwen2Model", 41, _TOKENS, **_DECODER),
        _encoder("mistral", "MistralConfig", "MistralModel", 42, _TOKENS, **_DECODER),
        _encoder(
            "gemma",
            "GemmaConfig",
            "GemmaModel",
            43,
            _TOKENS,
            head_dim=64,
            **{**_DECODER, "num_key_value_heads": 1},
        ),
        _encoder(
            "falcon",
            "FalconConfig",
            "FalconModel",
            44,
            _TOKENS,
            vocab_size=32000,
            hidden_size=384,
            num_hidden_layers=4,
            num_attention_heads=6,
        ),
        _encoder(
            "t5_encoder",
            "T5Config",
            "T5EncoderModel",
            45,
            _TOKENS,
            d_model=384,
            d_kv=64,
            d_ff=1536,
            num_layers=4,
            num_heads=6,
        ),
        _encoder(
            "distilbert",
            "DistilBertConfig",
            "DistilBertModel",
            46,
            _tokens(128, 30522, pad=16),
            MASKED,
            dim=384,
            n_layers=4,
            n_heads=6,
            hidden_dim=1536,
        ),
        _encoder("roberta", "RobertaConfig", "RobertaModel", 47, _tokens(128, 50265), **_WIDTH),
        _encoder(
            "albert",
            "AlbertConfig",
            "AlbertModel",
            48,
            _tokens(128, 30000),
            embedding_size=128,
            **_WIDTH,
        ),
        _encoder(
            "opt",
            "OPTConfig",
            "OPTModel",
            49,
            _tokens(128, 50272),
            hidden_size=384,
            num_hidden_layers=4,
            num_attention_heads=6,
            ffn_dim=1536,
            word_embed_proj_dim=384,
        ),
        _encoder(
            "bloom",
            "BloomConfig",
            "BloomModel",
            50,
            _tokens(128, 250880),
            hidden_size=384,
            n_layer=4,
            n_head=6,
        ),
        _encoder("gpt_neox", "GPTNeoXConfig", "GPTNeoXModel", 51, _tokens(128, 50432), **_WIDTH),
        _encoder("phi", "PhiConfig", "PhiModel", 52, _tokens(128, 51200), **_WIDTH),
        _encoder(
            "swin",
            "SwinConfig",
            "SwinModel",
            53,
            _image(224),
            ("pixel_values",),
            embed_dim=48,
            depths=[2, 2, 2, 2],
            num_heads=[2, 4, 8, 16],
        ),
        _encoder("deit", "DeiTConfig", "DeiTModel", 54, _image(224), ("pixel_values",), **_WIDTH),
        _encoder(
            "convnext_hf",
            "ConvNextConfig",
            "ConvNextModel",
            55,
            _image(224),
            ("pixel_values",),
            hidden_sizes=[48, 96, 192, 384],
            depths=[2, 2, 4, 2],
        ),
        _encoder(
            "clip_vision",
            "CLIPVisionConfig",
            "CLIPVisionModel",
            56,
            _image(224),
            ("pixel_values",),
            **_WIDTH,
        ),
        _encoder(
            "electra",
            "ElectraConfig",
            "ElectraModel",
            58,
            _BERT_TOKENS,
            embedding_size=128,
            **_WIDTH,
        ),
        _encoder(
            "segformer", "SegformerConfig", "SegformerModel", 59, _image(224), ("pixel_values",)
        ),
        _encoder(
            "wav2vec2",
            "Wav2Vec2Config",
            "Wav2Vec2Model",
            60,
            _features((1, 16000), 0.3),
            ("input_values",),
            conv_dim=(256,) * 7,
            num_conv_pos_embeddings=32,
            **_WIDTH,
        ),
        ZooModel(
            "whisper_encoder", _whisper_encoder(57), _features((1, 80, 3000), 0.5), 1, "encoder"
        ),
        _encoder(
            "mixtral",
            "MixtralConfig",
            "MixtralModel",
            61,
            _TOKENS,
            num_local_experts=8,
            num_experts_per_tok=2,
            **_DECODER,
        ),
        _encoder(
            "qwen2_moe",
            "Qwen2MoeConfig",
            "Qwen2MoeModel",
            62,
            _TOKENS,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=384,
            shared_expert_intermediate_size=768,
            **_DECODER,
        ),
        _encoder(
            "deepseek_v3",
            "DeepseekV3Config",
            "DeepseekV3Model",
            63,
            _TOKENS,
            n_routed_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=384,
            first_k_dense_replace=0,
            n_group=1,
            topk_group=1,
            q_lora_rank=None,
            kv_lora_rank=64,
            qk_rope_head_dim=32,
            qk_nope_head_dim=32,
            v_head_dim=64,
            **{**_DECODER, "num_key_value_heads": 6},
        ),
    )
}
"""The Hugging Face architectures by name (``--models transformers``)."""
