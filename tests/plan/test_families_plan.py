"""The planner and the model FLOPs of the families of issue 47 (tests/modules/test_families_new.py
checks them exact): a tiny config of each is planned (ring, cp 2, the trainer's build), and its
model_flops are what torch's FlopCounterMode measures on a forward and backward (shared experts,
dense layers among the MoE ones, fused gate_up_proj, biases)."""

from __future__ import annotations

import functools

import pytest
import torch
import transformers
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

from llama_cp.config import TrainConfig
from llama_cp.model.flops import model_flops
from llama_cp.modules.families import SUPPORTED_FAMILIES, transformers_refusal
from llama_cp.plan.simulate import plan_step_memory

BASE = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
            eos_token_id=2)
WINDOWED = dict(layer_types=["sliding_attention", "full_attention"], sliding_window=6)
#: model_type -> config fields: what changes the shapes or the work.
FAMILIES = {
    "ministral": WINDOWED,
    "ernie4_5": dict(use_bias=True),  # the MLP's biases too
    "hunyuan_v1_dense": dict(attention_bias=True),
    "seed_oss": dict(attention_bias=True, attention_out_bias=True, attention_dropout=0.0),
    "glm4": dict(attention_bias=True, partial_rotary_factor=0.5),  # fused gate_up_proj
    "cohere2": WINDOWED,
    "nanochat": dict(final_logit_softcapping=15.0),  # an ungated MLP
    "vaultgemma": dict(WINDOWED, attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
    "helium": dict(attention_bias=True),
    "internlm3": dict(qkv_bias=True, bias=True),
    "starcoder2": dict(sliding_window=6, use_bias=True),  # an ungated MLP of c_fc and c_proj, biases
    "jais2": {},  # an ungated MLP, biases (its defaults)
    "exaone": dict(attention_bias=True),
    "iquestcoder": dict(attention_bias=True),
    "hyperclovax": dict(embedding_multiplier=2.0, logits_scaling=0.5),
    "olmo": dict(clip_qkv=0.05),
    "glm": {},  # fused gate_up_proj, q/k/v biases
    "bitnet": {},  # the norms inside attention and the MLP
    "flex_olmo": dict(num_experts=4, num_experts_per_tok=2),  # every layer's experts
    "sarvam_moe": dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, n_shared_experts=1,
                       first_k_dense_replace=1, n_group=1, topk_group=1),  # layer 0 dense, layer 1 experts + shared
    "mellum": dict(num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                   mlp_layer_types=["dense", "sparse"]),
    # layer 0 dense of its own size, layer 1 experts of intermediate_size + a shared one
    "cohere2_moe": dict(WINDOWED, mlp_layer_types=["dense", "sparse"], prefix_dense_intermediate_size=48, num_experts=4,
                        num_experts_per_tok=2, num_shared_experts=1),
    "exaone4": WINDOWED,
    "smollm3": dict(no_rope_layer_interval=2, use_sliding_window=True, sliding_window=6),
    "olmo3": WINDOWED,
    "ministral3": dict(sliding_window=6),  # every layer windowed
    "apertus": dict(attention_bias=True),
    "apertus1p5_text": dict(attention_bias=True, vocab_size=128, output_vocab_size=96),  # an output layer of 96 rows
    # sliding layers of head size 8 (2 key/value heads), full ones of 16 (1 head, values = keys), layers 2-3
    # reusing layers 0-1's keys and values (no k/v projections), per-layer embeddings, an expert block
    # beside each MLP (4 experts, top 2), a double-wide MLP on the reusing layers
    "gemma4_text": dict(num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2,
                        sliding_window=6, global_head_dim=16, num_global_key_value_heads=1, attention_k_eq_v=True,
                        num_kv_shared_layers=2, use_double_wide_mlp=True, hidden_size_per_layer_input=8,
                        vocab_size_per_layer_input=96, enable_moe_block=True, num_experts=4, top_k_experts=2,
                        moe_intermediate_size=16),
    # Gemma 4 12B: Gemma 4's layers without per-layer inputs or the expert block
    "gemma4_unified_text": dict(num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2,
                                sliding_window=6, global_head_dim=16, num_global_key_value_heads=1,
                                attention_k_eq_v=True, num_kv_shared_layers=2, use_double_wide_mlp=True),
    # Gemma 3n: layers 2-3 reusing layers 0-1's keys and values, an MLP size per layer (the first two with the
    # Gaussian top-k), AltUp's four copies of the hidden state, LAuReL, per-layer inputs
    "gemma3n_text": dict(num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2,
                         sliding_window=6, num_kv_shared_layers=2, intermediate_size=[64, 48, 64, 32],
                         activation_sparsity_pattern=[0.95, 0.95, 0.0, 0.0], hidden_size_per_layer_input=8,
                         vocab_size_per_layer_input=64, laurel_rank=4),
    # layer 0 dense (its own intermediate size), layer 1 routed experts + the shared ones
    "glm4_moe": dict(n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=2, moe_intermediate_size=16,
                     first_k_dense_replace=1, n_group=2, topk_group=1),
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                      shared_expert_intermediate_size=24, mlp_only_layers=[0]),
    "minimax_m2": dict(num_local_experts=4, num_experts_per_tok=2),  # every layer's experts, a router each
    "arcee": dict(mlp_bias=True),  # an MLP without a gate
    # the attention's output gate (a Linear hidden -> heads x head_dim), layer 0 dense, layer 1 experts + shared
    "afmoe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, num_shared_experts=1,
                  num_dense_layers=1),
    # both layers experts + shared: mlp_layer_types wins over first_k_dense_replace (1 by default)
    "exaone_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, num_shared_experts=1, n_group=1,
                       topk_group=1, mlp_layer_types=["sparse", "sparse"]),
    "hunyuan_v1_moe": dict(num_experts=4, moe_topk=[1, 2]),  # experts of intermediate_size, top k by layer
    # layer 0 dense, layer 1 experts + a shared one (ERNIE 4.5's moe_layer_start_index)
    "ernie4_5_moe": dict(moe_num_experts=4, moe_k=2, moe_intermediate_size=16, moe_num_shared_experts=1,
                         moe_layer_start_index=1),
    "dots1": dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, n_shared_experts=1,
                  first_k_dense_replace=1, n_group=1, topk_group=1),  # layer 0 dense, layer 1 experts + shared
    # layer 0 full and dense, layer 1 windowed with sinks and twice the key/value heads, experts; values narrower
    # than the keys, partial RoPE; n_shared_experts as a config may carry it (its MoE has none)
    "mimo_v2_flash": dict(layer_types=["full_attention", "sliding_attention"], sliding_window=6, v_head_dim=6,
                          mlp_layer_types=["dense", "sparse"], n_routed_experts=4, num_experts_per_tok=2,
                          moe_intermediate_size=16, n_shared_experts=1, n_group=1, topk_group=1),
    # experts + shared ones in every layer: its model reads no first_k_dense_replace, which a config may carry
    "solar_open": dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, n_shared_experts=1,
                       n_group=1, topk_group=1, first_k_dense_replace=1),
    "cwm": dict(layer_types=["full_attention", "sliding_attention"], sliding_window=6),
    # layer 0 full without RoPE, layer 1 windowed, sinks (no FLOPs of their own); + experts and a shared MLP
    "granite_swa": dict(WINDOWED, layer_types=["full_attention", "sliding_attention"], layer_rope_theta=[0.0, 10000.0]),
    "granitemoe_swa": dict(layer_types=["full_attention", "sliding_attention"], sliding_window=6,
                           layer_rope_theta=[0.0, 10000.0], num_local_experts=4, num_experts_per_tok=2,
                           shared_intermediate_size=24),
    "granitemoe": dict(num_local_experts=4, num_experts_per_tok=2, logits_scaling=2.0),  # experts in every layer
    "granitemoeshared": dict(num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=24),  # + shared MLP
    "laguna": dict(WINDOWED, num_attention_heads_per_layer=[4, 8], num_experts=4, num_experts_per_tok=2,
                   moe_intermediate_size=16, shared_expert_intermediate_size=24, mlp_layer_types=["dense", "sparse"]),
    "beam": dict(WINDOWED, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, n_group=1, topk_group=1,
                 mlp_layer_types=["dense", "sparse"], final_logit_softcapping=30.0),
    "flint": dict(WINDOWED, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                  shared_expert_intermediate_size=24, mlp_only_layers=[0]),
    "hy_v3": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, num_shared_experts=1),  # 0 dense
    # EXAONE 4's attention, experts in every layer (sigmoid, a score bias) and a shared one
    "kolibri1": dict(WINDOWED, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                     shared_expert_intermediate_size=24),
}
#: DeepSeek's MLA (q/k heads of 8 + 4, values of 6; V2 q_proj, V3 q_a_proj -> q_b_proj), layer 0 dense
#: and layer 1 experts + a shared one; no head_dim (V3's config would take it for the RoPE slice's)
MLA = dict(head_dim=None, num_key_value_heads=4, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
           n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=16,
           first_k_dense_replace=1, n_group=2, topk_group=1)
FAMILIES["deepseek_v2"] = dict(MLA, q_lora_rank=None)
FAMILIES["deepseek_v3"] = dict(MLA, q_lora_rank=12)
FAMILIES["glm4_moe_lite"] = dict(MLA, q_lora_rank=12)  # its mlp_layer_types: layer 0 dense, then experts
#: MLA without experts: MiniCPM3 and Youtu-LLM
DENSE_MLA = {field: MLA[field] for field in ("head_dim", "num_key_value_heads", "kv_lora_rank", "qk_nope_head_dim",
                                             "qk_rope_head_dim", "v_head_dim")}
FAMILIES["minicpm3"] = dict(DENSE_MLA, q_lora_rank=12, scale_emb=2.0, dim_model_base=16)
FAMILIES["youtu"] = dict(DENSE_MLA, q_lora_rank=12)
FAMILIES["axk1"] = dict(MLA, q_lora_rank=12)
FAMILIES["sarvam_mla"] = dict(MLA, q_lora_rank=None, n_group=1)
#: layer 0 RoPE, chunks of 6, a dense MLP of intermediate_size_mlp; layer 1 NoPE, full, 4 experts (top 1) + a shared one
FAMILIES["llama4_text"] = dict(no_rope_layers=[1, 0], attention_chunk_size=6, num_local_experts=4,
                               num_experts_per_tok=1, interleave_moe_layer_step=2, intermediate_size_mlp=48)
MOE = {"kolibri1", "sarvam_mla", "laguna", "beam", "flint", "granitemoe", "granitemoeshared", "granitemoe_swa", "axk1",
       "glm4_moe", "qwen2_moe", "deepseek_v2", "deepseek_v3", "glm4_moe_lite", "gemma4_text", "minimax_m2", "dots1",
       "ernie4_5_moe", "hunyuan_v1_moe", "exaone_moe", "afmoe", "solar_open", "hy_v3", "mimo_v2_flash", "cohere2_moe",
       "flex_olmo", "sarvam_moe", "mellum"}
TRANSFORMERS_5 = int(transformers.__version__.split(".")[0]) >= 5


def skip_unplannable(model_type: str) -> None:
    if model_type in MOE and not TRANSFORMERS_5:
        pytest.skip(f"transformers {transformers.__version__} runs experts as a loop over Linear layers, routed by "
                    "torch.where on the router's choice, which fake tensors cannot simulate")


def family_config(model_type: str, **overrides):
    if model_type not in CONFIG_MAPPING_NAMES:
        pytest.skip(f"transformers {transformers.__version__} has no {model_type!r}")
    refusal = transformers_refusal(model_type, transformers.__version__)
    if refusal:
        pytest.skip(refusal)
    fields = {**BASE, **FAMILIES[model_type], **overrides}
    if fields["head_dim"] is None:  # MLA: none at all
        del fields["head_dim"]
    return AutoConfig.for_model(model_type, **fields)


def test_every_family_here_is_supported():
    assert FAMILIES.keys() <= SUPPORTED_FAMILIES.keys()


def measured_flops(config, rows: int, length: int, **build) -> dict:
    """FlopCounterMode's counts of a forward and backward, by module: "Global" without the rotary table
    (inv_freq x positions), which is no model FLOP."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, **build)
    ids = torch.randint(3, config.vocab_size, (rows, length))
    with FlopCounterMode(display=False) as counter:
        model(input_ids=ids, labels=ids).loss.backward()
    by_module = {module: {str(op): flops for op, flops in by_op.items()}
                 for module, by_op in counter.get_flop_counts().items()}
    for module, by_op in by_module.items():
        if module.endswith("rotary_emb"):
            for op, flops in by_op.items():
                by_module["Global"][op] -= flops
    return by_module


@pytest.mark.parametrize("model_type", [name for name in FAMILIES if name not in ("llama4_text", "gemma3n_text")])
def test_model_flops_are_what_the_flop_counter_measures(model_type):
    """Eager attention computes all L x L pairs (the mask is applied after, windows too); the linear
    layers (mm, and addmm where they have a bias) are per_token x tokens, exactly."""
    config = family_config(model_type, attn_implementation="eager")
    torch.manual_seed(0)
    experts = {"experts_implementation": "eager"} if model_type in MOE and TRANSFORMERS_5 else {}
    model = AutoModelForCausalLM.from_config(config, **experts)
    rows, length = 2, 24
    # tokens the output layer predicts (Apertus 1.5's is cut to the first output_vocab_size)
    ids = torch.randint(3, getattr(config, "output_vocab_size", None) or config.vocab_size, (rows, length))
    with FlopCounterMode(display=False) as counter:
        model(input_ids=ids, labels=ids).loss.backward()
    by_module = counter.get_flop_counts()
    measured = {str(op): flops for op, flops in by_module["Global"].items()}
    for module, by_op in by_module.items():  # the rotary table (inv_freq x positions) is no model FLOP
        if module.endswith("rotary_emb"):
            for op, flops in by_op.items():
                measured[str(op)] -= flops
    flops = model_flops(config)
    assert measured.get("aten.mm", 0) + measured.get("aten.addmm", 0) == flops.per_token * rows * length
    assert measured["aten.bmm"] == flops.per_pair * rows * length ** 2


@pytest.mark.slow  # a simulation each, ~1.5 s
@pytest.mark.parametrize("model_type", FAMILIES)
def test_each_family_plans(model_type):
    """The planner simulates the trainer's step of each family at cp 2; a windowed model is planned as
    full attention (an upper bound: llama_cp/plan/simulate.py, _FullAttention), so its windows of 6
    tokens plan what windows as long as the sequence (which cut nothing) do (checked on Ministral)."""
    skip_unplannable(model_type)
    cfg = TrainConfig.from_flags(context_length=64, cp=2, report_to="none")
    plan = plan_step_memory(cfg, 2, model_config=family_config(model_type))
    assert plan.total > 0 and plan.activations > 0
    if model_type == "ministral":
        assert plan == plan_step_memory(cfg, 2, model_config=family_config(model_type, sliding_window=64))


def test_mla_plans_the_kernel_at_the_query_key_head_size():
    """DeepSeek-V3's attention runs at qk_nope + qk_rope = 192 (its config's head_dim is the RoPE
    slice's, 64): the planner models that kernel, sdpa_efficient's global-memory one included, and
    refuses sdpa_efficient in float32 (whose kernels it does not model) in one line."""
    from llama_cp.plan.simulate import planned_attention_backend

    config = family_config("deepseek_v3", qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
    assert config.head_dim == 64
    fp32 = TrainConfig.from_flags(context_length=64, cp=2, report_to="none", attention_backend="sdpa_efficient",
                                  dtype="float32")
    with pytest.raises(ValueError, match=r"^--attention_backend sdpa_efficient: the planner models sdpa_efficient's "
                                         r"workspace for float16/bfloat16, not float32; plan with --dtype bfloat16"):
        planned_attention_backend(fp32, config)
    cfg = TrainConfig.from_flags(context_length=64, cp=2, report_to="none", attention_backend="sdpa_efficient",
                                 dtype="bfloat16")
    assert planned_attention_backend(cfg, config) == "sdpa_efficient"
    skip_unplannable("deepseek_v3")
    assert plan_step_memory(cfg, 2, model_config=config).total > 0


def test_llama4_flops_count_its_chunks_and_its_routed_experts():
    """Llama 4's model_flops against FlopCounterMode: the linear layers are its mm, but for the routed
    experts, which transformers runs for every token through all 4 (one bmm each for gate_up and down:
    4x the top-1 work, Note [Model FLOPs]); eager attention computes all L x L pairs, of which the
    chunked layer's queries see only their chunk's (pairs(): 4 chunks of 6, 21 pairs each, and the
    full layer's 300, averaged)."""
    config = family_config("llama4_text", attn_implementation="eager")
    rows, length = 2, 24
    by_module = measured_flops(config, rows, length)
    experts = sum(flops for module, by_op in by_module.items() if module.endswith("feed_forward.experts")
                  for flops in by_op.values())
    hidden, inner = config.hidden_size, config.intermediate_size
    assert experts == 4 * 3 * 2 * (2 * inner + inner) * hidden * rows * length  # E x (fwd + bwd) x 2 FLOPs a MAC
    measured, flops = by_module["Global"], model_flops(config)
    assert measured["aten.mm"] + experts / 4 == flops.per_token * rows * length
    assert measured["aten.bmm"] - experts == flops.per_pair * rows * length ** 2
    assert flops.chunks == (6, None)
    assert flops.pairs(torch.arange(length).expand(rows, -1)) == rows * (4 * 21 + 300) / 2


def test_gemma3n_flops_count_altups_product_per_token():
    """Gemma 3n's model_flops against FlopCounterMode: AltUp's prediction multiplies each token's four copies of
    the hidden state by a 4 x 4 matrix the token computed, a bmm beside attention's that is per token (3 x 2 x
    hidden x 16 a layer, forward and both inputs' gradients); the rest are the linear layers (the reusing layers
    without k/v projections, an MLP size per layer, LAuReL, per-layer inputs, AltUp's projections), all exactly."""
    config = family_config("gemma3n_text", attn_implementation="eager")
    rows, length = 2, 24
    measured, flops = measured_flops(config, rows, length)["Global"], model_flops(config)
    altup = 3 * 2 * config.hidden_size * config.altup_num_inputs ** 2 * config.num_hidden_layers * rows * length
    assert measured["aten.mm"] == flops.per_token * rows * length - altup
    assert measured["aten.bmm"] == flops.per_pair * rows * length ** 2 + altup
    assert flops.layer_flops[0] > flops.layer_flops[2] > flops.layer_flops[3]  # k/v reused; MLPs of 64, 64, 32


def test_gemma3n_lora_flops_count_the_adapters_training_runs():
    """LoRA on every linear layer of Gemma 3n (peft's all-linear): AltUp's model-level projections are layers of
    ModuleLists (peft names them 0, 1, 2: their adapters count), and its correction coefficients are multiplied in
    training as a clamped copy of the weight (F.linear), past their adapter (not counted); against FlopCounterMode
    with the embedding's output needing a gradient, as Note [Model FLOPs] counts it."""
    from peft import LoraConfig, get_peft_model

    config = family_config("gemma3n_text", attn_implementation="eager")
    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_config(config), LoraConfig(r=4, target_modules="all-linear"))
    model.enable_input_require_grads()
    assert any(name.endswith("altup_projections.0.lora_A.default") for name, _ in model.named_modules())
    rows, length = 2, 24
    ids = torch.randint(3, config.vocab_size, (rows, length))
    with FlopCounterMode(display=False) as counter:
        model(input_ids=ids, labels=ids).loss.backward()
    measured = {str(op): flops for op, flops in counter.get_flop_counts()["Global"].items()}
    for module, by_op in counter.get_flop_counts().items():
        if module.endswith("rotary_emb"):
            for op, flops in by_op.items():
                measured[str(op)] -= flops
    flops = model_flops(config, lora_r=4, lora_targets=("all-linear",))
    altup = 3 * 2 * config.hidden_size * config.altup_num_inputs ** 2 * config.num_hidden_layers * rows * length
    assert measured["aten.mm"] == flops.per_token * rows * length - altup
    assert measured["aten.bmm"] == flops.per_pair * rows * length ** 2 + altup


def test_heads_over_256_are_planned_with_the_memory_efficient_kernel(monkeypatch):
    """Gemma 4's full layers of heads of 512 run sdpa_efficient on a GPU under "auto", and its windowed
    layers of 256 flash-attn (Note [Head sizes above 256]): the planner runs each call through the
    stand-in of the kernel the GPU runs for its head size, in the forward, the checkpointed recompute
    and the backward."""
    from llama_cp.attention import workspace
    from llama_cp.plan.simulate import planned_attention_backend

    config = family_config("gemma4_text", head_dim=256, global_head_dim=512)
    cfg = TrainConfig.from_flags(context_length=64, cp=2, report_to="none")
    backend = planned_attention_backend(cfg, config)
    assert backend == "flash_attn" and backend.auto
    calls = []

    def recording(ops, name):
        real = getattr(ops, name)

        @functools.wraps(real)  # kernel_calls passes the keywords its signature names
        def record(*args, **kwargs):
            query = next(a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor) and a.dim() >= 3)
            calls.append((name, query.shape[-1]))
            return real(*args, **kwargs)
        monkeypatch.setattr(ops, name, record)

    for name in vars(workspace.SDPA_OPS):
        recording(workspace.SDPA_OPS, name)
    for name in vars(workspace.FLASH_ATTN):
        recording(workspace.FLASH_ATTN, name)
    assert plan_step_memory(cfg, 2, model_config=config).total > 0
    by_kernel = {name: {head for called, head in calls if called == name} for name, _ in calls}
    assert by_kernel == {"_flash_attn_forward": {256}, "_flash_attn_backward": {256},
                         "_scaled_dot_product_efficient_attention": {512},
                         "_scaled_dot_product_efficient_attention_backward": {512}}
    # all layers of 512: sdpa_efficient alone
    wide = family_config("gemma4_text", head_dim=512, global_head_dim=512)
    assert planned_attention_backend(cfg, wide) == "sdpa_efficient"


def test_layers_of_different_kinds_are_planned_exactly(monkeypatch):
    """Note [Layers of different kinds]: each plan equal to the whole model's simulation. A DeepSeek-V3 of 4
    dense layers before 5 expert ones is planned from 6 and 7 layers (3 and 4 took a dense layer for the
    repeated one); a Llama 4 of dense and expert layers in turn, from 5 and 7 (two periods past the start,
    then one); a Gemma 4 of 2 windowed layers to 1 full one (heads of two sizes) from 6 and 9; one whose
    last two layers reuse keys and values, so that no period reaches the end, is simulated whole (cut to 3
    layers, transformers refuses its config)."""
    import llama_cp.plan.simulate as simulate
    from llama_cp.plan.simulate import extrapolation, simulate_step_memory

    skip_unplannable("deepseek_v3")
    simulated = []
    real = simulate.simulate_step_phases

    def counting(cfg, world_size, *, model_config):
        simulated.append(model_config.num_hidden_layers)
        return real(cfg, world_size, model_config=model_config)
    monkeypatch.setattr(simulate, "simulate_step_phases", counting)

    two_to_one = ["sliding_attention"] * 2 + ["full_attention"]  # Gemma 4's own: 5 to 1
    cfg = TrainConfig.from_flags(context_length=64, cp=2, report_to="none")
    for config, plan, counts in [
        (lambda: family_config("deepseek_v3", num_hidden_layers=9, first_k_dense_replace=4), (6, 1), [6, 7, 9]),
        (lambda: family_config("llama4_text", num_hidden_layers=9, no_rope_layers=[1] * 9), (5, 2), [5, 7, 9]),
        (lambda: family_config("gemma4_text", num_hidden_layers=12, layer_types=two_to_one * 4, num_kv_shared_layers=0,
                               use_double_wide_mlp=False), (6, 3), [6, 9, 12]),
        (lambda: family_config("gemma4_text", num_hidden_layers=7, layer_types=["sliding_attention", "full_attention"]
                               + ["sliding_attention"] * 4 + ["full_attention"]), None, [7, 7]),
    ]:
        simulated.clear()
        assert extrapolation(config()) == plan
        assert plan_step_memory(cfg, 2, model_config=config()) == simulate_step_memory(cfg, 2, model_config=config())
        assert simulated == counts
    windowed = family_config("ministral", num_hidden_layers=6, layer_types=["sliding_attention", "full_attention"] * 3)
    assert extrapolation(windowed) == (3, 1)  # windows alone: one kind
    # Llama 4's NoPE layers (every 4th: no float32 q/k norm) are a kind of their own: the period is 4
    assert extrapolation(family_config("llama4_text", num_hidden_layers=16, no_rope_layers=[1, 1, 1, 0] * 4)) == (8, 4)


def test_configs_without_the_fields_a_dense_layer_reads_are_counted_and_refusals_come_first():
    """Solar Open's config has no intermediate_size (every layer is experts): its FLOPs count without it.
    A family the trainer refuses is refused by the planner in the same line, before its layers are sorted
    into kinds by their FLOPs (Qwen3.5-MoE's config has no intermediate_size either)."""
    if "solar_open" in CONFIG_MAPPING_NAMES:
        config = AutoConfig.for_model("solar_open", **{k: v for k, v in BASE.items() if k != "intermediate_size"},
                                      **FAMILIES["solar_open"])
        assert not hasattr(config, "intermediate_size")
        flops = model_flops(config)
        assert flops.per_token == model_flops(family_config("solar_open")).per_token  # BASE's size reaches no layer
    if "qwen3_5_moe_text" in CONFIG_MAPPING_NAMES:
        cfg = TrainConfig.from_flags(context_length=64, report_to="none")
        with pytest.raises(ValueError, match=r"^model family 'qwen3_5_moe_text' \(Qwen3_5MoeForCausalLM\) is not "
                                             r"supported by llama-cp: its linear-attention layers"):
            plan_step_memory(cfg, 1, model_config=AutoConfig.for_model("qwen3_5_moe_text"))
