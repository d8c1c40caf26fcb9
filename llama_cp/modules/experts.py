"""Every expert of an MoE gets a gradient on every rank (Note [An expert no token picked]).

    apply_expert_gradients(model)   # before FSDP: parallelize_model does it
"""

from __future__ import annotations

import torch
from torch import nn

# Note [An expert no token picked]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# In transformers 4.x the MoE families hold their experts as separate modules, an nn.ModuleList of
# MLPs, and run only the experts some token picked (4.56.2: MixtralSparseMoeBlock,
# Qwen3MoeSparseMoeBlock and Qwen2MoeSparseMoeBlock loop over ``expert_hit``; DeepseekV2MoE,
# DeepseekV3MoE and Glm4MoeMoE skip an expert with no tokens): an expert that no token of this rank
# picked is not in the graph, and its parameters' .grad stays None. FSDP2 reduce-scatters the
# gradients of the parameters that have one (torch 2.10, distributed/fsdp/_fully_shard/
# _fsdp_param_group.py, post_backward: ``fsdp_params_with_grad``), so ranks whose tokens picked
# different experts reduce different lists (tests/modules/test_idle_experts.py, a decoder layer of
# its tiny Mixtral, float32, 2 ranks, transformers 4.56.2):
#
#     rank 0: attention, router, the experts its tokens picked (not 6)  -> 34112 bytes
#     rank 1: the same, and expert 6 (its marker token's)               -> 46400 bytes
#
# gloo aborts ("46400 vs 34112. Received data size doesn't match expected size"); NCCL (not run
# here) would hang or sum misaligned shards. A forward hook on each such MoE block adds
# ``0 * sum(p.sum())`` over its experts' trainable parameters (LoRA adapters included) to its output,
# inside the decoder layer's forward, where FSDP holds them unsharded: every expert is in the graph
# and gets a gradient on every rank, exactly zero where no token picked it, and the output is
# unchanged (x + 0 == x for finite parameters). An expert that no token of the whole step picked
# then has a zero gradient instead of None, so the optimizer steps it like any other parameter
# (AdamW: its moments decay, weight decay applies), as transformers 5.x steps its fused experts (one
# 3-D parameter for all: 5.24's MixtralExperts; the idle ones' slices get zeros). Cost: a pass over
# the experts' weights in forward and one in backward, independent of the tokens (one CPU thread, a
# Mixtral block of 8 experts of 512 x 1024: 121 -> 142 ms a forward and backward at 512 tokens,
# within noise at 2048). Blocks are found by structure, an ``experts`` nn.ModuleList with trainable
# parameters, not by version: in 5.24 ``experts`` is one module of fused parameters, and no hook is
# installed.


def expert_blocks(model: nn.Module) -> list[nn.Module]:
    """The MoE blocks of ``model`` whose experts are separate modules (an ``experts`` nn.ModuleList)
    with trainable parameters (LoRA adapters on them count)."""
    return [module for module in model.modules()
            if isinstance(getattr(module, "experts", None), nn.ModuleList)
            and any(p.requires_grad for p in module.experts.parameters())]


def add_zero_from_every_expert(block: nn.Module, args, output):
    """Forward hook: ``output`` (a tensor, or a tuple whose first item is the hidden states) plus
    exactly zero that depends on every trainable expert parameter (Note [An expert no token picked])."""
    if not torch.is_grad_enabled():  # no backward: nothing to reduce
        return output
    params = [p for p in block.experts.parameters() if p.requires_grad]  # unsharded here under FSDP
    zero = 0 * sum(p.sum() for p in params)
    if isinstance(output, tuple):
        return (output[0] + zero, *output[1:])
    return output + zero


def apply_expert_gradients(model: nn.Module) -> int:
    """Install :func:`add_zero_from_every_expert` on each of :func:`expert_blocks`; returns how many."""
    blocks = expert_blocks(model)
    for block in blocks:
        block.register_forward_hook(add_zero_from_every_expert)
    return len(blocks)
