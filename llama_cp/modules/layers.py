"""What a model's config says of each decoder layer's attention: its config (Gemma 4's vary by
layer), head size and query heads, sliding window and attention chunk. Read by the context-parallel
binding (llama_cp/cp_attention.py), the FLOPs (llama_cp/model/flops.py), the planner and the checks
that refuse a run before it is built."""

from __future__ import annotations

import math

from torch import nn

from llama_cp.modules.causal_lm import base_causal_lm

#: Families whose attention reads ``config.sliding_window`` itself (others set it per layer).
_WINDOW_IN_CONFIG = {"mistral", "phi3", "mixtral", "olmoe", "qwen3_moe", "ministral3", "starcoder2"}


def layer_configs(config) -> list:
    """Each decoder layer's config. A transformers 5 config whose fields vary by layer (Gemma 4's
    full-attention layers have their own head size and key/value heads) raises where such a field is
    read on the whole config, and gives each layer's through ``per_layer_config``; any other config
    is every layer's."""
    if getattr(config, "is_heterogeneous", False):
        return config.per_layer_config[:]
    return [config] * config.num_hidden_layers


def attention_head_dim(config) -> int:
    """The head size attention computes with: the query/key heads' (DeepSeek's multi-head latent
    attention: qk_nope_head_dim + qk_rope_head_dim; its config's head_dim is the RoPE slice's).
    ``config``: a layer's (:func:`layer_configs`) where the head size varies by layer."""
    if getattr(config, "qk_nope_head_dim", None) is not None:
        return config.qk_nope_head_dim + config.qk_rope_head_dim
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def attention_heads(config) -> tuple[int, str]:
    """(the query heads Ulysses splits, how to name them in an error): ``num_attention_heads``, or where
    the count varies by layer (Laguna's ``num_attention_heads_per_layer``) the largest number dividing
    every layer's: a cp or Ulysses degree that divides it divides each layer's heads."""
    per_layer = getattr(config, "num_attention_heads_per_layer", None)
    if per_layer and len(set(per_layer)) > 1:
        heads = math.gcd(*per_layer)
        counts = ", ".join(map(str, sorted(set(per_layer))))
        return heads, f"num_attention_heads_per_layer ({counts}: {heads} divides each)"
    heads = per_layer[0] if per_layer else config.num_attention_heads
    return heads, f"num_attention_heads ({heads})"


def attention_head_dims(config) -> list[int]:
    """The head sizes attention computes with, smallest first: one, or Gemma 4's two (windowed and full layers)."""
    return sorted({attention_head_dim(layer) for layer in layer_configs(config)})


def sliding_windows(model: nn.Module) -> set[int]:
    """The sliding windows (tokens) of ``model``'s attention layers; empty when it has none."""
    return {w for w in layer_windows(base_causal_lm(model).config) if w is not None}


def layer_windows(config) -> list[int | None]:
    """Each decoder layer's sliding window (None: full attention) as ``config`` sets them: on every
    layer for the families whose attention takes ``config.sliding_window`` (Qwen3-MoE's config
    clears it without ``use_sliding_window``), else on the "sliding_attention" ``layer_types``
    (Qwen2/3, Gemma 2/3), as their attention modules read them."""
    window = getattr(config, "sliding_window", None)
    if config.model_type in _WINDOW_IN_CONFIG:
        return [window] * config.num_hidden_layers
    types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    return [window if kind == "sliding_attention" else None for kind in types]


def layer_chunks(config) -> list[int | None]:
    """Each decoder layer's attention chunk (None: none): Llama 4's "chunked_attention" layer_types
    take ``config.attention_chunk_size`` (Note [Chunked attention under CP] in llama_cp/attention/chunks.py)."""
    chunk = getattr(config, "attention_chunk_size", None)
    types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    return [chunk if kind == "chunked_attention" else None for kind in types]


def attention_chunk(module: nn.Module) -> int | None:
    """The attention chunk of an attention ``module``'s layer (None: none; no other family has one)."""
    if getattr(module.config, "attention_chunk_size", None) is None:
        return None
    return layer_chunks(module.config)[module.layer_idx]
