"""Model FLOPs of the Gemma decoder layers that differ from Llama's by more than their sizes: Gemma 4's and Gemma
3n's (Note [Model FLOPs] in llama_cp/model/flops.py, which calls them with its ``linear`` and ``layer_flops``)."""

from __future__ import annotations

from typing import Any


def _reuses(config: Any, index: int) -> bool:
    """Whether layer ``index`` reuses an earlier layer's keys and values (the last num_kv_shared_layers)."""
    return index >= config.num_hidden_layers - (config.num_kv_shared_layers or 0)


def gemma4_layer_flops(config: Any, index: int, shape: dict, attention: dict, linear, layer_flops) -> int:
    """A Gemma 4 decoder layer (transformers 5.24 models/gemma4, Gemma4TextDecoderLayer): the layers that
    reuse an earlier layer's keys and values have no k/v projections (and, with use_double_wide_mlp, an MLP
    twice as wide), full layers with attention_k_eq_v no v projection (their values are their keys); with
    enable_moe_block a router and the top k of the experts beside the MLP; with per-layer inputs, their gate
    (hidden -> per-layer size) and projection back. Gemma 4 12B's config (gemma4_unified_text) has neither
    of the last two fields."""
    reuses = _reuses(config, index)
    full = config.layer_types[index] != "sliding_attention"
    attention = {name: features for name, features in attention.items()
                 if not (reuses and name in ("k_proj", "v_proj") or config.attention_k_eq_v and full and
                         name == "v_proj")}
    wide = 2 if config.use_double_wide_mlp and reuses else 1
    flops = layer_flops(1, {**shape, "intermediate": wide * config.intermediate_size}, attention, shape)
    if getattr(config, "enable_moe_block", False):
        flops += linear("proj", config.hidden_size, config.num_experts)  # the router
        flops += layer_flops(config.top_k_experts, {**shape, "intermediate": config.moe_intermediate_size}, None,
                             shape)
    if getattr(config, "hidden_size_per_layer_input", None):
        flops += linear("per_layer_input_gate", config.hidden_size, config.hidden_size_per_layer_input)
        flops += linear("per_layer_projection", config.hidden_size_per_layer_input, config.hidden_size)
    return flops


def gemma3n_layer_flops(config: Any, index: int, shape: dict, attention: dict, linear, layer_flops) -> int:
    """A Gemma 3n decoder layer (transformers 5.24 models/gemma3n, Gemma3nTextDecoderLayer): the layers that reuse
    an earlier layer's keys and values have no k/v projections; the MLP at the layer's own intermediate size;
    LAuReL's low-rank pair (hidden -> laurel_rank -> hidden); the per-layer input's gate and projection back;
    AltUp's router, run on the active copy before and after the layer (hidden -> altup_num_inputs, twice), its
    prediction and correction coefficients (n -> n^2, n -> n), and the prediction itself, a per-token product of
    the n copies of the hidden state with an n x n matrix the token computed: 2 x hidden x n^2 FLOPs forward and
    both its inputs' gradients backward, 3 x forward whatever is trained (neither input is a weight)."""
    reuses = _reuses(config, index)
    attention = {name: features for name, features in attention.items()
                 if not (reuses and name in ("k_proj", "v_proj"))}
    hidden, n = config.hidden_size, config.altup_num_inputs
    flops = layer_flops(1, {**shape, "intermediate": config.intermediate_size[index]}, attention, shape)
    flops += linear("linear_left", hidden, config.laurel_rank) + linear("linear_right", config.laurel_rank, hidden)
    flops += linear("per_layer_input_gate", hidden, config.hidden_size_per_layer_input)
    flops += linear("per_layer_projection", config.hidden_size_per_layer_input, hidden)
    flops += 2 * linear("modality_router", hidden, n) + linear("prediction_coefs", n, n * n)
    # in training with a clamp, correct() multiplies by a clamped copy of the weight (F.linear), past any adapter
    flops += linear("correction_coefs", n, n, adapted=config.altup_coef_clip is None)
    return flops + 3 * 2 * hidden * n * n
