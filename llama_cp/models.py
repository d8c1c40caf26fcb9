"""The embedded default model: a small Llama config, random init, no download."""

from __future__ import annotations

import torch
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


def build_causal_lm(config, device: torch.device | str = "cpu") -> nn.Module:
    """The HF causal LM of ``config`` with float32 parameters on ``device`` (``"meta"``: no
    memory, to load sharded weights into or to plan with), whatever dtype the checkpoint's
    config names. The trainer and the memory planner both build here, so what FSDP shards,
    and the optimizer state made from it, is float32; bf16 is only FSDP's compute dtype
    (``shard_model``'s ``param_dtype``)."""
    from transformers import AutoModelForCausalLM

    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)
