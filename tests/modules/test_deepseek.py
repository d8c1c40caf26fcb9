"""DeepSeek-V2 and -V3 (deepseek_v2, deepseek_v3: also Kimi K2, Moonlight; sarvam_mla, Sarvam-105B, which
transformers builds as V3) and GLM-4.7-Flash (glm4_moe_lite: V3's attention, GLM-4.5's experts, its
mlp_layer_types), MiniCPM3, Youtu-LLM and A.X K1 under context parallelism
against plain single-process transformers on 4 CPU ranks (gloo), with the BASE model, batch, meshes
and tolerances of tests/modules/test_families.py and the runs of tests/modules/test_families_new.py.

What they add, each made to count (``features_change_the_result`` records how far the logits move
without it): multi-head latent attention with query/key heads of 8 + 4 and value heads of 6 (padded
to 12 under CP, Note [Value heads narrower than keys] in llama_cp/cp_attention.py; checked taken:
``padded_values_reach_the_strategies``), RoPE on the 4-wide slice (V2 as one complex tensor, V3 as
cos/sin, interleaved), V3's yarn with mscale_all_dim (it scales the scores), q through q_proj (V2) or
q_a_proj -> q_b_proj (V3's q_lora_rank); layer 0 dense, layer 1 routed experts plus a shared one
(V2: softmax, the best group of 2; V3: sigmoid plus a score bias set non-zero, groups, renormalised).
transformers adds no router loss for either (their forwards return none). Checked: logits, chunked
loss and every gradient under ring, Ulysses, all-gather and hybrid, cp 1, 2 and 4, plain and FSDP,
float32 and float64, packed documents, LoRA on the MLA projections, V2's dynamic RoPE bound to
global positions. Their routers compute in float32 whatever the dtype, so float64 runs agree to
float32 precision (1e-5); a dense V3 (no router) is checked in float64 to 1e-10, also on packed
documents in tiles of 4 tokens (Note [Tiled attention]). On transformers 4.x V3 routes each token to
its whole group (4 of 8) and its float64 MoE runs are skipped (``skip_reason``).
"""

import copy
import functools

import pytest
import torch
import torch.nn.functional as F
import transformers
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

from dist_harness import Checks
from document_checks import documents_alone, documents_batch
from fsdp_checks import check_cp_against_reference
from llama_cp import apply_context_parallel
from llama_cp.cp_attention import cp_attention_forward
from llama_cp.modules.families import transformers_refusal
from test_families import BASE, SEQ_LEN, TOLERANCE, TRANSFORMERS_5, WORLD_SIZE, batch, mesh_for, rope
from test_families_new import RUNS, _zero

checks = Checks(setup=lambda sizes: [mesh_for(cp) for cp in sorted(sizes)])
F32, F64 = torch.float32, torch.float64

#: BASE without head_dim (a deepseek_v3 config takes it for the RoPE slice's size), K and V heads
#: as many as the query's (MLA expands one latent to every head); weights 4x the usual init (at 0.02
#: the RoPE features moved the logits by 3e-5 to 4e-4 only: the scores were near 0)
MLA = dict({k: v for k, v in BASE.items() if k != "head_dim"}, num_key_value_heads=4, kv_lora_rank=8,
           qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, n_shared_experts=1, moe_intermediate_size=16,
           first_k_dense_replace=1, n_group=2, topk_group=1, initializer_range=0.08)


def yarn(mscale_all_dim: float = 1.0) -> dict:
    """V3's yarn RoPE; its mscale_all_dim also scales the scores (DeepseekV3Attention.scaling)."""
    return rope(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64, mscale=1.0,
                mscale_all_dim=mscale_all_dim, beta_fast=32.0, beta_slow=1.0)


#: name -> (model_type, config fields).
FAMILIES = {
    "deepseek_v2": ("deepseek_v2", dict(q_lora_rank=None, n_routed_experts=4, num_experts_per_tok=2,
                                        topk_method="group_limited_greedy", routed_scaling_factor=1.5)),
    # transformers 4.x: 4 of 8, every token its whole group (4.x's experts are Linear layers, and one
    # that gets no token on a rank has no gradient there: the gradient checks would not line up)
    "deepseek_v3": ("deepseek_v3", dict(q_lora_rank=12, n_routed_experts=8, num_experts_per_tok=2 if TRANSFORMERS_5
                                        else 4, norm_topk_prob=True, routed_scaling_factor=2.5, rope_interleave=True,
                                        **yarn())),
}
#: GLM-4.7-Flash: V3's attention, GLM-4.5's experts (the best group of 2, a score bias) after a dense layer
FAMILIES["glm4_moe_lite"] = ("glm4_moe_lite", dict(q_lora_rank=12, n_routed_experts=8, num_experts_per_tok=2,
                                                   norm_topk_prob=True, routed_scaling_factor=1.8, rope_interleave=True,
                                                   mlp_layer_types=["dense", "sparse"]))
#: V2's complex RoPE picks its frequencies from the longest position (32 > 16): Note [Position-dependent
#: RoPE under CP]; with q_lora_rank, V2's q_a_proj -> q_b_proj
FAMILIES["deepseek_v2_dynamic_rope"] = ("deepseek_v2", dict(
    FAMILIES["deepseek_v2"][1], q_lora_rank=12, max_position_embeddings=16,
    **rope(rope_type="dynamic", rope_theta=10000.0, factor=2.0)))
FAMILIES["deepseek_v3_dense"] = ("deepseek_v3", dict(FAMILIES["deepseek_v3"][1], first_k_dense_replace=2))
#: MLA without experts (MLA's expert fields cleared): MiniCPM3, its embeddings, residual branches and the hidden
#: states before the output layer scaled; Youtu-LLM, V3's attention (interleaved RoPE) and a dense MLP
DENSE = dict(n_routed_experts=None, n_shared_experts=None, moe_intermediate_size=None, first_k_dense_replace=None,
             n_group=None, topk_group=None)
FAMILIES["minicpm3"] = ("minicpm3", dict(DENSE, q_lora_rank=12, scale_emb=2.0, scale_depth=1.4, dim_model_base=16))
FAMILIES["youtu"] = ("youtu", dict(DENSE, q_lora_rank=12, rope_interleave=True))
FAMILIES["axk1"] = ("axk1", dict(q_lora_rank=12, n_routed_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                                 routed_scaling_factor=2.5, rope_interleave=True))
#: Sarvam-105B: transformers builds V3 from its config (one group, interleaved RoPE, no q_lora_rank)
FAMILIES["sarvam_mla"] = ("sarvam_mla", dict(q_lora_rank=None, n_routed_experts=8, num_experts_per_tok=2, n_group=1,
                                             topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5))
#: documents of each packed row (SEQ_LEN tokens): split across zigzag chunks at cp 2 and 4, one of 1 token
PACKED_LENGTHS = [[5, 1, 14, 12], [9, 23]]
#: LoRA on every projection of MLA with q_lora_rank (V3's)
LORA_TARGETS = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]


def skip_reason(name: str, dtype: torch.dtype = F32) -> str | None:
    """Why ``name`` cannot be checked in ``dtype`` with the installed transformers."""
    model_type = FAMILIES[name][0]
    if model_type not in CONFIG_MAPPING_NAMES:
        return f"transformers {transformers.__version__} has no {model_type!r}"
    if name == "deepseek_v3" and dtype == F64 and not TRANSFORMERS_5:
        return (f"transformers {transformers.__version__}'s DeepseekV3MoE fails in float64 itself (index_add_ of "
                "float64 expert outputs into a buffer of the float32 router weights' dtype); float32 is checked")
    return transformers_refusal(model_type, transformers.__version__)


def family_model(name: str, dtype=F32, **overrides):
    """The model in ``dtype`` (its float32 router too), V3's router score bias set non-zero."""
    model_type, fields = FAMILIES[name]
    config = AutoConfig.for_model(model_type, **{**MLA, **fields, **overrides})
    torch.manual_seed(0)
    experts = {"experts_implementation": "eager"} if TRANSFORMERS_5 else {}  # grouped_mm takes no float64
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, **experts).to(dtype)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for tensor_name, tensor in model.named_buffers():
            if tensor_name.endswith("e_score_correction_bias"):  # about the sigmoid scores' spread
                tensor.copy_(0.04 * (torch.rand(tensor.shape, generator=generator, dtype=tensor.dtype) - 0.5))
    return model


def with_lora(model):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS, init_lora_weights=False))


def packed_data() -> dict[str, torch.Tensor]:
    return documents_batch(batch()["input_ids"], PACKED_LENGTHS)


def reference_forward(model, data):
    """(logits, loss) of single-process transformers on whole rows: packed rows (restarting
    position_ids) are masked per document by transformers itself (create_causal_mask reads them;
    ``features_change_the_result`` checks it against each document run alone)."""
    logits = model(input_ids=data["input_ids"], position_ids=data.get("position_ids"), use_cache=False).logits
    return logits, F.cross_entropy(logits.flatten(0, 1), data["labels"].flatten(), ignore_index=-100)


@functools.cache
def reference(name: str, dtype: torch.dtype, packed: bool = False, lora: bool = False):
    """(pristine, reference, data, logits, loss), built once per rank: ``reference`` after its
    forward and backward (the checks read its gradients), ``pristine`` an untouched copy."""
    model = family_model(name, dtype)
    if lora:
        model = with_lora(model)
    pristine = copy.deepcopy(model)  # before the forward: dynamic RoPE updates its buffers
    data = packed_data() if packed else batch()
    logits, loss = reference_forward(model, data)
    if not packed and not lora:  # transformers' own loss (labels unshifted: it shifts them), no router loss
        hf_labels = torch.cat([torch.full((data["labels"].shape[0], 1), -100), data["labels"][:, :-1]], dim=1)
        torch.testing.assert_close(model(input_ids=data["input_ids"], labels=hf_labels).loss.float(), loss.float(),
                                   **TOLERANCE[F32])
    loss.backward()
    return pristine, model, data, logits.detach(), loss.detach()


def check(name: str, strategy: str, cp: int, sharded: bool, dtype: torch.dtype, packed: bool = False,
          lora: bool = False, block_size: int = 0):
    pristine, model, data, logits, loss = reference(name, dtype, packed, lora)
    # float32 routers (module docstring); the dense ones have none
    tol = TOLERANCE[dtype if name in ("deepseek_v3_dense", "minicpm3", "youtu") else F32]
    check_cp_against_reference(copy.deepcopy(pristine), model, data, logits, loss, mesh_for(cp), strategy=strategy,
                               sharded=sharded, tol=tol, max_seq_len=SEQ_LEN, block_size=block_size,
                               ulysses_degree=2 if strategy == "hybrid" else 0)


def _add(name: str, strategy: str, cp: int, sharded: bool, dtype: torch.dtype, packed: bool = False,
         lora: bool = False, block_size: int = 0):
    extras = f"{'_packed' if packed else ''}{'_lora' if lora else ''}{f'_tiles{block_size}' if block_size else ''}"
    checks.add(functools.partial(check, name, strategy, cp, sharded, dtype, packed, lora, block_size),
               name=f"{name}_{strategy}_cp{cp}_{'fsdp' if sharded else 'plain'}_{str(dtype)[6:]}{extras}",
               skip=skip_reason(name, dtype), group=None if sharded else cp)


for _name in ("deepseek_v2", "deepseek_v3", "glm4_moe_lite"):
    for _run in RUNS:  # every strategy, cp 1, 2 and 4, plain and FSDP, float32 and float64
        _add(_name, *_run)
for _name in ("minicpm3", "youtu", "axk1", "sarvam_mla"):
    for _run in RUNS:
        _add(_name, *_run)
_add("sarvam_mla", "ring", 2, True, F32, packed=True)
_add("sarvam_mla", "allgather", 2, False, F32, lora=True)
_add("minicpm3", "ring", 2, True, F32, packed=True)
_add("minicpm3", "allgather", 2, False, F64, lora=True)
_add("youtu", "allgather", 4, True, F32, packed=True)
_add("youtu", "ulysses", 2, False, F64, lora=True)
_add("axk1", "ring", 4, False, F32, packed=True)
_add("axk1", "ulysses", 2, True, F32, lora=True)
_add("glm4_moe_lite", "ring", 2, True, F32, packed=True)
_add("glm4_moe_lite", "allgather", 2, False, F64, lora=True)
_add("deepseek_v2", "ring", 4, False, F64, packed=True)
_add("deepseek_v3", "allgather", 4, True, F32, packed=True)
_add("deepseek_v3", "ulysses", 2, True, F32, lora=True)
_add("deepseek_v2_dynamic_rope", "ring", 4, False, F64)
_add("deepseek_v2_dynamic_rope", "hybrid", 4, True, F32)
_add("deepseek_v3_dense", "hybrid", 4, False, F64)
_add("deepseek_v3_dense", "ring", 2, False, F64, packed=True, block_size=4)  # Note [Tiled attention]


@functools.partial(checks.add, group=2, skip=skip_reason("deepseek_v3"))
def padded_values_reach_the_strategies():
    """Every layer's attention call at cp 2 (ring) gets v of the query/key heads' width (12, the
    last 6 columns zero) and hands back 6 columns per head: the path of Note [Value heads narrower
    than keys] is the one the checks above take."""
    from llama_cp import shard_batch

    model = apply_context_parallel(family_model("deepseek_v3"), mesh_for(2)["cp"], strategy="ring")
    seen = []

    class Recorded:  # the layer's ContextParallelAttention, its calls recorded
        def __init__(self, attention):
            self.attention = attention

        def __getattr__(self, name):
            return getattr(self.attention, name)

        def __call__(self, q, k, v, **kwargs):
            seen.append((q.shape[-1], k.shape[-1], v.shape[-1], bool((v[..., 6:] == 0).all())))
            return self.attention(q, k, v, **kwargs)

    for layer in model.model.layers:
        layer.self_attn.cp_attention = Recorded(layer.self_attn.cp_attention)

    local = shard_batch(batch(), mesh_for(2)["cp"])
    hidden = model.model(input_ids=local["input_ids"], position_ids=local["position_ids"]).last_hidden_state
    assert seen == [(12, 12, 12, True)] * 2, seen
    assert hidden.shape == (2, SEQ_LEN // 2, 32) and model.model.layers[0].self_attn.o_proj.in_features == 4 * 6


@functools.partial(checks.add, group=1, skip=skip_reason("deepseek_v2") or skip_reason("deepseek_v3"))
def features_change_the_result():
    """Each feature moves the logits by more than 1e-3 when switched off (the assertion message lists
    how far): V3's router score bias, shared experts, yarn's mscale_all_dim, interleaved RoPE; V2's
    group-limited routing, its dynamic RoPE; and transformers' packed rows equal each document run
    alone (the reference of the packed checks), which differ from the rows unpacked."""
    data = packed_data()
    ids = data["input_ids"]
    moved = {}
    with torch.no_grad():
        for feature, name, overrides, change in (
            ("V3 router score bias", "deepseek_v3", {}, _zero("e_score_correction_bias")),
            ("V3 shared experts", "deepseek_v3", {}, _zero("shared_experts.down_proj.weight")),
            ("V3 yarn mscale_all_dim", "deepseek_v3", yarn(mscale_all_dim=0.0), None),
            ("V3 interleaved RoPE", "deepseek_v3", dict(rope_interleave=False), None),
            ("V2 group-limited routing", "deepseek_v2", dict(topk_method="greedy"), None),
            ("V2 dynamic RoPE", "deepseek_v2_dynamic_rope", rope(rope_type="default", rope_theta=10000.0), None),
        ):
            off = family_model(name, **overrides)
            if change is not None:
                change(off)
            moved[feature] = float((family_model(name)(input_ids=ids).logits - off(input_ids=ids).logits).abs().max())
        for name in ("deepseek_v2", "deepseek_v3"):
            model = family_model(name)
            packed = reference_forward(model, data)[0]
            torch.testing.assert_close(packed, documents_alone(model, data, PACKED_LENGTHS), **TOLERANCE[F32])
            moved[f"{name} documents"] = float((packed - model(input_ids=ids).logits).abs().max())
    assert min(moved.values()) > 1e-3, moved


@functools.partial(checks.add, group=1, skip=skip_reason("glm4_moe_lite"))
def glm4_moe_lite_features_change_the_result():
    """GLM-4.7-Flash's features each move the logits by more than 1e-3 when switched off: the router score
    bias, the shared expert, the experts' layer (layer 0 dense: its experts there instead), interleaved RoPE;
    and transformers' packed rows equal each document run alone (the packed check's reference)."""
    data = packed_data()
    ids = data["input_ids"]
    moved = {}
    with torch.no_grad():
        whole = family_model("glm4_moe_lite")(input_ids=ids).logits
        for feature, overrides, change in (
            ("router score bias", {}, _zero("e_score_correction_bias")),
            ("shared expert", {}, _zero("shared_experts.down_proj.weight")),
            ("dense layer 0", dict(mlp_layer_types=["sparse", "sparse"]), None),
            ("interleaved RoPE", dict(rope_interleave=False), None),
        ):
            off = family_model("glm4_moe_lite", **overrides)
            if change is not None:
                change(off)
            moved[feature] = float((whole - off(input_ids=ids).logits).abs().max())
        model = family_model("glm4_moe_lite")
        packed = reference_forward(model, data)[0]
        torch.testing.assert_close(packed, documents_alone(model, data, PACKED_LENGTHS), **TOLERANCE[F32])
        moved["documents"] = float((packed - whole).abs().max())
    assert min(moved.values()) > 1e-3, moved


@functools.partial(checks.add, group=1, skip=skip_reason("minicpm3") or skip_reason("youtu") or skip_reason("axk1")
                   or skip_reason("sarvam_mla"))
def mla_families_features_change_the_result():
    """The features of MiniCPM3, Youtu-LLM and A.X K1 each move the logits by more than 1e-3 when switched
    off: MiniCPM3's scaled embeddings, residual branches and hidden states before the output layer (the last
    one llama-cp's loss repeats: ``_minicpm3`` in llama_cp/modules/families.py); interleaved RoPE; A.X K1's
    router score bias and shared expert."""
    ids = batch()["input_ids"]
    moved = {}
    with torch.no_grad():
        for feature, name, overrides, change in (
            ("MiniCPM3 embedding scale", "minicpm3", dict(scale_emb=1.0), None),
            ("MiniCPM3 residual scale", "minicpm3", dict(scale_depth=2 ** 0.5), None),  # / sqrt(2 layers) = 1
            ("MiniCPM3 output scale", "minicpm3", dict(dim_model_base=32), None),  # hidden_size / 32 = 1
            ("Youtu interleaved RoPE", "youtu", dict(rope_interleave=False), None),
            ("A.X K1 interleaved RoPE", "axk1", dict(rope_interleave=False), None),
            ("A.X K1 router score bias", "axk1", {}, _zero("e_score_correction_bias")),
            ("A.X K1 shared expert", "axk1", {}, _zero("shared_experts.down_proj.weight")),
            ("Sarvam router score bias", "sarvam_mla", {}, _zero("e_score_correction_bias")),
            ("Sarvam interleaved RoPE", "sarvam_mla", dict(rope_interleave=False), None),
        ):
            off = family_model(name, **overrides)
            if change is not None:
                change(off)
            moved[feature] = float((family_model(name)(input_ids=ids).logits - off(input_ids=ids).logits).abs().max())
        data = packed_data()
        for name in ("minicpm3", "youtu", "axk1"):  # the packed checks' reference: each document alone
            model = family_model(name)
            packed = reference_forward(model, data)[0]
            torch.testing.assert_close(packed, documents_alone(model, data, PACKED_LENGTHS), **TOLERANCE[F32])
            moved[f"{name} documents"] = float((packed - model(input_ids=data["input_ids"]).logits).abs().max())
    assert min(moved.values()) > 1e-3, moved


results = checks.module_fixture(__name__, WORLD_SIZE)


@pytest.mark.parametrize("name", checks.names)
def test_check(results, name):
    checks.assert_passed(results, name)


def test_values_wider_than_keys_are_refused():
    """cp_attention_forward pads values narrower than the keys; wider ones it refuses in one line."""
    if skip_reason("deepseek_v3"):
        pytest.skip(skip_reason("deepseek_v3"))
    layer = apply_context_parallel(family_model("deepseek_v3"), None).model.layers[0].self_attn
    q = k = torch.randn(1, 4, 8, 12)
    with pytest.raises(ValueError, match=r"^DeepseekV3Attention: value heads of 16 wider than its query/key heads "
                                         r"of 12, which context-parallel attention does not compute .*; this model "
                                         r"cannot be trained with llama-cp$"):
        cp_attention_forward(layer, q, k, torch.randn(1, 4, 8, 16), None)
    assert cp_attention_forward(layer, q, k, torch.randn(1, 4, 8, 6), None)[0].shape == (1, 8, 4, 6)


def test_no_router_loss_is_added():
    """transformers adds no router loss for DeepSeek-V2/V3 (their forwards return none), so neither does
    llama-cp, and --router_aux_loss_coef is refused for them in one line."""
    from llama_cp.modules.families import router_loss, set_router_loss_coef

    for name in ("deepseek_v2", "deepseek_v3"):
        if skip_reason(name):
            continue
        model = family_model(name, output_router_logits=True, router_aux_loss_coef=0.3)
        ids = batch()["input_ids"]
        assert getattr(model(input_ids=ids, labels=ids), "aux_loss", None) is None
        assert router_loss(model) is None
        with pytest.raises(ValueError, match=rf"^--router_aux_loss_coef 0.1: '{name}' adds no router load-balancing "
                                             r"loss \(families that do: .*\); drop the flag$"):
            set_router_loss_coef(model.config, 0.1)
