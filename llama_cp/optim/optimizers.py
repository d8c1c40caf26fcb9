"""Optimizers: torch AdamW, or bitsandbytes' 8-bit AdamW on each rank's local shards."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor


class ShardLocalOptimizer(torch.optim.Optimizer):
    """Run an optimizer that does not understand DTensors (bitsandbytes' 8-bit AdamW) on the
    local shards of FSDP2's sharded parameters.

    Element-wise optimizers need nothing from other ranks, so stepping each rank's shard
    alone is exact. Each parameter gets a plain tensor that shares its local shard's
    storage; before a step its gradient is the local shard of the DTensor gradient.
    ``param_groups`` (for LR schedulers) are the inner optimizer's. The state lives on
    each rank in the inner optimizer's own (quantised) layout, so it is checkpointed per
    rank (``per_rank_state``) and a resume needs the same world size and sharding.

    ``params``: parameters, or param groups (:func:`parameter_groups`), each group stepped with its
    own options. A parameter whose local shard is empty (FSDP2 shards dim 0, so a rank beyond its
    rows, e.g. LoRA A of rank r on more than r ranks, owns nothing of it) is left out: the
    inner optimizer never sees it (bitsandbytes' CUDA kernels refuse a launch of zero
    blocks), and the state's layout is that of the rank's non-empty shards, the same at
    every start of the same run.
    """

    per_rank_state = True

    def __init__(self, params, inner_cls: type[torch.optim.Optimizer], **options: Any):
        groups = _as_groups(params)
        self.params = [p for group in groups for p in group["params"]]
        self.stepped = [p for p in self.params if _local(p).numel() > 0]
        self.shards = [nn.Parameter(_local(p).detach(), requires_grad=p.requires_grad) for p in self.stepped]
        # each group's non-empty shards, in a group with the same options; a group none of whose shards
        # has an element on this rank is left out of the inner optimizer (the layout is still the same
        # at every start of the run)
        shard_of = dict(zip(map(id, self.stepped), self.shards, strict=True))
        inner_groups = [{**group, "params": [shard_of[id(p)] for p in group["params"] if id(p) in shard_of]}
                        for group in groups]
        inner_groups = [group for group in inner_groups if group["params"]]
        # a rank that owns no element of any trainable parameter keeps the base class's groups (for the
        # LR scheduler) and an empty state
        self.inner = inner_cls(inner_groups, **options) if inner_groups else None
        super().__init__(groups, options if self.inner is None else self.inner.defaults)
        if self.inner is not None:
            self.param_groups = self.inner.param_groups
            self.state = self.inner.state

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("ShardLocalOptimizer.step takes no closure")
        for param, shard in zip(self.stepped, self.shards, strict=True):
            shard.grad = None if param.grad is None else _local(param.grad)
        if self.inner is not None:
            self.inner.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for shard in self.shards:
            shard.grad = None
        for param in self.params:
            if param.grad is not None:
                if set_to_none:
                    param.grad = None
                else:
                    param.grad.zero_()

    def state_dict(self) -> dict[str, Any]:
        return super().state_dict() if self.inner is None else self.inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.inner is None:
            super().load_state_dict(state_dict)
        else:
            self.inner.load_state_dict(state_dict)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _as_groups(params) -> list[dict[str, Any]]:
    """Param groups (dicts, as given) or one group of a list of parameters."""
    params = list(params)
    if params and isinstance(params[0], dict):
        return [dict(group, params=list(group["params"])) for group in params]
    return [{"params": params}]


#: The param-group key that says whether ``--weight_decay`` applies to the group (Note [Which
#: parameters decay]); ``llama_cp.optim.schedule.start_schedule`` reads it on every (re)start.
DECAYS = "decays"


# Note [Which parameters decay]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# --weight_decay pulls a weight toward zero at every step. That suits the matrices of the
# linear layers; it does not suit
#
#   norm weights (RMSNorm, LayerNorm)     a per-channel gain around 1: decay drags it to 0;
#   biases                                an offset, not a map whose size a prior should shrink;
#   DoRA's magnitude vector               each row's norm, a gain like a norm's;
#   embedding tables                      a row moves only when its token occurs, but decoupled
#                                         decay shrinks every row at every step: rare tokens'
#                                         rows fade toward 0 (minGPT's configure_optimizers
#                                         keeps nn.Embedding, like LayerNorm, out of decay).
#
# Two rules are in use. HF Trainer's get_decay_parameter_names (transformers 5.24) decays every
# parameter but those of nn.LayerNorm modules and those whose names match bias, layernorm,
# rmsnorm, .norm or _norm: norms found by name, while embeddings and DoRA's magnitudes decay.
# nanoGPT's configure_optimizers and timm's param_groups_weight_decay decay exactly the
# parameters of >= 2 dimensions. We take the dimension rule, and take the embedding tables out:
#
#   decays  <=>  param.ndim >= 2  and  param is not the weight of an nn.Embedding
#
# The dimension rule needs no list of norm classes or names (every family has its own RMSNorm
# class and naming), and it covers biases, norms and DoRA's magnitude (1-D) in one test. The
# embedding test is by identity: a tied lm_head is the embedding's tensor and does not
# decay; an untied lm_head is a Linear and does, as a Linear's weight does in minGPT. LoRA's
# A and B are matrices and decay (as HF Trainer + peft decay them); a trainable copy of
# --lora_modules_to_save follows the rule of what it copies (embed_tokens: no, norm: no,
# lm_head: yes). FSDP2's sharded parameters are DTensors of the full shape, so every rank
# groups the same parameters whatever its shard holds. Frozen parameters are in no group.
#
# The groups carry DECAYS, so that a resumed run writes its --weight_decay into the decaying
# group only (Note [Changing settings on resume] in llama_cp/train/run_dir.py); an empty group
# is left out (LoRA without DoRA has nothing that does not decay).


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """The trainable parameters of ``model`` in (at most) two param groups: those that decay
    with ``weight_decay`` and those that do not (Note [Which parameters decay])."""
    embeddings = {id(module.weight) for module in model.modules() if isinstance(module, nn.Embedding)}
    decay, no_decay = [], []
    for param in model.parameters():  # a tied parameter once
        if param.requires_grad:
            (decay if param.ndim >= 2 and id(param) not in embeddings else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay, DECAYS: True},
              {"params": no_decay, "weight_decay": 0.0, DECAYS: False}]
    return [group for group in groups if group["params"]]


# Note [AdamW's implementation, pinned]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# torch.optim.AdamW picks its implementation from the parameters when none is asked for
# (torch/optim/optimizer.py, _default_to_fused_or_foreach, 2.10 and 2.13): foreach when every
# parameter is of a foreach-supported type (DTensor is one) on a device with foreach kernels
# (CUDA), else the single-tensor loop. The planner runs the step on fake CPU tensors, where the
# default is the single-tensor loop, whose temporaries are one parameter's; the GPU run is
# foreach, whose _foreach_sqrt(exp_avg_sq) is a new fp32 tensor for every parameter of the
# rank's param group at once (torch/optim/adamw.py / adam.py, _multi_tensor_adam, called once
# per group): 4 bytes per trainable parameter of the larger group (Note [Which parameters
# decay]: the matrices) per rank at the optimizer's peak, nearly a quarter of params + grads +
# state for a full fine-tune, that a plan made with the default would not show. So the implementation is pinned,
# foreach=True on every device: the trainer, the planner's fake step and the CPU tests all run
# the GPU's arithmetic and allocations (torch's CPU foreach ops loop over the tensors, at the
# single-tensor loop's speed). fused=True allocates none of it.
#
# With --offload_params the step runs on the host's shards (FSDP2's CPU offload policy), and
# there fused=True: one vectorised, multithreaded kernel per parameter group. Measured with
# benchmarks/cpu_adamw.py (torch 2.13 CPU, 2 threads, one Llama-3-8B layer, 218M fp32
# parameters): the loop 0.73 s a step, foreach 0.43 s, fused 0.053 s (8x foreach), and no
# sqrt(exp_avg_sq) temporaries, which for an 8B model on one GPU would be 30 GiB of host
# memory. Its parameters differ from foreach's by rounding (2.4e-7 after 3 steps there).
# tests/model/test_levers_world2.py runs it on CPU DTensors, on the floors' torch too.


def build_optimizer(
    name: str, params, *, lr: float, weight_decay: float, on_host: bool = False,
) -> torch.optim.Optimizer:
    """``adamw`` (torch) or ``adamw8bit`` (bitsandbytes, on local shards) over ``params``: a model,
    whose trainable parameters go into :func:`parameter_groups` (no decay on norms, biases and
    embeddings: Note [Which parameters decay]), or a list of parameters, one group that all decays
    (what torch's AdamW does with a list). ``on_host``: the state lives in host memory
    (--offload_params): torch's fused AdamW, not foreach (Note [AdamW's implementation, pinned])."""
    if isinstance(params, nn.Module):
        params = parameter_groups(params, weight_decay)
    else:
        trainable = [p for p in params if p.requires_grad]
        params = [{"params": trainable, "weight_decay": weight_decay, DECAYS: True}] if trainable else []
    if name == "adamw":  # foreach, or fused on the host, pinned: Note [AdamW's implementation, pinned]
        implementation = dict(fused=True) if on_host else dict(foreach=True)
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, **implementation)
    if name == "adamw8bit":
        try:
            import bitsandbytes as bnb
        except ImportError:
            raise ValueError("--optimizer adamw8bit needs bitsandbytes: pip install 'llama-cp[quant]'") from None

        return ShardLocalOptimizer(params, bnb.optim.AdamW8bit, lr=lr, weight_decay=weight_decay)
    raise ValueError(f"unknown --optimizer {name!r}; choose adamw or adamw8bit")
