"""An MoE expert that no token of one rank picks, under FSDP on 2 gloo ranks (Note [An expert no
token picked] in llama_cp/modules/experts.py).

A tiny Mixtral (8 experts, top 2) whose routing is fixed by construction: expert IDLE is picked by
no token, expert RANK1_ONLY only by the MARKER token, which lies in rank 1's tokens at cp 2 and at
dp_shard 2 alike. Through ``parallelize_model`` (FSDP2 over dp_shard x cp) its logits, loss and every
gradient equal single-process transformers'; the idle expert's gradient is exactly zero (the
reference's is None on transformers 4.x, zero on 5.x, where the experts are fused parameters), with
LoRA on the experts too (4.x). On transformers 4.x without the fix the ranks reduce-scatter different
parameter lists: gloo aborts ("46400 vs 34112. Received data size doesn't match expected size").
Every 4.x MoE family's blocks get the hook, and 5.x's none.
"""

import copy
import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from transformers import AutoConfig, AutoModelForCausalLM

from dist_harness import Checks
from llama_cp import ParallelDims, shard_batch
from llama_cp.config import TrainConfig
from llama_cp.model.build import lora_config, parallelize_model
from llama_cp.model.loss import causal_lm_loss_sum, count_valid_tokens
from llama_cp.modules.experts import add_zero_from_every_expert, apply_expert_gradients, expert_blocks
from llama_cp.parallel.sharding import unshard

WORLD_SIZE = 2
VOCAB, SEQ_LEN, BATCH = 96, 8, 2
EXPERTS = 8
IDLE, RANK1_ONLY = 7, 6  # experts: picked by no token; picked by the marker only
MARKER, MARKER_AT = 5, (1, 3)  # token id, (row, position): rank 1's at cp 2 (zigzag: positions 2-5) and at dp_shard 2
CONSTANT, MARKED = 0, 1  # residual dims that no layer writes: 1 on every token; 1 on the marker only
TRANSFORMERS_5 = int(transformers.__version__.split(".")[0]) >= 5
TOL = dict(atol=1e-5, rtol=1e-5)
checks = Checks()


def moe_blocks(model: nn.Module) -> list[nn.Module]:
    return [module for module in model.modules() if hasattr(module, "experts") and hasattr(module, "gate")]


def idle_expert_model() -> nn.Module:
    """The tiny Mixtral with its routing fixed: the router reads only the two reserved dims, expert
    IDLE's logit is -10 x (a positive number) on every token, RANK1_ONLY's positive on the marker only."""
    config = AutoConfig.for_model(
        "mixtral", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, attn_implementation="sdpa", num_local_experts=EXPERTS, num_experts_per_tok=2,
    )
    torch.manual_seed(0)
    eager = {"experts_implementation": "eager"} if TRANSFORMERS_5 else {}  # the loop over experts, as in 4.x
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, **eager)
    reserved = [CONSTANT, MARKED]
    with torch.no_grad():
        embed = model.model.embed_tokens.weight
        embed[:, CONSTANT], embed[:, MARKED] = 1.0, 0.0
        embed[MARKER, MARKED] = 1.0
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[reserved] = 0.0  # nothing writes the reserved dims of the residual
            block, = moe_blocks(layer)
            if TRANSFORMERS_5:  # fused: down_proj (experts, hidden, intermediate)
                block.experts.down_proj[:, reserved] = 0.0
            else:  # 4.x: one MixtralBlockSparseTop2MLP per expert, w2 its down projection
                for expert in block.experts:
                    expert.w2.weight[reserved] = 0.0
            router = block.gate.weight  # (experts, hidden)
            router[:, reserved] = 0.0
            router[IDLE, CONSTANT] = -10.0
            router[RANK1_ONLY, CONSTANT], router[RANK1_ONLY, MARKED] = -10.0, 30.0
    return model


def batch() -> dict[str, torch.Tensor]:
    """input_ids and pre-shifted labels; the marker once, at MARKER_AT."""
    g = torch.Generator().manual_seed(11)
    tokens = torch.randint(6, VOCAB, (BATCH, SEQ_LEN + 1), generator=g)
    tokens[MARKER_AT] = MARKER
    labels = tokens[:, 1:].clone()
    labels[:, -1] = -100
    return {"input_ids": tokens[:, :-1], "labels": labels}


@functools.cache
def reference():
    """(pristine copy, reference after HF's forward and backward, logits, loss, router logits per layer)."""
    model = idle_expert_model()
    pristine = copy.deepcopy(model)
    data = batch()
    out = model(input_ids=data["input_ids"], output_router_logits=True)
    loss = F.cross_entropy(out.logits.flatten(0, 1), data["labels"].flatten(), ignore_index=-100)
    loss.backward()
    return pristine, model, out.logits.detach(), loss.detach(), [r.detach() for r in out.router_logits]


@checks.add
def the_routing_is_as_built():
    """The premise: in every layer expert IDLE is picked by no token, RANK1_ONLY by the marker only."""
    *_, router_logits = reference()
    marker = (batch()["input_ids"] == MARKER).flatten()
    assert marker.sum() == 1
    for logits in router_logits:  # (tokens, experts)
        picked = logits.topk(2, dim=-1).indices
        assert not (picked == IDLE).any()
        assert torch.equal((picked == RANK1_ONLY).any(-1), marker)


@functools.cache
def mesh_for(dp_shard: int, cp: int):
    return ParallelDims(dp_shard=dp_shard, cp=cp).build_mesh("cpu")


@functools.cache
def lora_reference():
    """:func:`reference` with LoRA on every expert's w1, w2, w3 (transformers 4.x's Linear experts;
    peft's default init, B = 0, after seed 1 as in :func:`expert_gradients_match`)."""
    from peft import get_peft_model

    model = idle_expert_model()
    pristine = copy.deepcopy(model)  # get_peft_model adapts the model it is given in place
    torch.manual_seed(1)
    model = get_peft_model(model, lora_config(flags(1, 1, False, lora=True)))
    data = batch()
    logits = model(input_ids=data["input_ids"]).logits
    loss = F.cross_entropy(logits.flatten(0, 1), data["labels"].flatten(), ignore_index=-100)
    loss.backward()
    return pristine, model, logits.detach(), loss.detach(), None


def flags(dp_shard: int, cp: int, activation_checkpointing: bool, lora: bool = False) -> TrainConfig:
    lora_flags = dict(use_peft=True, lora_target_modules="w1,w2,w3", lora_r=2, lora_dropout=0.0) if lora else {}
    return TrainConfig.from_flags(dp_shard=dp_shard, cp=cp, cp_strategy="ring", context_length=SEQ_LEN,
                                  document_mask=False, dtype="float32",
                                  activation_checkpointing=activation_checkpointing, **lora_flags)


def expert_gradients_match(dp_shard: int, cp: int, activation_checkpointing: bool, lora: bool = False):
    pristine, ref_model, ref_logits, ref_loss, _ = lora_reference() if lora else reference()
    mesh = mesh_for(dp_shard, cp)
    torch.manual_seed(1)  # LoRA's A, as in lora_reference
    model = parallelize_model(copy.deepcopy(pristine), flags(dp_shard, cp, activation_checkpointing, lora), mesh)
    hooked = [block for block in moe_blocks(model)
              if add_zero_from_every_expert in block._forward_hooks.values()]
    assert len(hooked) == (0 if TRANSFORMERS_5 else 2), hooked  # 5.x: fused experts, nothing to do
    cp_mesh = mesh["cp"]
    dp, dp_rank = mesh["dp"].size(), mesh["dp"].get_local_rank()
    data = batch()
    local = shard_batch({k: v.chunk(dp)[dp_rank] for k, v in data.items()}, cp_mesh)
    rows = slice(dp_rank * BATCH // dp, (dp_rank + 1) * BATCH // dp)
    if dist.get_rank() == 0:  # the case: this rank's tokens never pick RANK1_ONLY
        assert not (local["input_ids"] == MARKER).any()

    with torch.no_grad():
        logits = model(input_ids=local["input_ids"], position_ids=local["position_ids"]).logits
    torch.testing.assert_close(unshard(logits, cp_mesh), ref_logits[rows], **TOL)
    loss = causal_lm_loss_sum(model, local) / count_valid_tokens([local["labels"]])
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    torch.testing.assert_close(total, ref_loss, **TOL)

    idle = []  # names of the parameters whose reference gradient is None: the idle expert's (4.x only)
    for (name, param), ref_param in zip(model.named_parameters(), ref_model.parameters(), strict=True):
        if not ref_param.requires_grad:  # LoRA's frozen base
            assert param.grad is None, f"{name} has a gradient but should be frozen"
            continue
        assert param.grad is not None, f"{name} has no gradient"
        grad, ref_grad = param.grad, ref_param.grad
        if isinstance(grad, DTensor):  # this rank's shard, against the same slice of the reference's
            shape, offset = compute_local_shape_and_global_offset(grad.shape, grad.device_mesh, grad.placements)
            grad = grad.to_local()
            if ref_grad is not None:
                ref_grad = ref_grad[tuple(slice(o, o + n) for o, n in zip(offset, shape))]
        if ref_grad is None:
            idle.append(name)
            assert not grad.any(), f"{name}: the idle expert's gradient is not exactly zero"
            continue
        torch.testing.assert_close(grad, ref_grad, **TOL, msg=lambda m, name=name: f"{name}: {m}")
    if TRANSFORMERS_5:  # fused experts: the idle expert's slices of them are zero in the reference too
        assert not idle
        for block in moe_blocks(ref_model):
            assert not block.experts.down_proj.grad[IDLE].any()
            assert block.experts.down_proj.grad[RANK1_ONLY].any()
    elif lora:
        prefix = "base_model.model.model.layers"
        assert idle == [f"{prefix}.{i}.block_sparse_moe.experts.{IDLE}.{w}.lora_{ab}.default.weight"
                        for i in range(2) for w in ("w1", "w2", "w3") for ab in "AB"], idle
        for block in moe_blocks(ref_model):
            assert block.experts[RANK1_ONLY].w2.lora_B.default.weight.grad.any()
    else:
        assert idle == [f"model.layers.{i}.block_sparse_moe.experts.{IDLE}.{w}.weight"
                        for i in range(2) for w in ("w1", "w2", "w3")], idle
        for block in moe_blocks(ref_model):
            assert block.experts[RANK1_ONLY].w2.weight.grad.any()


for _dp_shard, _cp, _checkpointing in ((1, 2, False), (2, 1, True)):
    checks.add(functools.partial(expert_gradients_match, _dp_shard, _cp, _checkpointing),
               name=f"idle_expert_fsdp_dp{_dp_shard}_cp{_cp}{'_checkpointed' if _checkpointing else ''}")
checks.add(functools.partial(expert_gradients_match, 1, 2, False, lora=True), name="idle_expert_lora_fsdp_dp1_cp2",
           skip="LoRA on the experts' Linear layers: transformers 4.x (5.x fuses them)" if TRANSFORMERS_5 else None)


@checks.add
def the_hook_adds_exactly_zero():
    """On 4.x each MoE block's output is bit for bit the same with the hook, and the idle expert's
    gradient is a tensor of zeros (None without the hook); on 5.x no block is hooked."""
    model = idle_expert_model()
    blocks = moe_blocks(model)
    if TRANSFORMERS_5:
        assert expert_blocks(model) == [] and apply_expert_gradients(model) == 0
        assert all(block.experts.down_proj.dim() == 3 for block in blocks)  # fused: (experts, hidden, intermediate)
        return
    assert expert_blocks(model) == blocks and len(blocks) == 2
    hidden = torch.randn(BATCH, SEQ_LEN, 32, generator=torch.Generator().manual_seed(3))
    hidden[..., CONSTANT], hidden[..., MARKED] = 1.0, 0.0  # no marker: neither IDLE nor RANK1_ONLY is picked
    for block in blocks:
        plain = block(hidden)
        assert block.experts[IDLE].w1.weight.grad is None
        handle = block.register_forward_hook(add_zero_from_every_expert)
        hooked = block(hidden)
        handle.remove()
        assert all(torch.equal(a, b) for a, b in zip(plain, hooked, strict=True))
        hooked[0].sum().backward()
        grads = [[param.grad for param in expert.parameters()] for expert in block.experts]
        assert all(grad is not None for expert in grads for grad in expert)
        assert not any(grad.any() for i in (IDLE, RANK1_ONLY) for grad in grads[i])
        assert all(grads[i][0].any() for i in range(EXPERTS) if i not in (IDLE, RANK1_ONLY))


#: MoE families (8 experts, top 2), as tests/plan/test_families_plan.py configures them; layer 0 of
#: DeepSeek and GLM-4.5 dense. Three tokens pick at most 6 experts per layer: some are idle.
MOE_FAMILIES = {
    "mixtral": dict(num_local_experts=EXPERTS),
    "qwen3_moe": dict(num_experts=EXPERTS, moe_intermediate_size=16),
    "qwen2_moe": dict(num_experts=EXPERTS, moe_intermediate_size=16, shared_expert_intermediate_size=24),
    "glm4_moe": dict(n_routed_experts=EXPERTS, n_shared_experts=2, moe_intermediate_size=16, first_k_dense_replace=1,
                     n_group=2, topk_group=1),
    "deepseek_v2": dict(head_dim=None, num_key_value_heads=4, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4,
                        v_head_dim=6, n_routed_experts=EXPERTS, n_shared_experts=1, moe_intermediate_size=16,
                        first_k_dense_replace=1, n_group=2, topk_group=1, q_lora_rank=None),
}
MOE_FAMILIES["deepseek_v3"] = dict(MOE_FAMILIES["deepseek_v2"], q_lora_rank=12)


@checks.add
def every_moe_family_gets_a_gradient_for_every_expert():
    """On 4.x every MoE family's blocks are hooked, and a forward and backward of 3 tokens gives every
    parameter a gradient with the same logits, bit for bit; on 5.x none is hooked (fused experts)."""
    tokens = torch.tensor([[7, 40, 81]])
    for family, overrides in MOE_FAMILIES.items():
        fields = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts_per_tok=2)
        fields.update(overrides)
        if fields["head_dim"] is None:  # MLA: none at all (V3's config would take it for the RoPE slice's)
            del fields["head_dim"]
        config = AutoConfig.for_model(family, **fields)
        torch.manual_seed(0)
        eager = {"experts_implementation": "eager"} if TRANSFORMERS_5 else {}
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, **eager)
        plain = copy.deepcopy(model)
        layers = 1 if "first_k_dense_replace" in overrides else 2
        assert apply_expert_gradients(model) == (0 if TRANSFORMERS_5 else layers), family
        logits = model(input_ids=tokens).logits
        assert torch.equal(logits, plain(input_ids=tokens).logits), family
        logits.sum().backward()
        missing = [name for name, p in model.named_parameters() if p.grad is None]
        assert not missing, (family, missing)


results = checks.module_fixture(__name__, WORLD_SIZE)


@pytest.mark.parametrize("name", checks.names)
def test_check(results, name):
    checks.assert_passed(results, name)
