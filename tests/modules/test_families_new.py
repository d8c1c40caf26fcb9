"""The families of issue 47 the kernel computes as it is, against plain single-process transformers on
4 CPU ranks (gloo), as tests/modules/test_families.py checks the older ones (its BASE model, batch,
meshes and tolerances); and the families refused, each in one line with the reason.

Per family: logits, chunked loss and every parameter gradient under ring, Ulysses (cp 1, 2, 4),
all-gather (cp 2) and hybrid (cp 4), plain and FSDP, float32 and float64 (``RUNS``); once each, packed
documents (ring, cp 2, FSDP, float32) and peft's LoRA (Ulysses or all-gather, cp 2, float64). The configurations
make each family's feature count: windows of 6 tokens (longer than a zigzag chunk at cp 4, shorter
at cp 2) on some layers, NoPE layers next to RoPE layers, partial rotary, non-zero q/k/v/o biases
(transformers initialises biases to zero: a zero bias would prove nothing), shared experts, a RoPE
per layer type; ``features_change_the_result`` records how far the logits move without each.
"""

import copy
import functools
import itertools
import re

import pytest
import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

from dist_harness import Checks
from document_checks import SEQ_LEN as DOCUMENT_LEN, packed_batch
from fsdp_checks import check_cp_against_reference
from llama_cp import apply_context_parallel
from llama_cp.cp_attention import UNCOMPUTED_KWARGS, cp_attention_forward
from llama_cp.modules.experts import apply_expert_gradients
from llama_cp.modules.families import SUPPORTED_FAMILIES, check_supported, transformers_refusal
from llama_cp.modules.layers import layer_windows
from test_families import (
    BASE, FUSED_EXPERTS_LORA_PROBLEM, MOE_LOSS, SEQ_LEN, TOLERANCE, TRANSFORMERS_5, VOCAB, WINDOW, WORLD_SIZE, batch,
    hf_reference, mesh_for, rope,
)

checks = Checks(setup=lambda sizes: [mesh_for(cp) for cp in sorted(sizes)])

SLIDING_FULL = dict(layer_types=["sliding_attention", "full_attention"], sliding_window=WINDOW)
PARTIAL_ROTARY = dict(partial_rotary_factor=0.5)  # 4 of head_dim 8 rotated


def per_layer_type_rope(full: dict) -> dict:
    """OLMo 3's RoPE per layer type: windowed layers theta 100, full layers ``full``."""
    return dict(rope_parameters={"sliding_attention": dict(rope_type="default", rope_theta=100.0),
                                 "full_attention": full})


#: Ministral 3's YaRN, with its query temperature on from position 8 (its checkpoints: 16384).
MINISTRAL3_ROPE = dict(rope_type="yarn", rope_theta=1e6, factor=4.0, original_max_position_embeddings=8,
                       llama_4_scaling_beta=0.5)


#: Gemma 4: four layers (sliding, full, sliding, full), the last two reusing the first two's keys and values.
GEMMA4 = dict(num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=WINDOW,
              global_head_dim=16, num_global_key_value_heads=1, attention_k_eq_v=True, num_kv_shared_layers=2,
              hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB, final_logit_softcapping=1.0)

#: Gemma 4 12B's text model: GEMMA4 without per-layer inputs (no such fields), a double-wide MLP on the reusing layers
GEMMA4_UNIFIED = dict({k: v for k, v in GEMMA4.items() if "per_layer_input" not in k}, use_double_wide_mlp=True)

#: name -> (model_type, config overrides).
FAMILIES = {
    "ministral": ("ministral", SLIDING_FULL),
    "ernie4_5": ("ernie4_5", dict(use_bias=True)),  # interleaved RoPE
    # q/k norm after RoPE; "dynamic" with an alpha is transformers' static NTK-alpha RoPE
    "hunyuan_v1_dense": ("hunyuan_v1_dense", dict(attention_bias=True, **rope(
        rope_type="dynamic", rope_theta=10000.0, factor=1.0, alpha=1000.0))),
    "seed_oss": ("seed_oss", dict(attention_bias=True, attention_out_bias=True, attention_dropout=0.0,
                                  residual_dropout=0.0)),
    "glm4": ("glm4", dict(attention_bias=True, **PARTIAL_ROTARY)),
    # RoPE on the windowed layer only: the full layer is NoPE (weights 2.5x the usual init: at 0.02 the
    # NoPE layer moved the logits by 3e-4 only)
    "cohere2": ("cohere2", dict(**SLIDING_FULL, logit_scale=0.25, initializer_range=0.05)),
    # layer 0 windowed, dense and rotated; layer 1 full without RoPE, experts (4 of intermediate_size, top 2,
    # sigmoid) and a shared one averaged in
    "cohere2_moe": ("cohere2_moe", dict(**SLIDING_FULL, logit_scale=0.25, initializer_range=0.05,
                                        mlp_layer_types=["dense", "sparse"], prefix_dense_intermediate_size=48,
                                        num_experts=4, num_experts_per_tok=2, num_shared_experts=1,
                                        expert_selection_fn="sigmoid")),
    "exaone4": ("exaone4", SLIDING_FULL),  # the same NoPE rule, q/k norm
    # layer 0 full with RoPE, layer 1 windowed without (no_rope_layers [1, 0])
    "smollm3": ("smollm3", dict(no_rope_layer_interval=2, use_sliding_window=True, sliding_window=WINDOW)),
    "olmo3": ("olmo3", dict(**SLIDING_FULL, **per_layer_type_rope(dict(rope_type="default", rope_theta=10000.0)))),
    # the full layers' RoPE picks its frequencies from the longest position (32 > 16): Note
    # [Position-dependent RoPE under CP] on a rotary module with a RoPE per layer type
    "olmo3_dynamic_rope": ("olmo3", dict(**SLIDING_FULL, max_position_embeddings=16, **per_layer_type_rope(
        dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0)))),
    # queries scaled by 1 + beta * log(1 + floor(position / 8)): 1 to 1.7 over 32 positions; every layer windowed
    "ministral3": ("ministral3", dict(sliding_window=WINDOW, rope_parameters=MINISTRAL3_ROPE)),
    "apertus": ("apertus", dict(attention_bias=True)),  # q/k norm, xIELU, Llama 3 RoPE
    # Apertus, its output layer cut to the first 96 of its 128 tokens (output_vocab_size: the text tokens)
    "apertus1p5_text": ("apertus1p5_text", dict(attention_bias=True, vocab_size=128, output_vocab_size=VOCAB)),
    # windowed and full layers, the full ones with their own head size (16) and one key/value head whose
    # values are its keys, a quarter of each head rotated ("proportional" RoPE); layers 2 and 3 reuse the
    # keys and values of layers 0 and 1; per-layer embeddings; soft-capped logits
    "gemma4_text": ("gemma4_text", GEMMA4),
    # + an expert block beside each layer's MLP (softmax router with a per-expert scale; no router loss), a
    # double-wide MLP on the reusing layers; image tokens attended both ways (none in text rows)
    "gemma4_moe": ("gemma4_text", dict(**GEMMA4, enable_moe_block=True, num_experts=4, top_k_experts=2,
                                       moe_intermediate_size=16, use_double_wide_mlp=True,
                                       use_bidirectional_attention="vision")),
    # layer 0 dense, layer 1 sigmoid-routed experts (the best of 2 groups of 4, then its 4 weighed)
    # plus a shared one; no router loss in transformers
    "glm4_moe": ("glm4_moe", dict(
        attention_bias=True, use_qk_norm=True, **PARTIAL_ROTARY, n_routed_experts=8, num_experts_per_tok=4,
        n_shared_experts=1, moe_intermediate_size=16, first_k_dense_replace=1, n_group=2, topk_group=1,
        norm_topk_prob=True, routed_scaling_factor=2.0)),  # every expert gets tokens (transformers 4 and 5)
    "gemma4_unified_text": ("gemma4_unified_text", GEMMA4_UNIFIED),
    # Code World Model: Llama's layers, layer 1 windowed
    "cwm": ("cwm", dict(layer_types=["full_attention", "sliding_attention"], sliding_window=WINDOW)),
    # Granite's multipliers (the logits divided by logits_scaling), 4 experts (top 2) in every layer, the router loss
    "granitemoe": ("granitemoe", dict(num_local_experts=4, num_experts_per_tok=2, embedding_multiplier=2.0,
                                      residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=2.0,
                                      **MOE_LOSS)),
    # Granite SWA: layer 0 full without RoPE (layer_rope_theta 0), layer 1 windowed with it, learned sinks (as
    # gpt-oss's: a scale sigmoid(lse - sink) after the softmax), Granite's multipliers; transformers runs it eager only;
    # weights 4x the usual init (at 0.02 the full layer's NoPE moved the logits by 8e-5 only: the scores were near 0)
    "granite_swa": ("granite_swa", dict(attn_implementation="eager", initializer_range=0.08,
                                        layer_types=["full_attention", "sliding_attention"],
                                        sliding_window=WINDOW, layer_rope_theta=[0.0, 10000.0],
                                        embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.2,
                                        logits_scaling=2.0)),
    # + Granite 3 MoE's experts and a shared MLP, the router loss
    "granitemoe_swa": ("granitemoe_swa", dict(attn_implementation="eager",
                                              layer_types=["full_attention", "sliding_attention"],
                                              sliding_window=WINDOW, layer_rope_theta=[0.0, 10000.0],
                                              num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=32,
                                              logits_scaling=2.0, **MOE_LOSS)),
    # + a shared MLP beside the experts
    "granitemoeshared": ("granitemoeshared", dict(num_local_experts=4, num_experts_per_tok=2, embedding_multiplier=2.0,
                                                  residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=2.0,
                                                  shared_intermediate_size=32, **MOE_LOSS)),
    # layer 0 dense, layer 1 softmax-routed experts (4, top 2; a score bias) and a shared one, the router loss
    "ernie4_5_moe": ("ernie4_5_moe", dict(moe_num_experts=4, moe_k=2, moe_intermediate_size=16,
                                          moe_num_shared_experts=1, moe_layer_start_index=1, **MOE_LOSS)),
    # experts (4, top 2) beside a shared MLP in every layer, q/k norms after RoPE, biases (weights 2.5x the usual
    # init: at 0.02 the shared MLP moved the logits by 9e-4 on transformers 4.56.2)
    "hunyuan_v1_moe": ("hunyuan_v1_moe", dict(num_experts=4, moe_topk=2, attention_bias=True, initializer_range=0.05)),
    # layer 0 windowed with RoPE and dense, layer 1 full without RoPE (NoPE), sigmoid-routed experts by group and
    # a shared one
    "exaone_moe": ("exaone_moe", dict(**SLIDING_FULL, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                                      num_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1,
                                      norm_topk_prob=True, routed_scaling_factor=2.0)),
    # layer 0 windowed with RoPE and dense, layer 1 full without RoPE, a sigmoid gate on the attention output,
    # q/k norms, routed experts with a score bias and a shared one
    "afmoe": ("afmoe", dict(**SLIDING_FULL, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                            num_shared_experts=1, num_dense_layers=1, route_scale=2.0)),
    "arcee": ("arcee", dict(mlp_bias=True, attention_bias=True)),  # an MLP without a gate: ReLU squared
    # q/k norms without weights, an ungated ReLU-squared MLP, the final logit soft-cap at 1.0 (as Gemma 4's here)
    "nanochat": ("nanochat", dict(final_logit_softcapping=1.0)),
    # Gemma 2's soft-caps (attention 0.05, logits 1.0) on windowed and full layers; weights at 0.15 (at 0.02 the
    # scores stayed under the cap, which moved the logits by 3e-7); transformers runs it eager only
    "vaultgemma": ("vaultgemma", dict(**SLIDING_FULL, attn_logit_softcapping=0.05, final_logit_softcapping=1.0,
                                      initializer_range=0.15, attn_implementation="eager")),
    "helium": ("helium", dict(attention_bias=True)),
    "internlm3": ("internlm3", dict(qkv_bias=True, bias=True)),
    # every layer windowed, biases everywhere
    "starcoder2": ("starcoder2", dict(sliding_window=WINDOW, use_bias=True)),
    "jais2": ("jais2", {}),  # biases everywhere (its defaults), layer norms, an ungated ReLU-squared MLP
    "exaone": ("exaone", dict(attention_bias=True)),  # Llama's implementation
    "iquestcoder": ("iquestcoder", dict(attention_bias=True)),  # Llama's implementation
    # Granite's multipliers (embeddings, residuals, attention, the logits multiplied), norms after attention and MLP
    "hyperclovax": ("hyperclovax", dict(embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.2,
                                        logits_scaling=0.5)),
    "olmo": ("olmo", dict(clip_qkv=0.05)),  # q, k and v clamped to +-0.05 (they reach about 0.3 here)
    "glm": ("glm", PARTIAL_ROTARY),  # half of each head rotated, q/k/v biases (its default), fused gate_up_proj
    "bitnet": ("bitnet", {}),  # RMSNorms inside attention (before o_proj) and the MLP (before down_proj)
    # OLMo 2's attention (q/k norms over all heads, norms after attention and MLP), 4 experts (top 2, renormalized)
    "flex_olmo": ("flex_olmo", dict(num_experts=4, num_experts_per_tok=2, norm_topk_prob=True)),
    # layer 0 dense, layer 1 sigmoid-routed experts (the best of 2 groups of 4, then its 2) and a shared one
    "sarvam_moe": ("sarvam_moe", dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                                      n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1)),
    # layer 0 dense, layer 1 experts (4, top 2, renormalized)
    "mellum": ("mellum", dict(num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                              mlp_layer_types=["dense", "sparse"])),
    # layer 0 full and dense, layer 1 windowed with sigmoid-routed experts (the best group of 2, a score bias)
    # and a shared one
    "dots1": ("dots1", dict(layer_types=["full_attention", "sliding_attention"], sliding_window=WINDOW,
                            n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, n_shared_experts=1,
                            first_k_dense_replace=1, n_group=2, topk_group=1, norm_topk_prob=True,
                            routed_scaling_factor=2.0)),
    # MiMo-V2-Flash: layer 0 full and dense, layer 1 windowed with sinks (4 key/value heads against the full
    # layer's 2) and experts (8, top 2 of the best group of 2, a score bias; no shared one); values of 6 against
    # keys of 8, half of each head rotated, its theta per layer type (transformers runs it eager only)
    "mimo_v2_flash": ("mimo_v2_flash", dict(
        attn_implementation="eager", layer_types=["full_attention", "sliding_attention"], sliding_window=WINDOW,
        v_head_dim=6,
        mlp_layer_types=["dense", "sparse"], n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
        n_group=2, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.0,
        rope_parameters={"sliding_attention": dict(rope_type="default", rope_theta=100.0, partial_rotary_factor=0.5),
                         "full_attention": dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5)})),
    # Solar Open: experts in every layer (8, top 2 of the best group of 2, a score bias) and a shared one
    "solar_open": ("solar_open", dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                                      n_shared_experts=1, n_group=2, topk_group=1, norm_topk_prob=True,
                                      routed_scaling_factor=2.0)),
    # HY-V3: layer 0 dense, layer 1 sigmoid-routed experts (8, top 2, a score bias) and a shared one added in
    # float32, q/k norms; weights at 0.02 (its config's 0.006 left the router's scores near 0.5)
    "hy_v3": ("hy_v3", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, num_shared_experts=1,
                            router_scaling_factor=2.0, mlp_layer_types=["dense", "sparse"], initializer_range=0.02)),
    # q/k norms over all heads, half of each head rotated, sigmoid-routed experts (8, top 2) with a score bias
    # and the router loss
    "minimax_m2": ("minimax_m2", dict(num_local_experts=8, num_experts_per_tok=2, **rope(
        rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5), **MOE_LOSS)),
    # layer 0 dense and windowed (its window reaches attention only as the module's: Note [A window
    # held, not passed]), layer 1 experts plus a gated shared expert, with the router loss
    "qwen2_moe": ("qwen2_moe", dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=32,
        mlp_only_layers=[0], qkv_bias=True, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2,
        **MOE_LOSS)),
    # Laguna: 4 query heads on layer 0, 8 on layer 1 (windowed, then full with half of each head rotated), a
    # softplus gate on the attention output, layer 0 dense, layer 1 sigmoid-routed experts and a shared one
    "laguna": ("laguna", dict(**SLIDING_FULL, num_attention_heads_per_layer=[4, 8], num_experts=4,
                              num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16,
                              mlp_layer_types=["dense", "sparse"], rope_parameters={
                                  "sliding_attention": dict(rope_type="default", rope_theta=100.0),
                                  "full_attention": dict(rope_type="default", rope_theta=10000.0,
                                                         partial_rotary_factor=0.5)}, **MOE_LOSS)),
    # Beam: layer 0 windowed with RoPE and dense, layer 1 full without RoPE (its queries scaled by position),
    # experts chosen by group with a score bias; a sigmoid gate on the attention output, the final soft-cap
    "beam": ("beam", dict(**SLIDING_FULL, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, n_group=2,
                          topk_group=1, routed_scaling_factor=2.0, final_logit_softcapping=1.0,
                          mlp_layer_types=["dense", "sparse"], rope_parameters={
                              "sliding_attention": dict(rope_type="default", rope_theta=100.0),
                              "full_attention": None})),
    # Kolibri-1: layer 0 windowed with RoPE, layer 1 full without (EXAONE 4's attention), q/k norms, norms after
    # attention and MLP, experts in every layer (8, top 2, sigmoid, a score bias; not renormalised: its config's
    # default) beside a shared one
    "kolibri1": ("kolibri1", dict(**SLIDING_FULL, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                                  shared_expert_intermediate_size=16)),
    # Flint: sinks, layer 0 windowed with RoPE and dense, layer 1 full without RoPE, experts and an ungated shared one
    "flint": ("flint", dict(**SLIDING_FULL, attn_implementation="eager", num_experts=4, num_experts_per_tok=2,
                            moe_intermediate_size=16, shared_expert_intermediate_size=32, mlp_only_layers=[0],
                            **MOE_LOSS)),
}
MOE = {"kolibri1", "laguna", "beam", "flint", "granitemoe", "granitemoeshared", "granitemoe_swa", "glm4_moe",
       "qwen2_moe", "gemma4_moe", "minimax_m2", "dots1", "ernie4_5_moe", "hunyuan_v1_moe", "exaone_moe", "afmoe",
       "solar_open", "hy_v3", "mimo_v2_flash", "cohere2_moe", "flex_olmo", "sarvam_moe", "mellum"}
#: Families whose float64 runs agree to float32 precision only: norms computed in float32 (Cohere 2's
#: LayerNorm, Gemma 4's (12B's too), Helium's and VaultGemma's RMSNorm), Granite SWA's attention (its softmax and
#: sink scale in float32), routers in float32 (GLM-4.5's gate and its
#: score bias), the router loss.
FLOAT32_ONLY = {"cohere2", "gemma4_text", "gemma4_unified_text", "granite_swa", "helium", "vaultgemma", *MOE}


#: MoE families whose transformers 4 models fail in float64 themselves, single-process (4.56.2: GLM-4.5's and
#: dots.llm1's index_add_ of float64 expert outputs into a float32 buffer, ERNIE 4.5's float32 router weight
#: against float64 inputs).
FLOAT64_FAILS_ON_4 = {"glm4_moe", "dots1", "ernie4_5_moe"}


def skip_reason(name: str, dtype: torch.dtype = torch.float32) -> str | None:
    """Why family ``name`` cannot be checked in ``dtype`` with the installed transformers: absent,
    refused, or failing in single-process transformers itself."""
    model_type = FAMILIES[name][0]
    if model_type not in CONFIG_MAPPING_NAMES:
        return f"transformers {transformers.__version__} has no {model_type!r}"
    if name in FLOAT64_FAILS_ON_4 and dtype == torch.float64 and not TRANSFORMERS_5:
        return (f"transformers {transformers.__version__}'s {model_type} fails in float64 itself (float32 "
                "buffers or weights among the experts' float64 tensors); float32 is checked")
    return transformers_refusal(model_type, transformers.__version__)


def family_model(name: str, dtype=torch.float32, **overrides):
    """The family's model in ``dtype``, its biases (and GLM-4.5's router score bias) set non-zero."""
    model_type, family_overrides = FAMILIES[name]
    config = AutoConfig.for_model(model_type, **{**BASE, **family_overrides, **overrides})
    torch.manual_seed(0)
    experts = {"experts_implementation": "eager"} if name in MOE and TRANSFORMERS_5 else {}
    # .to: GLM-4.5 keeps its router's weight and score bias in float32 whatever the dtype (its
    # _keep_in_fp32_modules_strict); its router computes in float32 either way
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, **experts).to(dtype)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for tensor_name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            # the score bias about as large as the scores' spread (~0.03): larger, the same experts win every token
            router_bias = tensor_name.endswith(("e_score_correction_bias", "expert_bias"))  # AFMoE's is expert_bias
            scale = 0.04 if router_bias else 1.0
            # Beam's per-head bias of its attention output gate (zeros at init) too
            if tensor_name.endswith(("_proj.bias", "self_attn.gate_bias")) or router_bias:
                tensor.copy_(scale * (torch.rand(tensor.shape, generator=generator, dtype=tensor.dtype) - 0.5))
            # Gemma 4's per-layer output scale (a buffer, ones at init); 0.75 to 1.25: at 0.5 to 1.5 one embedding
            # gradient of Gemma 4's float32 all-gather run was 1.5e-5 off (rounding: in float64 it agrees to 3e-9)
            if tensor_name.endswith("layer_scalar"):
                tensor.copy_(0.75 + 0.5 * torch.rand(tensor.shape, generator=generator, dtype=tensor.dtype))
    # transformers 4's experts are separate modules, and one that no token of a rank picked gets no gradient
    # there: every expert made part of the graph, as the trainer does (Note [An expert no token picked]); the
    # output is unchanged, and single-process transformers' idle experts get zeros instead of None
    apply_expert_gradients(model)
    return model


@functools.cache
def family_reference(name: str, dtype: torch.dtype):
    """(pristine, reference, logits, loss): test_families.family_reference of this module's families."""
    reference = family_model(name, dtype)
    pristine = copy.deepcopy(reference)
    return pristine, reference, *hf_reference(reference, batch())


#: Families whose forward soft-caps the logits in float32 whatever the model's dtype (transformers 5.24
#: BeamForCausalLM: ``logits.float()``): their float64 runs compare float64 logits with float32 ones.
LOGITS_IN_FLOAT32 = {"beam"}


def tolerance(name: str, dtype: torch.dtype) -> dict:
    tol = TOLERANCE[torch.float32 if name in FLOAT32_ONLY else dtype]
    return {**tol, "check_dtype": False} if name in LOGITS_IN_FLOAT32 else tol


def check_family(name: str, strategy: str, cp: int, sharded: bool, dtype: torch.dtype):
    tol = tolerance(name, dtype)
    pristine, reference, ref_logits, ref_loss = family_reference(name, dtype)
    check_cp_against_reference(copy.deepcopy(pristine), reference, batch(), ref_logits, ref_loss, mesh_for(cp),
                               strategy=strategy, sharded=sharded, tol=tol, max_seq_len=SEQ_LEN,
                               ulysses_degree=2 if strategy == "hybrid" else 0)


#: (strategy, cp, FSDP, dtype) of each family's checks: every strategy, cp 1, 2 and 4, plain and FSDP,
#: float32 and float64, but not every combination (test_families.py's 18 per family: the kernel's code is
#: the same for every family, and these families differ from the older ones only before and after it).
#: Measured on the 2-core machine: the full matrix and all-gather and hybrid, 240 checks, 63 s; these, ~25 s.
RUNS = [("ring", 1, False, torch.float64), ("ring", 2, True, torch.float32), ("ulysses", 2, False, torch.float64),
        ("ring", 4, False, torch.float64), ("ulysses", 4, True, torch.float32), ("allgather", 2, False, torch.float32),
        ("hybrid", 4, True, torch.float64)]
for _name in FAMILIES:
    for _strategy, _cp, _sharded, _dtype in RUNS:
        checks.add(functools.partial(check_family, _name, _strategy, _cp, _sharded, _dtype),
                   name=f"{_name}_{_strategy}_cp{_cp}_{'fsdp' if _sharded else 'plain'}_{str(_dtype)[6:]}",
                   skip=skip_reason(_name, _dtype), group=None if _sharded else _cp)



def check_gemma4_checkpointed(name: str):
    """Gemma 4 with each decoder layer checkpointed as the trainer does it (transformers' per-layer
    checkpointing, non-reentrant): the layers that reuse keys and values read them from a dict their
    recompute in backward shares with the forward, not from their inputs; ring at cp 2 with FSDP."""
    from llama_cp.fsdp_wrap import apply_activation_checkpointing

    pristine, reference, ref_logits, ref_loss = family_reference(name, torch.float32)
    model = copy.deepcopy(pristine)
    apply_activation_checkpointing(model)
    assert model.training and all(layer.gradient_checkpointing for layer in model.model.layers)
    check_cp_against_reference(model, reference, batch(), ref_logits, ref_loss, mesh_for(2), strategy="ring",
                               sharded=True, tol=TOLERANCE[torch.float32], max_seq_len=SEQ_LEN)


for _name in ("gemma4_text", "gemma4_moe", "gemma4_unified_text"):
    checks.add(functools.partial(check_gemma4_checkpointed, _name), name=f"{_name}_checkpointed_ring_cp2_fsdp_float32",
               skip=skip_reason(_name))


# Packed documents and LoRA, once per family (tests/attention/test_documents.py and test_families.py check
# the older ones in every layout): the kernel's document mask and peft's adapters are the same code for
# every family, so one run each shows they meet the family's windows, NoPE layers, biases and experts.
#: The families of issue 47, each once (olmo3_dynamic_rope is a second olmo3).
ISSUE_47 = [name for name, (model_type, _) in FAMILIES.items() if name == model_type]
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]  # transformers 5's fused experts


def forward_and_loss(model, data: dict):
    """Single-process transformers on ``data``'s rows (with their position_ids, if any): (logits, mean
    cross-entropy of the pre-shifted labels plus the router loss where the family's forward adds one)."""
    out = model(input_ids=data["input_ids"], position_ids=data.get("position_ids"), use_cache=False)
    loss = torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), data["labels"].flatten(), ignore_index=-100)
    if getattr(out, "aux_loss", None) is not None:
        loss = loss + model.config.router_aux_loss_coef * out.aux_loss
    return out.logits, loss


def check_documents(name: str):
    """Packed rows (document_checks.packed_batch: 1, 2, 7 and 50 documents of 96 tokens, position_ids
    restarting at each, documents cut by the shards) under ring at cp 2 with FSDP, float32, against
    transformers on the same rows (each document alone: ``documents_reference_is_per_document``)."""
    data, lengths = packed_batch()
    # a document crosses an edge of the zigzag chunks at cp 2 (24, 48, 72), a window is shorter than a document
    edges = range(DOCUMENT_LEN // 4, DOCUMENT_LEN, DOCUMENT_LEN // 4)
    assert any(edge not in itertools.accumulate(row) for row in lengths for edge in edges)
    reference = family_model(name)
    assert all(window < max(map(max, lengths)) for window in layer_windows(reference.config) if window)
    pristine = copy.deepcopy(reference)
    if name in PACKED_ROWS_ATTENDED_WHOLE:  # the reference: each document run alone, the rows' logits rebuilt
        logits = torch.stack([torch.cat([
            reference(input_ids=ids[None], position_ids=positions[None], use_cache=False).logits[0]
            for ids, positions in zip(data["input_ids"][row].split(row_lengths),
                                      data["position_ids"][row].split(row_lengths), strict=True)])
            for row, row_lengths in enumerate(lengths)])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), data["labels"].flatten(), ignore_index=-100)
    else:
        logits, loss = forward_and_loss(reference, data)
    loss.backward()
    check_cp_against_reference(pristine, reference, data, logits.detach(), loss.detach(), mesh_for(2), strategy="ring",
                               sharded=True, tol=TOLERANCE[torch.float32], max_seq_len=DOCUMENT_LEN)


#: Families whose transformers model builds its masks without position_ids, so that its packed rows attend
#: across their documents (transformers 5.24 AfmoeModel); llama-cp's attend within them (--document_mask), and
#: the packed check's reference runs each document alone.
PACKED_ROWS_ATTENDED_WHOLE = {"afmoe"}


def check_documents_reference(name: str):
    """The reference of ``check_documents``: transformers on the packed rows equals each document run
    alone, and moves by more than 1e-3 with the rows attended whole (and, windowed, without windows)."""
    data, lengths = packed_batch()
    model = family_model(name)
    rows = dict(input_ids=data["input_ids"], position_ids=data["position_ids"], use_cache=False)
    with torch.no_grad():
        packed = model(**rows).logits
        for row, row_lengths in enumerate(lengths):
            pieces = (data["input_ids"][row], data["position_ids"][row], packed[row])
            for ids, positions, want in zip(*(piece.split(row_lengths) for piece in pieces), strict=True):
                alone = model(input_ids=ids[None], position_ids=positions[None], use_cache=False).logits[0]
                torch.testing.assert_close(want, alone, **TOLERANCE[torch.float32])
        # a mask of ones: transformers' plain causal mask over the whole row (no packed-sequence detection)
        off = {"documents": model(**rows, attention_mask=torch.ones_like(data["input_ids"])).logits}
        if any(layer_windows(model.config)):
            off["windows"] = family_model(name, sliding_window=DOCUMENT_LEN)(**rows).logits
    moved = {feature: float((packed - logits).abs().max()) for feature, logits in off.items()}
    assert min(moved.values()) > 1e-3, moved


def check_lora(name: str, strategy: str):
    """peft's LoRA on q/k/v/o (and an MoE's fused experts: target_parameters) at cp 2, float64, against
    single-process peft."""
    from peft import LoraConfig, get_peft_model

    from llama_cp.model.build import check_lora_targets

    experts = EXPERTS if name in MOE else []
    if name.startswith("granitemoe"):  # Granite 3 MoE holds its experts under block_sparse_moe
        experts = [target.replace("mlp.", "block_sparse_moe.") for target in EXPERTS]
    reference = family_model(name, torch.float64)
    check_lora_targets(reference, LORA_TARGETS, experts)
    moe_layers = sum(name.endswith("experts.down_proj") for name, _ in reference.named_parameters())
    torch.manual_seed(1)
    reference = get_peft_model(reference, LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS,
                                                     init_lora_weights=False,
                                                     **({"target_parameters": experts} if experts else {})))
    assert sum("experts" in key for key, p in reference.named_parameters() if p.requires_grad) == (
        2 * len(experts) * moe_layers)
    pristine = copy.deepcopy(reference)
    logits, loss = forward_and_loss(reference, batch())
    loss.backward()
    with torch.no_grad(), reference.disable_adapter():
        moved = float((reference(input_ids=batch()["input_ids"]).logits - logits).abs().max())
    assert moved > 1e-3, f"the adapters move the logits by {moved} only"
    tol = tolerance(name, torch.float64)
    check_cp_against_reference(pristine, reference, batch(), logits.detach(), loss.detach(), mesh_for(2),
                               strategy=strategy, sharded=False, tol=tol, max_seq_len=SEQ_LEN)


for _index, _name in enumerate(ISSUE_47):
    checks.add(functools.partial(check_documents, _name), name=f"{_name}_documents_ring_cp2_fsdp_float32",
               skip=skip_reason(_name))
    checks.add(functools.partial(check_documents_reference, _name), group=1,
               skip=skip_reason(_name) or (f"transformers' {_name} attends across a packed row's documents: the "
                                           "packed check runs each alone" if _name in PACKED_ROWS_ATTENDED_WHOLE
                                           else None), name=f"{_name}_documents_reference_is_per_document")
    _strategy = ("ulysses", "allgather")[_index % 2]
    checks.add(functools.partial(check_lora, _name, _strategy), name=f"{_name}_lora_{_strategy}_cp2_plain_float64",
               skip=skip_reason(_name) or (FUSED_EXPERTS_LORA_PROBLEM if _name in MOE else None)
               or skip_reason(_name, torch.float64), group=2)


def _fill(value: float, *suffixes: str):
    """A change of a built model: the parameters and buffers whose names end with one of ``suffixes`` set
    to ``value``."""
    def change(model):
        with torch.no_grad():
            for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
                if name.endswith(suffixes):
                    tensor.fill_(value)
    return change


def _zero(*suffixes: str):
    return _fill(0.0, *suffixes)


def _ones(*suffixes: str):
    return _fill(1.0, *suffixes)


BIASES = _zero("_proj.bias")


def _no_sinks(model):
    """A change of a built model: each attention sink at a logit no score is near (exp of it ~ 0)."""
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            if name.endswith("self_attn.sinks"):
                tensor.fill_(-1e4)
NO_WINDOWS = dict(sliding_window=SEQ_LEN)
#: Full layers without RoPE (windows as long as the sequence are no-ops) against the same layers
#: made windowed ones, which take RoPE.
NOPE_OFF = dict(layer_types=["sliding_attention"] * 2, sliding_window=SEQ_LEN)
#: Gemma 4's RoPE without the quarter-head "proportional" rotation of its full layers (the whole head rotated)
WHOLE_HEAD_ROPE = dict(rope_parameters={
    "sliding_attention": dict(rope_type="default", rope_theta=10000.0),
    "full_attention": dict(rope_type="proportional", partial_rotary_factor=1.0, rope_theta=1e6)})
#: "family: feature" -> (family, config overrides with the feature, config overrides and a change
#: of the built model without it).
FEATURES = {
    "ministral: windows": ("ministral", {}, NO_WINDOWS, None),
    "ernie4_5: biases": ("ernie4_5", {}, {}, BIASES),
    "hunyuan_v1_dense: biases": ("hunyuan_v1_dense", {}, {}, BIASES),
    "hunyuan_v1_dense: NTK-alpha RoPE": ("hunyuan_v1_dense", {}, rope(rope_type="default", rope_theta=10000.0), None),
    "seed_oss: biases": ("seed_oss", {}, {}, BIASES),
    "glm4: biases": ("glm4", {}, {}, BIASES),
    "glm4: partial rotary": ("glm4", {}, dict(partial_rotary_factor=1.0), None),
    "cohere2: windows": ("cohere2", {}, NO_WINDOWS, None),
    "cohere2: NoPE full layer": ("cohere2", NO_WINDOWS, NOPE_OFF, None),
    "cohere2_moe: windows": ("cohere2_moe", {}, NO_WINDOWS, None),
    "cohere2_moe: shared expert": ("cohere2_moe", {}, {}, _zero("shared_experts.down_proj.weight")),
    "cohere2_moe: dense layer 0": ("cohere2_moe", {}, dict(mlp_layer_types=["sparse", "sparse"]), None),
    "exaone4: windows": ("exaone4", {}, NO_WINDOWS, None),
    "exaone4: NoPE full layer": ("exaone4", NO_WINDOWS, NOPE_OFF, None),
    "smollm3: windows": ("smollm3", {}, NO_WINDOWS, None),
    "smollm3: NoPE layer": ("smollm3", {}, dict(no_rope_layers=[1, 1]), None),
    "olmo3: windows": ("olmo3", {}, NO_WINDOWS, None),
    "olmo3: RoPE per layer type": ("olmo3", {}, per_layer_type_rope(dict(rope_type="default", rope_theta=100.0)),
                                   None),
    "olmo3_dynamic_rope: dynamic RoPE": ("olmo3_dynamic_rope", {}, per_layer_type_rope(
        dict(rope_type="default", rope_theta=10000.0)), None),
    "ministral3: windows": ("ministral3", {}, NO_WINDOWS, None),
    "ministral3: query temperature": ("ministral3", {}, dict(rope_parameters={**MINISTRAL3_ROPE,
                                                                              "llama_4_scaling_beta": 0.0}), None),
    "apertus: biases": ("apertus", {}, {}, BIASES),
    "gemma4_text: windows": ("gemma4_text", {}, NO_WINDOWS, None),
    "gemma4_text: proportional RoPE": ("gemma4_text", {}, WHOLE_HEAD_ROPE, None),
    "gemma4_text: per-layer inputs": ("gemma4_text", {}, {}, _zero("per_layer_projection.weight")),
    "gemma4_text: logit soft-cap": ("gemma4_text", {}, dict(final_logit_softcapping=None), None),
    "gemma4_moe: experts": ("gemma4_moe", {}, {}, _zero("experts.down_proj")),
    "gemma4_text: layer scalars": ("gemma4_text", {}, {}, _ones("layer_scalar")),
    "gemma4_unified_text: windows": ("gemma4_unified_text", {}, NO_WINDOWS, None),
    "gemma4_unified_text: proportional RoPE": ("gemma4_unified_text", {}, WHOLE_HEAD_ROPE, None),
    "gemma4_unified_text: layer scalars": ("gemma4_unified_text", {}, {}, _ones("layer_scalar")),
    "gemma4_unified_text: logit soft-cap": ("gemma4_unified_text", {}, dict(final_logit_softcapping=None), None),
    "gemma4_unified_text: double-wide MLP": ("gemma4_unified_text", {}, dict(use_double_wide_mlp=False), None),
    "glm4_moe: biases": ("glm4_moe", {}, {}, BIASES),
    "glm4_moe: partial rotary": ("glm4_moe", {}, dict(partial_rotary_factor=1.0), None),
    "glm4_moe: shared experts": ("glm4_moe", {}, {}, _zero("shared_experts.down_proj.weight")),
    "glm4_moe: router score bias": ("glm4_moe", {}, {}, _zero("e_score_correction_bias")),
    "ernie4_5_moe: shared expert": ("ernie4_5_moe", {}, {}, _zero("shared_experts.down_proj.weight")),
    "ernie4_5_moe: router score bias": ("ernie4_5_moe", {}, {}, _zero("e_score_correction_bias")),
    "hunyuan_v1_moe: shared MLP": ("hunyuan_v1_moe", {}, {}, _zero("shared_mlp.down_proj.weight")),
    "hunyuan_v1_moe: biases": ("hunyuan_v1_moe", {}, {}, BIASES),
    "exaone_moe: windows": ("exaone_moe", {}, NO_WINDOWS, None),
    "exaone_moe: NoPE full layer": ("exaone_moe", NO_WINDOWS, NOPE_OFF, None),
    "exaone_moe: shared expert": ("exaone_moe", {}, {}, _zero("shared_experts.down_proj.weight")),
    "exaone_moe: router score bias": ("exaone_moe", {}, {}, _zero("e_score_correction_bias")),
    "afmoe: windows": ("afmoe", {}, NO_WINDOWS, None),
    "afmoe: NoPE full layer": ("afmoe", NO_WINDOWS, NOPE_OFF, None),
    "afmoe: attention output gate": ("afmoe", {}, {}, _zero("self_attn.gate_proj.weight")),
    "afmoe: router score bias": ("afmoe", {}, {}, _zero("expert_bias")),
    "arcee: biases": ("arcee", {}, {}, _zero("_proj.bias")),
    "mimo_v2_flash: windows": ("mimo_v2_flash", {}, NO_WINDOWS, None),
    "mimo_v2_flash: sinks": ("mimo_v2_flash", {}, {}, _no_sinks),
    "mimo_v2_flash: partial rotary": ("mimo_v2_flash", {}, dict(rope_parameters={
        kind: dict(rope_type="default", rope_theta=theta, partial_rotary_factor=1.0)
        for kind, theta in (("sliding_attention", 100.0), ("full_attention", 10000.0))}), None),
    "mimo_v2_flash: router score bias": ("mimo_v2_flash", {}, {}, _zero("e_score_correction_bias")),
    "nanochat: logit soft-cap": ("nanochat", {}, dict(final_logit_softcapping=None), None),
    "vaultgemma: windows": ("vaultgemma", {}, NO_WINDOWS, None),
    "vaultgemma: attention soft-cap": ("vaultgemma", {}, dict(attn_logit_softcapping=None), None),
    "vaultgemma: logit soft-cap": ("vaultgemma", {}, dict(final_logit_softcapping=None), None),
    "helium: biases": ("helium", {}, {}, BIASES),
    "internlm3: biases": ("internlm3", {}, {}, BIASES),
    "starcoder2: windows": ("starcoder2", {}, NO_WINDOWS, None),
    "starcoder2: biases": ("starcoder2", {}, {}, BIASES),
    "jais2: biases": ("jais2", {}, {}, BIASES),
    "exaone: biases": ("exaone", {}, {}, BIASES),
    "iquestcoder: biases": ("iquestcoder", {}, {}, BIASES),
    "hyperclovax: multipliers": ("hyperclovax", {}, dict(embedding_multiplier=1.0, residual_multiplier=1.0,
                                                         attention_multiplier=None, logits_scaling=1.0), None),
    "hyperclovax: norms after attention and MLP": ("hyperclovax", {}, dict(use_post_norm=False), None),
    "olmo: clip_qkv": ("olmo", {}, dict(clip_qkv=None), None),
    "glm: partial rotary": ("glm", {}, dict(partial_rotary_factor=1.0), None),
    "glm: biases": ("glm", {}, {}, BIASES),
    "flex_olmo: top-k renormalized": ("flex_olmo", {}, dict(norm_topk_prob=False), None),
    "sarvam_moe: shared expert": ("sarvam_moe", {}, dict(n_shared_experts=0), None),
    "mellum: top-k renormalized": ("mellum", {}, dict(norm_topk_prob=False), None),
    "solar_open: shared expert": ("solar_open", {}, {}, _zero("shared_experts.down_proj.weight")),
    "solar_open: router score bias": ("solar_open", {}, {}, _zero("e_score_correction_bias")),
    "hy_v3: shared expert": ("hy_v3", {}, {}, _zero("shared_experts.down_proj.weight")),
    "hy_v3: router score bias": ("hy_v3", {}, {}, _zero("e_score_correction_bias")),
    "hy_v3: dense layer 0": ("hy_v3", {}, dict(mlp_layer_types=["sparse", "sparse"]), None),
    "dots1: windows": ("dots1", {}, NO_WINDOWS, None),
    "dots1: shared expert": ("dots1", {}, {}, _zero("shared_experts.down_proj.weight")),
    "dots1: router score bias": ("dots1", {}, {}, _zero("e_score_correction_bias")),
    "minimax_m2: router score bias": ("minimax_m2", {}, {}, _zero("e_score_correction_bias")),
    "minimax_m2: partial rotary": ("minimax_m2", {}, rope(rope_type="default", rope_theta=10000.0,
                                                           partial_rotary_factor=1.0), None),
    "qwen2_moe: windows": ("qwen2_moe", {}, NO_WINDOWS, None),
    "qwen2_moe: biases": ("qwen2_moe", {}, {}, BIASES),
    "qwen2_moe: shared expert": ("qwen2_moe", {}, {}, _zero("shared_expert.down_proj.weight")),
    "cwm: windows": ("cwm", {}, NO_WINDOWS, None),
    "granite_swa: windows": ("granite_swa", {}, NO_WINDOWS, None),
    "granite_swa: sinks": ("granite_swa", {}, {}, _no_sinks),
    "granite_swa: NoPE full layer": ("granite_swa", {}, dict(layer_rope_theta=[10000.0, 10000.0]), None),
    "granite_swa: multipliers": ("granite_swa", {}, dict(embedding_multiplier=1.0, residual_multiplier=1.0,
                                                         attention_multiplier=8 ** -0.5, logits_scaling=1.0), None),
    "granitemoe_swa: sinks": ("granitemoe_swa", {}, {}, _no_sinks),
    "granitemoe_swa: shared MLP": ("granitemoe_swa", {}, dict(shared_intermediate_size=0), None),
    "granitemoe: multipliers": ("granitemoe", {}, dict(embedding_multiplier=1.0, residual_multiplier=1.0,
                                                       attention_multiplier=8 ** -0.5, logits_scaling=1.0), None),
    "granitemoeshared: shared MLP": ("granitemoeshared", {}, dict(shared_intermediate_size=0), None),
    "laguna: windows": ("laguna", {}, NO_WINDOWS, None),
    "laguna: attention output gate": ("laguna", {}, {}, _zero("self_attn.g_proj.weight")),
    "laguna: partial rotary": ("laguna", {}, dict(rope_parameters={
        kind: dict(rope_type="default", rope_theta=theta) for kind, theta in (("sliding_attention", 100.0),
                                                                              ("full_attention", 10000.0))}), None),
    "laguna: shared expert": ("laguna", {}, {}, _zero("shared_experts.down_proj.weight")),
    "laguna: router score bias": ("laguna", {}, {}, _zero("e_score_correction_bias")),
    "beam: windows": ("beam", {}, NO_WINDOWS, None),
    "beam: NoPE full layer": ("beam", NO_WINDOWS, NOPE_OFF, None),
    "beam: attention output gate": ("beam", {}, {}, _zero("self_attn.gate_proj.weight", "self_attn.gate_bias")),
    "beam: router score bias": ("beam", {}, {}, _zero("e_score_correction_bias")),
    "beam: logit soft-cap": ("beam", {}, dict(final_logit_softcapping=None), None),
    "kolibri1: windows": ("kolibri1", {}, NO_WINDOWS, None),
    "kolibri1: NoPE full layer": ("kolibri1", NO_WINDOWS, NOPE_OFF, None),
    "kolibri1: shared expert": ("kolibri1", {}, {}, _zero("shared_experts.down_proj.weight")),
    "kolibri1: router score bias": ("kolibri1", {}, {}, _zero("e_score_correction_bias")),
    "flint: windows": ("flint", {}, NO_WINDOWS, None),
    "flint: NoPE full layer": ("flint", NO_WINDOWS, NOPE_OFF, None),
    "flint: sinks": ("flint", {}, {}, _no_sinks),
    "flint: shared expert": ("flint", {}, {}, _zero("shared_expert.down_proj.weight")),
}


@functools.partial(checks.add, group=1)
def features_change_the_result():
    """Each family's feature is not a no-op on the test batch: switched off, the logits move by more
    than 1e-3 (the assertion message lists how far each moved). Families transformers lacks: none."""
    input_ids = batch()["input_ids"]
    moved = {}
    for feature, (name, with_it, without_it, change) in FEATURES.items():
        if FAMILIES[name][0] not in CONFIG_MAPPING_NAMES:
            continue
        with torch.no_grad():
            on, off = family_model(name, **with_it), family_model(name, **without_it)
            if change is not None:
                change(off)
            moved[feature] = float((on(input_ids=input_ids).logits - off(input_ids=input_ids).logits).abs().max())
    assert min(moved.values()) > 1e-3, moved


#: Beam's full layers scale their queries by (1 + (position + 1) / 2048) ** 0.1 (transformers 5.24 beam
#: compute_attention_scaling, from the global position_ids): 1.0 to 1.0016 over positions 0 to 31, which moves the
#: logits by 1.8e-4 only (float64); rows continuing a document from position 4096 scale them by about 1.12.
BEAM_FAR = 4096


def beam_far_rows() -> dict:
    return dict(batch(), position_ids=torch.arange(BEAM_FAR, BEAM_FAR + SEQ_LEN).expand(2, -1))


def check_beam_far_positions(strategy: str, cp: int):
    """Beam on rows continuing a document from position 4096, float64, against transformers given those
    position_ids: each shard's query scale must come from its tokens' global positions."""
    data = beam_far_rows()
    reference = family_model("beam", torch.float64)
    pristine = copy.deepcopy(reference)
    logits, loss = forward_and_loss(reference, data)
    loss.backward()
    check_cp_against_reference(pristine, reference, data, logits.detach(), loss.detach(), mesh_for(cp),
                               strategy=strategy, sharded=False, tol=tolerance("beam", torch.float64),
                               max_seq_len=SEQ_LEN)


for _strategy, _cp in (("ring", 2), ("ulysses", 4)):
    checks.add(functools.partial(check_beam_far_positions, _strategy, _cp), group=_cp, skip=skip_reason("beam"),
               name=f"beam_far_positions_{_strategy}_cp{_cp}_plain_float64")


@functools.partial(checks.add, group=1, skip=skip_reason("beam"))
def beam_position_scaling_changes_the_result():
    """Rows moved from position 0 to 4096 change Beam's logits only through its full layers' query scale (its
    windowed layers' RoPE is relative, its full layers have none): by more than 1e-3 (0.17), and by under 1e-4 with
    the scale made 1 (1.5e-5: the rotary table's float32 rounding at position 4096)."""
    from transformers.models.beam import modeling_beam

    model, ids = family_model("beam", torch.float64), batch()["input_ids"]

    def moved_by_the_shift() -> float:
        far, near = (model(input_ids=ids, position_ids=torch.arange(start, start + SEQ_LEN).expand(2, -1)).logits
                     for start in (BEAM_FAR, 0))
        return float((far - near).abs().max())

    with torch.no_grad():
        moved = moved_by_the_shift()
        scale = modeling_beam.compute_attention_scaling
        modeling_beam.compute_attention_scaling = lambda position_ids: torch.ones_like(scale(position_ids))
        try:
            unscaled = moved_by_the_shift()
        finally:
            modeling_beam.compute_attention_scaling = scale
    assert moved > 1e-3 and unscaled < 1e-4, (moved, unscaled)


@functools.partial(checks.add, group=4, skip=skip_reason("laguna"))
def laguna_ulysses_refused_where_a_layers_heads_do_not_split():
    """Laguna's heads vary by layer: with 4 and 2 query heads, Ulysses at cp 4 is refused in one line naming
    num_attention_heads_per_layer (num_attention_heads, 4, splits; the 2-head layer would not); at cp 2 it runs."""
    model = family_model("laguna", num_attention_heads_per_layer=[4, 2])
    with pytest.raises(ValueError, match=r"^cp_strategy='ulysses' needs num_attention_heads_per_layer \(2, 4: 2 "
                                         r"divides each\) divisible by cp \(4\); use cp_strategy='ring' or a cp "
                                         r"that divides 2$"):
        apply_context_parallel(model, mesh_for(4)["cp"], strategy="ulysses", max_seq_len=SEQ_LEN)
    with pytest.raises(ValueError, match=r"^--ulysses_degree 4 must divide num_attention_heads_per_layer \(2, 4: 2 "):
        apply_context_parallel(model, mesh_for(4)["cp"], strategy="hybrid", ulysses_degree=4, max_seq_len=SEQ_LEN)


def test_gemma4_test_models_hold_the_features_they_are_checked_for():
    """The layers that reuse keys and values hold no k/v projections, the full layers values that are their
    keys and heads of their own size: what check_family compares under CP is Gemma 4's own structure."""
    if skip_reason("gemma4_text"):
        pytest.skip(skip_reason("gemma4_text"))
    for name in ("gemma4_text", "gemma4_moe", "gemma4_unified_text"):
        layers = family_model(name).model.layers
        assert [layer.self_attn.is_kv_shared_layer for layer in layers] == [False, False, True, True]
        assert [hasattr(layer.self_attn, "k_proj") for layer in layers] == [True, True, False, False]
        assert layers[0].self_attn.v_proj is not None and layers[1].self_attn.v_proj is None  # keys as values
        assert [layer.self_attn.head_dim for layer in layers] == [8, 16, 8, 16]
        assert layers[1].self_attn.k_proj.out_features == 16  # one key/value head on the full layers
    for name in ("gemma4_moe", "gemma4_unified_text"):
        assert family_model(name).model.layers[2].mlp.up_proj.out_features == 2 * BASE["intermediate_size"]


def test_gemma4_attending_every_token_both_ways_is_refused():
    """Gemma 4's use_bidirectional_attention="all" (an encoder) is refused in one line; "vision" (image
    tokens both ways, text causal) is checked exact above."""
    if skip_reason("gemma4_text"):
        pytest.skip(skip_reason("gemma4_text"))
    with pytest.raises(ValueError, match=r"^gemma4_text: config.use_bidirectional_attention='all' \(an encoder"):
        check_supported(family_model("gemma4_text", use_bidirectional_attention="all"))


def test_attention_kwargs_it_does_not_compute_are_refused():
    """A kwarg of the attention call that changes the result and that the kernel does not compute
    (UNCOMPUTED_KWARGS: sinks, an additive position bias) is refused in one line naming it, not
    dropped; None (no such feature) is accepted."""
    model = apply_context_parallel(AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **BASE)), None)
    layer = model.model.layers[0].self_attn
    q = k = v = torch.randn(1, 4, 8, 8)
    for name in UNCOMPUTED_KWARGS:
        with pytest.raises(ValueError, match=rf"^LlamaAttention passes {name}= to its attention: .*, which "
                                             "context-parallel attention does not compute"):
            cp_attention_forward(layer, q, k, v, None, **{name: torch.zeros(4)})
    out, _ = cp_attention_forward(layer, q, k, v, None, **dict.fromkeys(UNCOMPUTED_KWARGS))
    assert out.shape == (1, 8, 4, 8)


results = checks.module_fixture(__name__, WORLD_SIZE)


@pytest.mark.parametrize("name", checks.names)
def test_check(results, name):
    checks.assert_passed(results, name)


#: Refused families -> (config fields of a tiny one, what the one-line reason names).
REFUSED = {
    "qwen3_next": ({}, r"linear-attention layers \(gated DeltaNet.*recurrent state"),
    "qwen3_5_text": ({}, r"linear-attention layers \(gated DeltaNet.*recurrent state"),
    "qwen3_5_moe_text": ({}, r"linear-attention layers \(gated DeltaNet.*recurrent state"),
    "kimi_linear": ({}, r"linear-attention layers \(Kimi Delta Attention\).*recurrent state"),
    "falcon_h1": ({}, r"Mamba2 mixers.*recurrent state"),
    "granitemoehybrid": (dict(mamba_n_heads=8, layer_types=["linear_attention", "full_attention"] if TRANSFORMERS_5
                              else ["mamba", "attention"]), r"Mamba2 layers.*recurrent state"),
    "lfm2": ({}, r"short-convolution layers read the few tokens before each position.*another rank's shard"),
    "qwen4_exp_text": ({}, r"linear-attention layers \(gated DeltaNet.*recurrent state"),
    "olmo_hybrid": ({}, r"linear-attention layers \(gated DeltaNet\).*recurrent state"),
    "bailing_hybrid": ({}, r"linear-attention layers \(delta attention\).*recurrent state"),
    "minimax": ({}, r"lightning-attention layers \(linear attention\).*recurrent state"),
    "nemotron_h": ({}, r"Mamba layers.*recurrent state"),
    "jamba": ({}, r"Mamba layers.*recurrent state"),
    "deepseek_v32": ({}, r"sparse attention lets a learned indexer pick each query's keys"),
    "glm_moe_dsa": ({}, r"sparse attention lets a learned indexer pick each query's keys"),
    "phimoe": (dict(num_local_experts=4), r"router draws each token's experts at random in training"),
    "nemotron": ({}, r"decoder layers call attention without the keyword arguments they get"),
    "stablelm": ({}, r"decoder layers call attention without the keyword arguments they get"),
}


@pytest.mark.parametrize("model_type", REFUSED)
def test_refused_by_name_with_the_reason(model_type):
    """Built on the meta device: refused at apply_context_parallel (and check_supported) in one line."""
    if model_type in SUPPORTED_FAMILIES:  # the kernel computes it now: checked exact elsewhere
        pytest.skip(f"{model_type} is in SUPPORTED_FAMILIES")
    if model_type not in CONFIG_MAPPING_NAMES:
        pytest.skip(f"transformers {transformers.__version__} has no {model_type!r}")
    fields, reason = REFUSED[model_type]
    config = AutoConfig.for_model(model_type, **{k: v for k, v in {**BASE, **fields}.items() if v is not None})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError, match=rf"^model family '{model_type}' \(\w+\) is not supported by llama-cp: "
                                         rf"[^\n]*{reason}[^\n]*\. Supported families: [^\n]*$"):
        apply_context_parallel(model, None)


#: Refused families whose tiny configs do not build; refused from their configs (the released defaults).
REFUSED_BY_CONFIG = {
    "lfm2_moe": r"short-convolution layers read the few tokens before each position",
    "bamba": r"Mamba layers.*recurrent state", "zamba2": r"Mamba layers.*recurrent state",
    "mamba2": r"state-space model \(Mamba\).*recurrent state", "deepseek_v4": r"learned indexer pick each query's keys",
    **dict.fromkeys(("lfm3", "inkling_text", "inkling2_text", "inkling2_loop_text"),
                    r"short-convolution layers read the few tokens before each position"),
    "zaya": r"convolutional attention \(CCA\).*read the few tokens before each position",
    "lara_mini": r"linear-attention layers \(gated DeltaNet.*recurrent state",
    "recurrent_gemma": r"recurrent layers \(RG-LRU\).*recurrent state",
    "rwkv": r"recurrent network \(RWKV\).*recurrent state", "xlstm": r"recurrent network \(xLSTM\).*recurrent state",
    **dict.fromkeys(("axk2", "dots3_note_text", "dots3_note", "hy_v4", "mistral_large4", "mistral_large4_text"),
                    r"learned indexer pick each query's keys"),
    "gemma4_unified_assistant": r"speculative-decoding drafter: its forward takes the main Gemma 4 model's",
    "minimax_m3_vl_text": r"learned indexer pick each query's keys \(its top k blocks",
}


@pytest.mark.parametrize("model_type", REFUSED_BY_CONFIG)
def test_refused_from_the_config_by_name_with_the_reason(model_type):
    from llama_cp.modules.families import check_family

    if model_type not in CONFIG_MAPPING_NAMES:
        pytest.skip(f"transformers {transformers.__version__} has no {model_type!r}")
    with pytest.raises(ValueError, match=rf"^model family '{model_type}' \(\w+\) is not supported by llama-cp: "
                                         rf"[^\n]*{REFUSED_BY_CONFIG[model_type]}"):
        check_family(AutoConfig.for_model(model_type))


def test_gemma4_drafter_is_refused_naming_the_main_model():
    """Gemma 4's drafter for speculative decoding (gemma4_assistant: its released configs turn per-layer inputs
    off) takes the main model's embeddings and keys and values: refused from its config in one line."""
    from llama_cp.modules.families import check_family

    if "gemma4_assistant" not in CONFIG_MAPPING_NAMES:
        pytest.skip(f"transformers {transformers.__version__} has no 'gemma4_assistant'")
    config = AutoConfig.for_model("gemma4_assistant", text_config=dict(hidden_size_per_layer_input=0,
                                                                       vocab_size_per_layer_input=0))
    with pytest.raises(ValueError, match=r"^model family 'gemma4_assistant' \(Gemma4AssistantForCausalLM\) is not "
                                         r"supported by llama-cp: it is a speculative-decoding drafter: .*\(fine-tune "
                                         r"the main model\)"):
        check_family(config)


def test_smollm3_windows_its_attention_would_not_take_are_refused():
    """SmolLM3 with sliding_attention layers but use_sliding_window=False (transformers' sdpa windows
    them, its attention call passes no window) is refused in one line naming both fields."""
    if skip_reason("smollm3"):
        pytest.skip(skip_reason("smollm3"))
    model = family_model("smollm3", use_sliding_window=False, layer_types=["full_attention", "sliding_attention"])
    with pytest.raises(ValueError, match=r"^smollm3: config.layer_types has sliding_attention layers but "
                                         r"use_sliding_window=False.*set use_sliding_window=True"):
        check_supported(model)


def test_qwen2_moe_is_refused_where_transformers_calls_sdpa_itself():
    """Note [A family's transformers floor]: Qwen2-MoE below transformers 5 is refused in one line."""
    assert transformers_refusal("qwen2_moe", "4.57.6") == (
        "model family 'qwen2_moe' needs transformers >= 5.0 (installed: 4.57.6): before that its attention calls "
        "SDPA itself, so context-parallel attention cannot take its place; upgrade transformers")
    assert transformers_refusal("qwen2_moe", "5.0.0") is None
    refusal = transformers_refusal("qwen2_moe", transformers.__version__)
    if refusal is not None:
        with pytest.raises(ValueError, match=re.escape(refusal)):
            apply_context_parallel(AutoModelForCausalLM.from_config(AutoConfig.for_model(
                "qwen2_moe", **BASE, num_experts=4, num_experts_per_tok=2)), None)


def test_granite_moe_is_refused_where_transformers_builds_its_own_mask():
    """Note [A family's transformers floor]: Granite 3 MoE below transformers 5 builds a 4-D mask of its own
    (refused at the attention call, loudly, but only once the run is under way): refused in one line at start."""
    for family in ("granitemoe", "granitemoeshared"):
        assert transformers_refusal(family, "4.57.6") == (
            f"model family '{family}' needs transformers >= 5.0 (installed: 4.57.6): before that its model builds a "
            "4-D attention mask of its own (_update_causal_mask), which context-parallel attention does not take; "
            "upgrade transformers")
        assert transformers_refusal(family, "5.0.0") is None


def test_each_layer_window_is_the_one_its_attention_takes():
    """layer_windows (CP's windowed layouts, FLOPs) names the window each layer's attention call
    takes (Note [A window held, not passed]), recorded on a forward: Exaone 4 holds the config's
    window on its full layer too but passes None there; Qwen2-MoE holds its window, passes none."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    taken = {}

    def record(module, query, key, value, attention_mask, **kwargs):
        held = getattr(module, "sliding_window", None)
        taken[module.layer_idx] = kwargs["sliding_window"] if "sliding_window" in kwargs else held
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("llama_cp_test_record_windows", record)
    for name in ("ministral", "cohere2", "cohere2_moe", "exaone4", "exaone_moe", "afmoe", "smollm3", "olmo3",
                 "qwen2_moe", "starcoder2"):
        if skip_reason(name):
            continue
        model = family_model(name)
        model.set_attn_implementation("llama_cp_test_record_windows")
        taken.clear()
        with torch.no_grad():
            model(input_ids=batch()["input_ids"])
        want = [None, WINDOW] if name == "smollm3" else [WINDOW] * 2 if name == "starcoder2" else [WINDOW, None]
        assert [taken[i] for i in range(2)] == layer_windows(model.config) == want, name


def test_router_loss_where_transformers_adds_one():
    """Qwen2-MoE's forward adds the router loss (the checks above include it); GLM-4.5's adds none, so
    --router_aux_loss_coef is refused for it in one line rather than training a loss it never had."""
    from llama_cp.modules.families import RouterLoss, router_loss, set_router_loss_coef

    if not skip_reason("qwen2_moe"):
        assert router_loss(family_model("qwen2_moe")) == RouterLoss(num_experts=4, top_k=2, coef=0.3)
    config = AutoConfig.for_model("glm4_moe", **{**BASE, **FAMILIES["glm4_moe"][1]})
    with pytest.raises(ValueError, match=r"^--router_aux_loss_coef 0.1: 'glm4_moe' adds no router load-balancing "
                                         r"loss \(families that do: .*qwen2_moe.*\); drop the flag$"):
        set_router_loss_coef(config, 0.1)
    set_router_loss_coef(config, -1)  # the model's own: accepted
