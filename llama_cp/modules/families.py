"""The HF model families llama-cp trains exactly, and what it refuses.

llama-cp swaps two pieces of an HF causal LM: the attention function (causal,
no mask, a sliding window and soft-capped scores where the family has them) and the loss path (the chunked
cross-entropy of ``llama_cp.model.loss``, which must repeat what the family's
``*ForCausalLM.forward`` does to the ``lm_head`` output). A family is supported
only where both were checked against the plain single-process transformers
model (``tests/modules/test_families.py``: logits, loss and every gradient, ring and
Ulysses, cp 2 and 4, with and without FSDP). Any other model, a supported
one configured with a feature the kernel does not compute, or one whose code in
the installed transformers does not call the attention function (Note [A
family's transformers floor]), is refused when CP is applied, with the reason
and the fix, rather than trained differently.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import transformers
from torch import nn

from llama_cp.modules.causal_lm import base_causal_lm


@dataclass(frozen=True)
class LogitTransform:
    """What a family's forward does to the ``lm_head`` output before the loss:
    ``logits = softcap * tanh(scale * raw / softcap)``, or ``scale * raw`` without a softcap."""

    scale: float = 1.0
    softcap: float | None = None


def _plain(config) -> LogitTransform:
    return LogitTransform()


# GraniteForCausalLM: logits / config.logits_scaling; MiniCPM3ForCausalLM: lm_head(hidden / config.logits_scaling),
# the same logits (its lm_head has no bias)
def _granite(config) -> LogitTransform:
    return LogitTransform(scale=1.0 / config.logits_scaling)


def _hyperclovax(config) -> LogitTransform:  # HyperCLOVAXForCausalLM: logits * config.logits_scaling
    return LogitTransform(scale=config.logits_scaling)


def _cohere(config) -> LogitTransform:  # CohereForCausalLM: logits * config.logit_scale
    return LogitTransform(scale=config.logit_scale)


def _final_softcap(config) -> LogitTransform:  # Gemma2ForCausalLM: tanh soft-capping
    return LogitTransform(softcap=config.final_logit_softcapping)


#: ``config.model_type`` -> its logit transform; the families tested exact.
SUPPORTED_FAMILIES: dict[str, Callable[..., LogitTransform]] = {
    "llama": _plain,
    "mistral": _plain,
    "qwen2": _plain,
    "qwen3": _plain,
    "gemma": _plain,
    "olmo2": _plain,
    "granite": _granite,
    "cohere": _cohere,
    "gemma2": _final_softcap,
    "phi3": _plain,  # fused qkv_proj / gate_up_proj: attention still receives q, k, v
    "gemma3_text": _final_softcap,  # Gemma3ForCausalLM: windowed and full layers, a RoPE per layer type
    # Gemma 4 (Gemma4ForCausalLM): windowed and full layers, the full ones with heads of their own size
    # (global_head_dim, num_global_key_value_heads; transformers' per-layer config: layer_configs) and
    # values that are their keys (attention_k_eq_v), a RoPE per layer type ("proportional" on the full
    # layers); the last num_kv_shared_layers reuse the keys and values an earlier layer passed to
    # attention (its local rows: each call exchanges them again); per-layer inputs and the expert
    # block beside the MLP are per token; no router loss
    "gemma4_text": _final_softcap,
    # Gemma 4 12B (Gemma4UnifiedForCausalLM): Gemma 4's layers without per-layer inputs or expert blocks, each
    # layer's output scaled by its layer_scalar
    "gemma4_unified_text": _final_softcap,
    # Gemma 3n (Gemma3nForCausalLM): windowed and full layers, the last num_kv_shared_layers reusing the keys and
    # values an earlier layer passed to attention (as Gemma 4's); AltUp (altup_num_inputs copies of the hidden
    # state, predicted and corrected per token), LAuReL, per-layer inputs, per-layer MLP sizes and a Gaussian
    # top-k on the first layers' MLP activations, all per token; AltUp's in-place coefficient clamp under FSDP2:
    # Note [AltUp's clamp under FSDP2]
    "gemma3n_text": _final_softcap,
    "cwm": _plain,  # Code World Model: Llama's layers, windowed and full layer_types
    # Granite 3 MoE: Granite's multipliers and logits divided by logits_scaling, softmax-routed experts (the router
    # loss); GraniteMoeShared adds a shared MLP beside them
    "granitemoe": _granite,
    "granitemoeshared": _granite,
    # Granite SWA (granite-swash): windowed and full layers, a RoPE base per layer (0: NoPE), learned sinks applied
    # as a scale sigmoid(lse - sink) after the softmax (gpt-oss's sinks: Note [Attention sinks under CP]),
    # Granite's multipliers; its MoE adds Granite 3 MoE's experts, a shared MLP and the router loss
    "granite_swa": _granite,
    "granitemoe_swa": _granite,
    # mixture of experts: the experts are per token (nothing to change under CP); the router's
    # load-balancing loss is reduced over every rank (Note [Router loss under CP] in llama_cp/model/loss.py)
    "mixtral": _plain,
    "qwen3_moe": _plain,
    "olmoe": _plain,
    "qwen2_moe": _plain,  # + a shared expert gated per token; its windows: Note [A window held, not passed]
    "glm4_moe": _plain,  # sigmoid router with group selection, shared experts; transformers adds no router loss
    # everything they add happens in the attention module before the attention call, or per token:
    "ministral": _plain,  # windowed and full layers
    "ernie4_5": _plain,  # q/k/v/o and MLP biases, interleaved RoPE
    "hunyuan_v1_dense": _plain,  # q/k norm after RoPE, static NTK-alpha RoPE
    "seed_oss": _plain,  # q/k/v and o biases (its config's default attention_dropout 0.1 is refused below)
    "glm4": _plain,  # partial interleaved RoPE, qkv bias, norms after attention and MLP
    "cohere2": _cohere,  # windowed RoPE layers, full layers without RoPE (NoPE), parallel block
    # Cohere2-MoE: Cohere 2's layers (its dense prefix layers with RoPE whatever their window), experts of
    # intermediate_size chosen top-k then normalised, shared experts summed or averaged in; no router loss
    "cohere2_moe": _cohere,
    "exaone4": _plain,  # windowed RoPE layers, full NoPE layers, q/k norm, norms after attention and MLP
    "smollm3": _plain,  # NoPE layers among RoPE ones (no_rope_layers), windows where use_sliding_window
    "olmo3": _plain,  # windowed and full layers, a RoPE per layer type
    # Ministral 3: queries scaled by their position_id after RoPE (get_llama_4_attn_scale: the positions a
    # rank's shard holds, as transformers computes them), windowed when config.sliding_window is set
    "ministral3": _plain,
    "apertus": _plain,  # q/k norm, xIELU activation (per token), Llama 3 RoPE
    # Apertus 1.5's text model: Apertus, its output layer cut to the text tokens (output_vocab_size rows)
    "apertus1p5_text": _plain,
    # ERNIE 4.5 MoE: dense and expert layers (every moe_layer_interval-th from moe_layer_start_index), a
    # softmax router in float32 with a score bias (moe_statics), shared experts, the router loss
    "ernie4_5_moe": _plain,
    # Hunyuan-A13B: Hunyuan's attention (q/k norms after RoPE), experts (moe_topk) beside a shared MLP in every
    # layer, a float32 router; transformers adds no router loss
    "hunyuan_v1_moe": _plain,
    # EXAONE-MoE: EXAONE 4's attention (windowed RoPE layers, full NoPE ones, q/k norms), DeepSeek-V3's experts
    # (sigmoid router with a score bias, by group, shared experts) on its mlp_layer_types "sparse"; no router loss
    "exaone_moe": _plain,
    # Kolibri-1 (Aleph Alpha): EXAONE 4's attention, GLM-4's norms after attention and MLP, experts in every layer
    # (a float32 sigmoid router with a score bias) and a shared expert; no router loss
    "kolibri1": _plain,
    # AFMoE (Arcee Trinity): windowed RoPE layers next to full NoPE ones, q/k norms, a sigmoid gate on the
    # attention output (per token), routed experts with a score bias and shared ones after dense first
    # layers; no router loss
    "afmoe": _plain,
    "arcee": _plain,  # Arcee AFM: Llama with an MLP without a gate (ReLU squared), per token
    # nanochat: q/k norms without weights, an MLP without a gate (ReLU squared), the final logit soft-cap
    "nanochat": _final_softcap,
    # VaultGemma: Gemma 2's attention soft-cap and final logit soft-cap, windowed and full layers
    "vaultgemma": _final_softcap,
    "helium": _plain,  # Helium: Llama's layers (biases where attention_bias)
    "internlm3": _plain,  # InternLM3: Llama's layers, q/k/v biases where qkv_bias
    # StarCoder2: layer norms with biases, an MLP without a gate (c_fc, c_proj) with biases, windows
    "starcoder2": _plain,
    # Jais 2: Llama's attention with biases, layer norms with biases, an MLP without a gate (ReLU squared, biases)
    "jais2": _plain,
    # Llama's implementation in transformers 5.24 under their own model_type: EXAONE 3.5, IQuest-Coder
    "exaone": _plain,
    "iquestcoder": _plain,
    # HyperCLOVA X SEED: Granite's multipliers (the logits multiplied, not divided), norms after attention and MLP
    "hyperclovax": _hyperclovax,
    "olmo": _plain,  # OLMo 1: q/k/v clamped (clip_qkv), layer norms without weights
    "glm": _plain,  # GLM-4-9B (-hf checkpoints): half of each head rotated, fused gate_up_proj, q/k/v biases
    "bitnet": _plain,  # BitNet b1.58 (bf16 weights): norms inside attention and MLP, a ReLU-squared gated MLP
    # experts per token: FlexOlmo (OLMo 2's attention, a softmax router), Sarvam MoE (DeepSeek-V3's experts: a
    # sigmoid router by group, shared experts, dense first layers), Mellum (dense and expert layers by
    # mlp_layer_types); transformers adds no router loss to Sarvam's
    "flex_olmo": _plain,
    "sarvam_moe": _plain,
    "mellum": _plain,
    # dots.llm1: Qwen 3's attention (q/k norms, windows on the sliding layer_types), DeepSeek-V3's experts
    # (sigmoid router with a score bias, by group, a shared expert, dense first layers); no router loss
    "dots1": _plain,
    # MiniMax-M2: q/k norms over all of a token's heads (before the attention call: per token), partial
    # RoPE, sigmoid-routed experts with a score bias, the router loss
    "minimax_m2": _plain,
    # learned per-head sinks (s_aux: Note [Attention sinks under CP]), windowed and full layers,
    # experts with clamped SwiGLU and the router loss
    "gpt_oss": _plain,
    # multi-head latent attention: values narrower than the keys (Note [Value heads narrower than keys] in
    # llama_cp/cp_attention.py), RoPE on a slice of each head; routed + shared experts (v2: softmax router,
    # v3: sigmoid with a score bias and groups); transformers adds no router loss
    "deepseek_v2": _plain,
    "deepseek_v3": _plain,
    "sarvam_mla": _plain,  # Sarvam-105B: transformers builds DeepseekV3ForCausalLM from its config
    # Solar Open: Llama's attention, GLM-4.5's experts (sigmoid router with a score bias, by group, shared
    # experts) in every layer; no router loss
    "solar_open": _plain,
    # HY-V3 (Hy3): Apertus' attention (q/k norms), a sigmoid router with a score bias in float32, shared
    # experts added in float32, on its mlp_layer_types "sparse" layers; no router loss
    "hy_v3": _plain,
    # MiMo-V2-Flash: windowed layers with learned per-head sinks (s_aux) and twice the key/value heads of the
    # full ones, values narrower than the keys (padded: Note [Value heads narrower than keys]), partial RoPE
    # per layer type, DeepSeek-V3's experts on its mlp_layer_types "sparse"; no router loss
    "mimo_v2_flash": _plain,
    # GLM-4.7-Flash: DeepSeek-V3's attention (MLA) and GLM-4.5's experts (sigmoid router with a score bias,
    # a shared expert) on its mlp_layer_types "sparse" layers; transformers adds no router loss
    "glm4_moe_lite": _plain,
    # chunked local attention on the RoPE layers (Note [Chunked attention under CP]), NoPE full layers
    # whose queries are scaled by their row (Note [Query temperature under CP], both in
    # llama_cp/attention/chunks.py), q/k L2 norm; routed (sigmoid top-k) + shared experts,
    # transformers adds no router loss
    "llama4_text": _plain,
    "laguna": _plain,
    "beam": _final_softcap,
    "flint": _plain,
    "minicpm3": _granite,
    "youtu": _plain,
    "axk1": _plain,
}

#: MoE families -> the config field holding their number of experts.
#: (GLM-4.5's glm4_moe and DeepSeek-V2/V3 have a router but their forwards add no load-balancing loss: not here.)
_EXPERTS_FIELD = {"mixtral": "num_local_experts", "qwen3_moe": "num_experts", "olmoe": "num_experts",
                  "qwen2_moe": "num_experts", "gpt_oss": "num_local_experts", "minimax_m2": "num_local_experts",
                  "ernie4_5_moe": "num_experts", "laguna": "num_experts", "flint": "num_experts",
                  "granitemoe": "num_local_experts", "granitemoeshared": "num_local_experts",
                  "granitemoe_swa": "num_local_experts"}


@dataclass(frozen=True)
class RouterLoss:
    """The router's load-balancing loss of an MoE family, as its ``*ForCausalLM.forward`` adds it:
    ``coef * load_balancing_loss_func(router_logits, num_experts, top_k)``."""

    num_experts: int
    top_k: int
    coef: float


def router_loss(model: nn.Module) -> RouterLoss | None:
    """The :class:`RouterLoss` ``model``'s forward adds to its loss, or None: a dense family, or an
    MoE whose ``config.output_router_logits`` is false (transformers then adds none either)."""
    config = base_causal_lm(model).config
    field = _EXPERTS_FIELD.get(config.model_type)
    if field is None or not getattr(config, "output_router_logits", False):
        return None
    return RouterLoss(getattr(config, field), config.num_experts_per_tok, float(config.router_aux_loss_coef))


def set_router_loss_coef(config, coef: float) -> None:
    """``--router_aux_loss_coef``: -1 keeps the model's own (``output_router_logits`` decides, as in
    transformers); a coefficient >= 0 sets ``router_aux_loss_coef`` and adds the loss when it is > 0."""
    if coef == -1:
        return
    if config.model_type not in _EXPERTS_FIELD:
        raise ValueError(f"--router_aux_loss_coef {coef}: {config.model_type!r} adds no router load-balancing loss "
                         f"(families that do: {', '.join(sorted(_EXPERTS_FIELD))}); drop the flag")
    if coef < 0:
        raise ValueError(f"--router_aux_loss_coef must be >= 0 (0 = no router loss), or -1 for the model's own; "
                         f"got {coef}")
    config.router_aux_loss_coef = coef
    config.output_router_logits = coef > 0


_RECURRENT = ("carry a recurrent state along the sequence, which under CP would restart at every rank's shard "
              "(no context-parallel algorithm here passes it across ranks)")

_TOKENS_BEFORE = ("read the few tokens before each position, which under CP lie on another rank's shard at every "
                  "shard's start (no context-parallel algorithm here passes them across ranks)")

#: Why some well-known families are refused.
_REFUSAL_REASONS = {
    "phi": "its attention has no o_proj and a partial rotary embedding",
    # Phi-3.5-MoE (transformers 5.24 models/phimoe, sparsemixer: Gumbel sampling when training)
    "phimoe": "its router draws each token's experts at random in training (sparsemixer's Gumbel sampling), so no "
              "run of it can be checked against single-process transformers",
    # Note [Documents a layer drops] in llama_cp/cp_attention.py
    **dict.fromkeys(("nemotron", "stablelm"), "its decoder layers call attention without the keyword arguments they "
                    "get, so a batch's packed documents cannot reach it"),
    # linear-attention and state-space hybrids: their non-attention layers see only the local shard
    "qwen3_next": f"its linear-attention layers (gated DeltaNet with a causal convolution) {_RECURRENT}",
    # Qwen3.5 (Qwen3_5ForCausalLM, built from its qwen3_5 config): the layers of Qwen3-Next
    **dict.fromkeys(("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"),
                    f"its linear-attention layers (gated DeltaNet with a causal convolution) {_RECURRENT}"),
    "kimi_linear": f"its linear-attention layers (Kimi Delta Attention) {_RECURRENT}",
    "falcon_h1": f"its Mamba2 mixers, one beside the attention of every layer, {_RECURRENT}",
    "granitemoehybrid": f"its Mamba2 layers {_RECURRENT}",
    # LFM2/LFM3 and Inkling's short convolutions; ZAYA1's compressed convolutional attention (CCA: its queries and
    # keys mixed by a causal convolution, its values half the previous token's)
    **dict.fromkeys(("lfm2", "lfm2_moe", "lfm3", "inkling_text", "inkling2_text", "inkling2_loop_text"),
                    f"its short-convolution layers {_TOKENS_BEFORE}"),
    "zaya": f"its convolutional attention (CCA) mixes queries and keys by causal convolutions, which {_TOKENS_BEFORE}",
    "lara_mini": f"its linear-attention layers (gated DeltaNet with a causal convolution) {_RECURRENT}",
    # Qwen4-Exp: gated DeltaNet layers (and a sparse-attention indexer) among the attention layers
    **dict.fromkeys(("qwen4_exp", "qwen4_exp_text"),
                    f"its linear-attention layers (gated DeltaNet with a causal convolution) {_RECURRENT}"),
    "olmo_hybrid": f"its linear-attention layers (gated DeltaNet) {_RECURRENT}",
    "bailing_hybrid": f"its linear-attention layers (delta attention) {_RECURRENT}",
    "minimax": f"its lightning-attention layers (linear attention) {_RECURRENT}",
    **dict.fromkeys(("nemotron_h", "jamba", "zamba", "zamba2", "bamba"), f"its Mamba layers {_RECURRENT}"),
    **dict.fromkeys(("mamba", "mamba2", "falcon_mamba"), f"it is a state-space model (Mamba): its layers {_RECURRENT}"),
    "recurrent_gemma": f"its recurrent layers (RG-LRU) {_RECURRENT}",
    "rwkv": f"it is a recurrent network (RWKV): its layers {_RECURRENT}",
    "xlstm": f"it is a recurrent network (xLSTM): its layers {_RECURRENT}",
    # DeepSeek Sparse Attention (V3.2, GLM-5): a learned indexer picks each query's top-k keys
    # A.X K2, dots3, Hy4 and Mistral Large 4 the same; MiniMax-M3's indexer picks blocks of keys, on its
    # sparse-attention layers
    **dict.fromkeys(("deepseek_v32", "glm_moe_dsa", "deepseek_v4", "axk2", "dots3_note_text", "dots3_note", "hy_v4",
                     "mistral_large4", "mistral_large4_text"),
                    "its sparse attention lets a learned indexer pick each query's keys (its top k of the whole "
                    "sequence), which context-parallel attention does not compute"),
    "minimax_m3_vl_text": "its sparse-attention layers let a learned indexer pick each query's keys (its top k blocks "
                          "of the whole sequence and the local ones), which context-parallel attention does not "
                          "compute",
    # Gemma 4's speculative-decoding drafters (Gemma4AssistantForCausalLM): transformers 5.24 models/gemma4_assistant
    **dict.fromkeys(("gemma4_assistant", "gemma4_unified_assistant"),
                    "it is a speculative-decoding drafter: its forward takes the main Gemma 4 model's embeddings and "
                    "keys and values, not token ids (fine-tune the main model)"),
    # a model object or config given directly; a checkpoint directory is read as its text model (checkpoints.py)
    "llama4": "it is the vision-language Llama4ForConditionalGeneration; llama-cp trains its text model, "
              "Llama4ForCausalLM (llama4_text): give the recipe the checkpoint directory, which it reads as that "
              "text model, or apply context parallelism to the model's language_model",
}

# Note [A family's transformers floor]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# llama-cp's attention runs only where the family's attention module calls the function
# registered for config._attn_implementation (transformers' ALL_ATTENTION_FUNCTIONS). Some
# families, in older releases setup.cfg admits, pick an attention class when the model is
# built and call F.scaled_dot_product_attention themselves:
#
#   transformers 4.x  OlmoeDecoderLayer: OLMOE_ATTENTION_CLASSES["sdpa"] -> OlmoeSdpaAttention -> SDPA
#   transformers 5.x  OlmoeAttention -> ALL_ATTENTION_FUNCTIONS[config._attn_implementation]
#
# There each rank would attend over its own shard only and train silently wrong (seen: OLMoE
# at cp 2 on transformers 4.56.2, 75% of the logits off), so the family is refused below the
# first release that calls through the interface. Read in the released wheels'
# models/olmoe/modeling_olmoe.py: 4.56.2, 4.57.0 and 4.57.6 have OLMOE_ATTENTION_CLASSES,
# 5.0.0 has ALL_ATTENTION_FUNCTIONS. Every other family of SUPPORTED_FAMILIES calls through
# the interface in 4.56.2 already. tests/modules/test_families.py checks the refusal.

#
# Qwen2-MoE the same: 4.56.2 and 4.57.6 have QWEN2MOE_ATTENTION_CLASSES (Qwen2MoeSdpaAttention ->
# SDPA), 5.0.0 has ALL_ATTENTION_FUNCTIONS (read in the released wheels' models/qwen2_moe/modeling_qwen2_moe.py).

#
# Apertus the same for another cause: its xIELU activation (transformers' activations.py XIELU)
# makes its two parameters in bfloat16 (the class's default dtype) beside the model's float32 ones,
# and FSDP2 shards a layer's parameters in one dtype only ("FSDP expects uniform original parameter
# dtype"); from 5.0.0 ApertusMLP passes the model's dtype (read in the released wheels of 4.56.2,
# 4.57.6 and 5.0.0: models/apertus/modeling_apertus.py, ACT2FN["xielu"] then ACT2CLS["xielu"](dtype=)).

#
# Granite 3 MoE (granitemoe, granitemoeshared) for a third: 4.56.2 and 4.57.6 build a 4-D attention mask
# of their own (GraniteMoeModel._update_causal_mask, for any attention but flash-attn's), which the
# attention call then refuses; 5.0.0 builds it with masking_utils.create_causal_mask, as Llama does (read
# in the released wheels' models/granitemoe/modeling_granitemoe.py and models/granitemoeshared/).

#
# Gemma 3n and Gemma 4 (gemma3n_text, gemma4_text) for a fourth, not the attention call: their last
# num_kv_shared_layers layers reuse an earlier layer's keys and values. Gemma 4 up to 5.5.0 and Gemma 3n up to
# 5.5.4 took them only from a cache, which llama-cp's forward does not make (use_cache=False, as transformers'
# own training with checkpointing runs), so there those layers ran k/v projections of their own that inference
# never runs: a fine-tune would train what the model does not use.
# From 5.5.4 (Gemma 4) and 5.6.0 (Gemma 3n) the model's forward hands them on itself, in a plain dict; but FSDP2
# hands a layer a copy of any dict of its inputs that holds a tensor needing gradients (torch 2.13: pre_forward ->
# _register_post_backward_hook -> fsdp/_common_utils.py replace_grad_tensors) and of every dict when it casts the
# inputs to a param_dtype (_apply_to_tensors), so the keys and values the early layers store go into copies and
# the reusing layers find nothing: a KeyError in every FSDP check of tests/modules/test_gemma3n.py, and of Gemma
# 4's in test_families_new.py, on 5.24 with a plain dict swapped back in ('full_attention' where the dict reaches
# the first layer untouched, 'sliding_attention' with bfloat16). From 5.9.0 the forward hands a UserDict (not a
# dict: FSDP2 passes it as it is; transformers' KVSharingDict says so). Read in the released wheels of 4.56.2,
# 5.0.0, 5.5.0, 5.5.4, 5.6.0, 5.7.0, 5.8.0 and 5.9.0 (models/gemma3n/modeling_gemma3n.py, models/gemma4/
# modeling_gemma4.py; Gemma 4 from 5.5.0); Gemma 4 12B (gemma4_unified_text) is in 5.10.1 first.

_SDPA_ITSELF = "its attention calls SDPA itself, so context-parallel attention cannot take its place"
_OWN_MASK = ("its model builds a 4-D attention mask of its own (_update_causal_mask), which context-parallel "
             "attention does not take")
#: Family -> (the first transformers release where llama-cp computes it, why not before).
_NEEDS_TRANSFORMERS = {
    "olmoe": ((5, 0), _SDPA_ITSELF), "qwen2_moe": ((5, 0), _SDPA_ITSELF),
    "granitemoe": ((5, 0), _OWN_MASK), "granitemoeshared": ((5, 0), _OWN_MASK),
    "apertus": ((5, 0), "its xIELU activation keeps its parameters in bfloat16 beside the model's float32 ones, "
                        "which FSDP2 cannot shard together"),
    **dict.fromkeys(("gemma3n_text", "gemma4_text"), (
        (5, 9), "its layers that reuse an earlier layer's keys and values computed their own without a cache, "
                "from k/v projections its inference does not run (to 5.5), then got them in a dict that FSDP2 "
                "copies on the way into a layer, so they found none (to 5.8)")),
}


def release(version: str) -> tuple[int, ...]:
    """The numbers of a version string: "4.57.6" -> (4, 57, 6), "5.0.0.dev0" -> (5, 0, 0)."""
    return tuple(int(part) for part in re.match(r"\d+(?:\.\d+)*", version).group().split("."))


def transformers_refusal(family: str, transformers_version: str) -> str | None:
    """None when llama-cp's attention runs in ``family`` under this transformers version, else the
    one-line reason (Note [A family's transformers floor])."""
    needed, why = _NEEDS_TRANSFORMERS.get(family, ((), ""))
    if release(transformers_version) >= needed:
        return None
    return (f"model family {family!r} needs transformers >= {'.'.join(map(str, needed))} (installed: "
            f"{transformers_version}): before that {why}; upgrade transformers")


def bind_decoder(causal_lm: nn.Module) -> None:
    """Make ``causal_lm.get_decoder()`` return its decoder, which the CP hook, the chunked loss and
    FSDP's final norm all look up: transformers 5.24's Llama4ForCausalLM holds it as ``.model`` but names
    ``base_model_prefix`` "language_model" (the vision-language checkpoint's key prefix), so its
    get_decoder() returns the causal LM itself (models/llama4/modeling_llama4.py; 4.56.2's returns
    the decoder). The instance's prefix is set to "model"; the weights are loaded by then."""
    decoder = getattr(causal_lm, "model", None)
    if causal_lm.get_decoder() is causal_lm and isinstance(decoder, nn.Module) and decoder is not causal_lm:
        causal_lm.base_model_prefix = "model"


def check_family(config, class_name: str | None = None) -> None:
    """ValueError naming the cause unless ``config``'s family is supported under the installed
    transformers: what can be said of a model before it is built. ``class_name``: the built
    model's class (else the one AutoModelForCausalLM builds from ``config``)."""
    family = config.model_type
    if family not in SUPPORTED_FAMILIES:
        if class_name is None:
            from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

            class_name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(family, type(config).__name__)
        reason = _REFUSAL_REASONS.get(family, "it has not been checked exact against single-process transformers")
        raise ValueError(
            f"model family {family!r} ({class_name}) is not supported by llama-cp: {reason}. "
            f"Supported families: {', '.join(sorted(SUPPORTED_FAMILIES))}"
        )
    refusal = transformers_refusal(family, transformers.__version__)
    if refusal is not None:
        raise ValueError(refusal)


def check_supported(model: nn.Module) -> LogitTransform:
    """Raise a ValueError naming the cause and the fix unless llama-cp computes ``model``
    exactly; returns the family's :class:`LogitTransform`."""
    causal_lm = base_causal_lm(model)
    config, family = causal_lm.config, causal_lm.config.model_type
    check_family(config, type(causal_lm).__name__)
    if getattr(config, "attention_dropout", 0.0):
        raise ValueError(
            f"{family}: config.attention_dropout={config.attention_dropout}; context-parallel attention has no "
            "attention dropout: set it to 0.0"
        )
    if family == "smollm3" and not config.use_sliding_window and "sliding_attention" in (config.layer_types or ()):
        # SmolLM3Attention passes no window then, but the model's mask still windows those layers
        # (transformers 5.24 models/smollm3/modeling_smollm3.py): its own attention paths disagree
        raise ValueError(
            "smollm3: config.layer_types has sliding_attention layers but use_sliding_window=False, which "
            "transformers itself computes two ways (sdpa windows them, flash_attention does not): set "
            "use_sliding_window=True, or layer_types to full_attention"
        )
    # Gemma 4's "vision": image tokens see each other both ways, text stays causal (llama-cp trains text)
    bidirectional = getattr(config, "use_bidirectional_attention", False)
    if bidirectional and bidirectional != "vision":
        raise ValueError(
            f"{family}: config.use_bidirectional_attention={bidirectional!r} (an encoder, every token sees every "
            "other); llama-cp trains causal language models: set it to false"
        )
    return SUPPORTED_FAMILIES[family](config)
