"""Every supported model family, and the paths that used to train silently wrong, against
plain single-process transformers on 4 CPU ranks (gloo).

Per family: the CP model's logits, its chunked loss and every parameter gradient equal
those of the unmodified HF model (its own forward and ``labels=`` loss), for ring and
Ulysses, cp 1, 2 and 4, with and without FSDP (``shard_model`` over dp_shard x cp), in
float32 and float64. The configurations exercise what each family's forward adds
(Granite's multipliers and logit scaling, Cohere's logit scale, Gemma2's final
soft-cap, position-dependent RoPE, RoPE set by --rope_theta / --rope_scaling, sliding
windows of a fifth of the sequence, on every layer or on some, and as long as the sequence).
What llama-cp cannot compute is refused with one clear message.
"""

import copy
import functools
import json
import re

import peft
import pytest
import torch
import torch.nn.functional as F
import transformers
from transformers import AutoConfig, AutoModelForCausalLM

from dist_harness import Checks
from fsdp_checks import check_cp_against_reference
from llama_cp import ParallelDims, apply_context_parallel, enable_chunked_loss, shard_batch
from llama_cp.model.build import peft_supports_target_parameters
from llama_cp.modules.causal_lm import apply_rope_settings
from llama_cp.modules.families import transformers_refusal
from llama_cp.parallel.sharding import unshard

WORLD_SIZE = 4
VOCAB, SEQ_LEN, BATCH = 96, 32, 2
WINDOW = 6  # tokens: a window shorter than a zigzag chunk at cp 2, longer at cp 4
MOE_LOSS = dict(output_router_logits=True, router_aux_loss_coef=0.3)
MOE = {"mixtral", "qwen3_moe", "olmoe"}
TRANSFORMERS_5 = int(transformers.__version__.split(".")[0]) >= 5
#: transformers 5 holds an MoE's experts as fused parameters (mlp.experts.gate_up_proj), which peft
#: adapts through target_parameters from 0.17; transformers 4 holds them as Linear layers (w1, w2, w3).
FUSED_EXPERTS_LORA_PROBLEM = (
    None if TRANSFORMERS_5 and peft_supports_target_parameters()
    else f"LoRA on fused experts needs transformers >= 5 and peft >= 0.17 (installed: transformers "
         f"{transformers.__version__}, peft {peft.__version__})"
)
checks = Checks(setup=lambda sizes: [mesh_for(cp) for cp in sorted(sizes)])  # the meshes of the checks of a cp group

BASE = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
    eos_token_id=2, attn_implementation="sdpa",
)



def rope(**params) -> dict:
    """Config fields of a RoPE in the installed transformers' layout: transformers 5 reads one
    ``rope_parameters`` dict, 4.x ``rope_theta`` and ``rope_scaling`` apart (and ignores the 5's)."""
    if TRANSFORMERS_5:
        return dict(rope_parameters=params)
    theta, rope_type = params.pop("rope_theta"), params.pop("rope_type")
    fields = dict(rope_theta=theta, rope_scaling={"type": rope_type, **params})  # Phi-3 4.x wants "type" only
    if "original_max_position_embeddings" in params:  # 4.x's longrope reads it from the config itself
        fields["original_max_position_embeddings"] = params["original_max_position_embeddings"]
    return fields


#: The RoPE each of these families must build (checked: ``ropes_are_the_configured_ones``).
ROPE_TYPES = {"llama_llama3_rope": "llama3", "llama_dynamic_rope": "dynamic", "llama_longrope": "longrope",
              "phi3": "longrope", "llama_rope_flags_yarn": "yarn", "llama_rope_flags_linear_theta": "linear",
              "llama_rope_flags_longrope": "longrope"}

#: name -> (model_type, config overrides). Values chosen so each family's extra really changes the result.
FAMILIES = {
    "llama": ("llama", {}),
    "llama_llama3_rope": ("llama", rope(
        rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=16,
    )),
    # frequencies picked from max(position_ids): L = 32 > max_position_embeddings = 16
    "llama_dynamic_rope": ("llama", dict(
        max_position_embeddings=16, **rope(rope_type="dynamic", rope_theta=10000.0, factor=2.0),
    )),
    # long or short factors picked from max(position_ids): the shards straddle 20
    "llama_longrope": ("llama", rope(
        rope_type="longrope", rope_theta=10000.0, original_max_position_embeddings=20,
        short_factor=[1.0, 1.5, 2.0, 2.5], long_factor=[3.0, 5.0, 7.0, 9.0],
    )),
    "mistral_window_eq_seq": ("mistral", dict(sliding_window=SEQ_LEN)),  # a window of L tokens cuts nothing
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "gemma": ("gemma", {}),
    "olmo2": ("olmo2", {}),
    "granite": ("granite", dict(
        logits_scaling=4.0, embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.3,
    )),
    "cohere": ("cohere", dict(logit_scale=0.25, use_qk_norm=True)),
    # fused qkv_proj and gate_up_proj; longrope's long or short factors picked from the global length
    # (the shards straddle 20), and a sliding window as long as the sequence (Phi-3 passes the config's)
    "phi3": ("phi3", dict(
        original_max_position_embeddings=20, sliding_window=SEQ_LEN, **rope(
            rope_type="longrope", rope_theta=10000.0, short_factor=[1.0, 1.5, 2.0, 2.5],
            long_factor=[3.0, 5.0, 7.0, 9.0]),
    )),
    # sliding windows several times shorter than the sequence (Note [Sliding windows under CP]): every
    # layer (Mistral), the layers from max_window_layers on (Qwen2), alternating (Gemma 2's default
    # layer_types), and Gemma 3's windowed and full layers with a RoPE of their own each
    "mistral_window": ("mistral", dict(sliding_window=WINDOW)),
    "qwen2_window": ("qwen2", dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)),
    "gemma2_window": ("gemma2", dict(
        attn_logit_softcapping=None, final_logit_softcapping=0.5, sliding_window=WINDOW, attn_implementation="eager",
    )),
    "gemma3_text": ("gemma3_text", dict(
        sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"], rope_local_base_freq=100.0,
        query_pre_attn_scalar=12, final_logit_softcapping=0.5,
    )),
    # mixture of experts with the router's load-balancing loss (Note [Router loss under CP]) at a
    # coefficient that makes it count; experts run eagerly (transformers 5 would run them through
    # torch's grouped_mm, which takes no float64; transformers 4 loops over Linear experts)
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2, **MOE_LOSS)),
    "qwen3_moe": ("qwen3_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                    norm_topk_prob=True, **MOE_LOSS)),
    "olmoe": ("olmoe", dict(num_experts=4, num_experts_per_tok=2, **MOE_LOSS)),
    "gemma2": ("gemma2", dict(
        attn_logit_softcapping=None, final_logit_softcapping=0.5, sliding_window=SEQ_LEN,
        attn_implementation="eager",  # transformers has no SDPA path for Gemma2
    )),
    # attention scores soft-capped (Note [Soft-capped attention]): weights 10x the usual init so that the
    # scores reach the cap of 0.5 (Gemma 2's is 50 on a trained model's scores)
    "gemma2_attn_softcap": ("gemma2", dict(
        attn_logit_softcapping=0.5, final_logit_softcapping=0.5, sliding_window=SEQ_LEN, attn_implementation="eager",
        initializer_range=0.2,
    )),
}

def rope_flag_overrides(rope_theta: float, rope_scaling: str) -> dict:
    """The config fields --rope_theta / --rope_scaling set on a Llama of BASE (in the installed
    transformers' layout), applied the way the trainer applies them."""
    config = apply_rope_settings(AutoConfig.for_model("llama", **BASE), rope_theta, rope_scaling, SEQ_LEN)
    names = ("rope_parameters",) if hasattr(config, "rope_parameters") else ("rope_theta", "rope_scaling")
    if not TRANSFORMERS_5 and hasattr(config, "original_max_position_embeddings"):
        names = (*names, "original_max_position_embeddings")  # 4.x's longrope reads it from the config
    return {name: copy.deepcopy(getattr(config, name)) for name in (*names, "max_position_embeddings")}


#: Llamas whose RoPE comes from the command line (checked on fewer layouts: the code is the llama's).
ROPE_FLAG_FAMILIES = {
    "llama_rope_flags_yarn": ("llama", rope_flag_overrides(0.0, "yarn:factor=4,original_max_position_embeddings=8,beta_fast=8")),
    "llama_rope_flags_linear_theta": ("llama", rope_flag_overrides(1000.0, "linear:factor=3")),
    # long or short factors picked from the global length: the shards straddle 20
    "llama_rope_flags_longrope": ("llama", rope_flag_overrides(0.0, json.dumps(dict(
        rope_type="longrope", original_max_position_embeddings=20, short_factor=[1.0, 1.5, 2.0, 2.5],
        long_factor=[3.0, 5.0, 7.0, 9.0])))),
}
FAMILIES.update(ROPE_FLAG_FAMILIES)

#: Families whose HF code computes its norms (or, MoE, its router loss: load_balancing_loss_func)
#: in float32 whatever the model's dtype: their float64 runs can only agree to float32 precision.
FLOAT32_NORMS = {"gemma", "gemma2", "gemma3_text", "cohere", *MOE}

TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float64: dict(atol=1e-10, rtol=1e-10)}


def family_model(name: str, dtype=torch.float32, **overrides):
    model_type, family_overrides = FAMILIES[name]
    config = AutoConfig.for_model(model_type, **{**BASE, **family_overrides, **overrides})
    torch.manual_seed(0)
    experts = {"experts_implementation": "eager"} if model_type in MOE and TRANSFORMERS_5 else {}
    return AutoModelForCausalLM.from_config(config, dtype=dtype, **experts)


@functools.cache
def mesh_for(cp: int):
    """A (1, 4/cp, cp) mesh, built once per cp in the same order on every rank."""
    return ParallelDims(dp_shard=WORLD_SIZE // cp, cp=cp).build_mesh("cpu")


def batch() -> dict[str, torch.Tensor]:
    """input_ids and pre-shifted labels (the last position has no target; a few ignored)."""
    g = torch.Generator().manual_seed(11)
    tokens = torch.randint(3, VOCAB, (BATCH, SEQ_LEN + 1), generator=g)
    labels = tokens[:, 1:].clone()
    labels[:, -1] = -100
    labels[0, :5] = -100
    labels[1, 9:12] = -100
    return {"input_ids": tokens[:, :-1], "labels": labels}


def hf_reference(reference, data: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, loss) of ``reference`` on ``data`` by HF's own forward and ``labels=`` loss (labels
    unshifted; HF shifts them), after its backward (the checks read its gradients). HF computes
    the loss in float32 whatever the model's dtype, so the float64 reference is the same
    cross-entropy of the same logits, checked against HF's at float32 precision."""
    labels = data["labels"]
    hf_labels = torch.cat([torch.full((labels.shape[0], 1), -100), labels[:, :-1]], dim=1)
    ref = reference(input_ids=data["input_ids"], labels=hf_labels)
    ref_loss = F.cross_entropy(ref.logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    if getattr(ref, "aux_loss", None) is not None:  # MoE: the router's loss, as the family's forward adds it
        assert ref.aux_loss > 0
        ref_loss = ref_loss + reference.config.router_aux_loss_coef * ref.aux_loss
    torch.testing.assert_close(ref_loss.float(), ref.loss.float(), **TOLERANCE[torch.float32])
    ref_loss.backward()
    return ref.logits.detach(), ref_loss.detach()


@functools.cache
def family_reference(name: str, dtype: torch.dtype):
    """(pristine, reference, logits, loss) of family ``name`` in ``dtype``, built once per rank and
    shared by every strategy, cp and sharding of it: ``pristine`` is an untouched copy of the model
    (each check makes its CP model from a copy of it), ``reference`` the same model after
    :func:`hf_reference`."""
    reference = family_model(name, dtype)
    pristine = copy.deepcopy(reference)  # before the reference's forward (dynamic RoPE updates its buffers)
    return pristine, reference, *hf_reference(reference, batch())


def check_family(name: str, strategy: str, cp: int, sharded: bool, dtype: torch.dtype):
    tol = TOLERANCE[torch.float32 if FAMILIES[name][0] in FLOAT32_NORMS else dtype]
    pristine, reference, ref_logits, ref_loss = family_reference(name, dtype)
    check_cp_against_reference(copy.deepcopy(pristine), reference, batch(), ref_logits, ref_loss, mesh_for(cp),
                               strategy=strategy, sharded=sharded, tol=tol, max_seq_len=SEQ_LEN)


for _name in FAMILIES:
    if _name in ROPE_FLAG_FAMILIES:
        continue
    for _strategy in ("ring", "ulysses"):
        for _cp in (1, 2, 4):
            for _sharded in (False, True):
                for _dtype in (torch.float32, torch.float64):
                    if _cp == 1 and (_strategy == "ulysses" or _sharded):
                        continue  # cp 1 has no strategy; FSDP without CP is tests/test_fsdp.py's
                    checks.add(
                        functools.partial(check_family, _name, _strategy, _cp, _sharded, _dtype),
                        name=f"{_name}_{_strategy}_cp{_cp}_{'fsdp' if _sharded else 'plain'}_{str(_dtype)[6:]}",
                        skip=transformers_refusal(FAMILIES[_name][0], transformers.__version__),
                        group=None if _sharded else _cp,  # plain: the cp group only (Note [Checks side by side])
                    )

for _name in ROPE_FLAG_FAMILIES:
    for _strategy in ("ring", "ulysses"):
        for _dtype in (torch.float32, torch.float64):
            checks.add(functools.partial(check_family, _name, _strategy, 2, True, _dtype),
                       name=f"{_name}_{_strategy}_cp2_fsdp_{str(_dtype)[6:]}")


def check_padding_mask_is_refused_where_it_enters(strategy: str, cp: int):
    """transformers hands our attention None for any mask, so a padding mask must be refused
    at the model and at shard_batch; a mask of ones masks nothing and is accepted."""
    reference = family_model("llama")
    mesh = mesh_for(cp)
    model = apply_context_parallel(copy.deepcopy(reference), mesh["cp"], strategy=strategy)
    data = batch()
    left_padded = torch.ones(BATCH, SEQ_LEN, dtype=torch.long)
    left_padded[0, :6] = 0
    with pytest.raises(ValueError, match="takes no attention mask.*labels=-100"):
        shard_batch({**data, "attention_mask": left_padded}, mesh["cp"])
    local = shard_batch(data, mesh["cp"])
    with pytest.raises(ValueError, match="takes no attention mask"):
        model(input_ids=local["input_ids"], position_ids=local["position_ids"],
              attention_mask=torch.ones_like(local["input_ids"]).index_fill_(1, torch.tensor([0]), 0))
    enable_chunked_loss(model)
    with pytest.raises(ValueError, match="takes no attention mask"):
        model(**local, loss_labels=local["labels"], attention_mask=torch.zeros_like(local["input_ids"]))
    ones = torch.ones(BATCH, SEQ_LEN, dtype=torch.long)
    local = shard_batch({**data, "attention_mask": ones}, mesh["cp"])
    with torch.no_grad():
        got = model(input_ids=local["input_ids"], position_ids=local["position_ids"],
                    attention_mask=local["attention_mask"]).logits
        want = reference(input_ids=data["input_ids"]).logits
    torch.testing.assert_close(unshard(got, mesh["cp"]), want, atol=1e-5, rtol=1e-5)


for _strategy in ("ring", "ulysses"):
    for _cp in (1, 2, 4):
        checks.add(functools.partial(check_padding_mask_is_refused_where_it_enters, _strategy, _cp),
                   name=f"padding_mask_refused_{_strategy}_cp{_cp}", group=_cp)


@checks.add
def unsupported_models_are_refused_at_apply_time():
    cp = mesh_for(2)["cp"]
    phi = AutoModelForCausalLM.from_config(AutoConfig.for_model("phi", **BASE))
    for apply in (lambda m: apply_context_parallel(m, cp), enable_chunked_loss):
        with pytest.raises(ValueError, match=r"model family 'phi' \(PhiForCausalLM\) is not supported by "
                                             r"llama-cp: its attention has no o_proj and a partial rotary embedding"):
            apply(phi)
    with pytest.raises(ValueError, match="attention_dropout=0.1.*set it to 0.0"):
        apply_context_parallel(family_model("llama", attention_dropout=0.1), cp)
    with pytest.raises(ValueError, match="gemma3_text: config.use_bidirectional_attention=True .*set it to false"):
        apply_context_parallel(family_model("gemma3_text", use_bidirectional_attention=True), cp)
    # windows reach CUDA through flash-attn and torch's flash kernel (sdpa_cudnn's windowed calls too):
    # sdpa_efficient takes none and is refused up front
    with pytest.raises(ValueError, match=rf"^--attention_backend sdpa_efficient: this model's sliding window of "
                                         rf"{WINDOW} tokens is shorter than the sequence \({SEQ_LEN} tokens\): "
                                         r"sliding-window attention on CUDA needs float16/bfloat16 \(--dtype "
                                         r"bfloat16\) on an sm80\+ GPU, where sdpa_flash or flash_attn takes it"):
        apply_context_parallel(family_model("mistral_window"), cp, backend="sdpa_efficient", max_seq_len=SEQ_LEN)
    for backend in ("sdpa_flash", "sdpa_cudnn"):
        apply_context_parallel(family_model("mistral_window"), cp, backend=backend, max_seq_len=SEQ_LEN)
    apply_context_parallel(family_model("mistral_window_eq_seq"), cp, backend="sdpa_efficient", max_seq_len=SEQ_LEN)


@checks.add
def olmoe_is_refused_where_transformers_calls_sdpa_itself():
    """Note [A family's transformers floor]: OLMoE below transformers 5 is refused in one line naming
    the versions, at apply_context_parallel and enable_chunked_loss; from 5 it is applied."""
    assert transformers_refusal("olmoe", "4.57.6") == (
        "model family 'olmoe' needs transformers >= 5.0 (installed: 4.57.6): before that its attention calls SDPA "
        "itself, so context-parallel attention cannot take its place; upgrade transformers")
    assert transformers_refusal("olmoe", "5.0.0") is None and transformers_refusal("mixtral", "4.56.2") is None
    refusal = transformers_refusal("olmoe", transformers.__version__)
    if refusal is None:
        model = apply_context_parallel(family_model("olmoe"), mesh_for(2)["cp"])
        assert model.config._attn_implementation == "llama_cp"
        return
    assert transformers.__version__ in refusal
    for apply in (lambda m: apply_context_parallel(m, mesh_for(2)["cp"]), enable_chunked_loss):
        with pytest.raises(ValueError, match=re.escape(refusal)):
            apply(family_model("olmoe"))


@checks.add
def ropes_are_the_configured_ones():
    """The scaled-RoPE families build the RoPE they are named for, in either transformers layout (a
    field of the other layout would be ignored, and the case would test the default RoPE)."""
    for name, rope_type in ROPE_TYPES.items():
        model = family_model(name)
        assert model.model.rotary_emb.rope_type == rope_type, (name, model.model.rotary_emb.rope_type)


@checks.add
def sliding_windows_change_the_result():
    """The references' windows are not no-ops on the test batch: without them the logits differ,
    and Gemma 3's full layer is not windowed."""
    data = batch()
    for name in ("mistral_window", "qwen2_window", "gemma2_window", "gemma3_text"):
        with torch.no_grad():
            windowed = family_model(name)(input_ids=data["input_ids"]).logits
            full = family_model(name, sliding_window=SEQ_LEN)(input_ids=data["input_ids"]).logits
        assert (windowed - full).abs().max() > 1e-3, name
    layers = family_model("gemma3_text").model.layers
    assert [layer.self_attn.sliding_window for layer in layers] == [WINDOW, None]


@checks.add
def gemma2_attention_softcap_changes_the_result():
    """The reference's cap is not a no-op on the test batch: without it the logits differ."""
    data = batch()
    with torch.no_grad():
        capped = family_model("gemma2_attn_softcap")(input_ids=data["input_ids"]).logits
        uncapped = family_model("gemma2_attn_softcap", attn_logit_softcapping=None)(input_ids=data["input_ids"]).logits
    assert (capped - uncapped).abs().max() > 1e-3


@checks.add
def phi3_lora_on_its_fused_layers_float64():
    """LoRA on Phi-3's fused qkv_proj and gate_up_proj, ring at cp 4 with FSDP: exact; the default
    targets (q_proj, k_proj, v_proj, o_proj) name layers Phi-3 does not have, which is refused."""
    from peft import LoraConfig, get_peft_model

    from llama_cp.model.build import check_lora_targets

    reference = family_model("phi3", torch.float64)
    with pytest.raises(ValueError, match=r"--lora_target_modules: q_proj, k_proj, v_proj not in Phi3ForCausalLM; "
                                         r"its linear layers are down_proj, gate_up_proj, lm_head, o_proj, qkv_proj"):
        check_lora_targets(reference, ("q_proj", "k_proj", "v_proj", "o_proj"))
    check_lora_targets(reference, ("qkv_proj", "gate_up_proj"))
    torch.manual_seed(1)
    reference = get_peft_model(reference, LoraConfig(r=4, lora_alpha=8, target_modules=["qkv_proj", "gate_up_proj"],
                                                     init_lora_weights=False))
    model = copy.deepcopy(reference)
    data = batch()
    logits = reference(input_ids=data["input_ids"]).logits
    loss = F.cross_entropy(logits.flatten(0, 1), data["labels"].flatten(), ignore_index=-100)
    loss.backward()
    check_cp_against_reference(model, reference, data, logits, loss, mesh_for(4), strategy="ring", sharded=True,
                               tol=TOLERANCE[torch.float64], max_seq_len=SEQ_LEN)


@functools.partial(checks.add, skip=FUSED_EXPERTS_LORA_PROBLEM)
def moe_lora_on_attention_and_experts_float64():
    """LoRA on q_proj/v_proj and on the fused experts (peft's target_parameters) of Mixtral, ring at
    cp 4 with FSDP, with the router loss: exact; names the model lacks are refused in one line."""
    from peft import LoraConfig, get_peft_model

    from llama_cp.model.build import check_lora_targets

    reference = family_model("mixtral", torch.float64)
    experts = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    check_lora_targets(reference, ("q_proj", "v_proj"), experts)
    with pytest.raises(ValueError, match=r"--lora_target_parameters: mlp.experts.w1 not in MixtralForCausalLM; the "
                                         r"parameters of its first layer outside Linear layers are "
                                         r"input_layernorm.weight, mlp.experts.down_proj, mlp.experts.gate_up_proj"):
        check_lora_targets(reference, ("q_proj",), ["mlp.experts.w1"])
    torch.manual_seed(1)
    reference = get_peft_model(reference, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                     target_parameters=experts, init_lora_weights=False))
    assert sum("experts" in name for name, p in reference.named_parameters() if p.requires_grad) == 8
    model = copy.deepcopy(reference)
    data = batch()
    hf_labels = torch.cat([torch.full((BATCH, 1), -100), data["labels"][:, :-1]], dim=1)
    ref = reference(input_ids=data["input_ids"], labels=hf_labels)
    loss = F.cross_entropy(ref.logits.flatten(0, 1), data["labels"].flatten(), ignore_index=-100)
    loss = loss + reference.config.router_aux_loss_coef * ref.aux_loss
    loss.backward()
    check_cp_against_reference(model, reference, data, ref.logits, loss, mesh_for(4), strategy="ring", sharded=True,
                               tol=TOLERANCE[torch.float32], max_seq_len=SEQ_LEN)


@checks.add
def dpo_pairs_ring_cp4_float64_and_ulysses_cp4_fsdp_float32():
    """The preference loss on packed pairs at cp 4 (test_preference_loss_world2.py's check at cp 2)."""
    from preference_checks import check_pairs

    check_pairs("ring", 4, False, torch.float64, kinds=("sigmoid", "orpo"))
    check_pairs("ulysses", 4, True, torch.float32)


results = checks.module_fixture(__name__, WORLD_SIZE)


@pytest.mark.parametrize("name", checks.names)
def test_check(results, name):
    checks.assert_passed(results, name)
