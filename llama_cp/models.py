"""The embedded default model: a small Llama config, random init, no download."""

from __future__ import annotations

from torch import nn
from transformers import LlamaConfig

#: Small enough to train on a 2-core CPU, shaped like Llama 3 (GQA, RoPE theta 500k).
EMBEDDED_LLAMA = dict(
    vocab_size=1024,
    hidden_size=256,
    intermediate_size=688,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=1 << 20,
    rope_theta=500000.0,
    tie_word_embeddings=False,
)


def embedded_llama_config(**overrides) -> LlamaConfig:
    """The embedded Llama config; keyword arguments override its fields."""
    return LlamaConfig(**{**EMBEDDED_LLAMA, **overrides})


def base_causal_lm(model: nn.Module) -> nn.Module:
    """The HF causal LM itself: ``model``, or the model a peft wrapper holds."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model
