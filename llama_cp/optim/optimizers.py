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

    A parameter whose local shard is empty (FSDP2 shards dim 0, so a rank beyond its
    rows, e.g. LoRA A of rank r on more than r ranks, owns nothing of it) is left out: the
    inner optimizer never sees it (bitsandbytes' CUDA kernels refuse a launch of zero
    blocks), and the state's layout is that of the rank's non-empty shards, the same at
    every start of the same run.
    """

    per_rank_state = True

    def __init__(self, params, inner_cls: type[torch.optim.Optimizer], **options: Any):
        self.params = [p for p in params]
        self.stepped = [p for p in self.params if _local(p).numel() > 0]
        self.shards = [nn.Parameter(_local(p).detach(), requires_grad=p.requires_grad) for p in self.stepped]
        # a rank that owns no element of any trainable parameter keeps the base class's groups (for the
        # LR scheduler) and an empty state
        self.inner = inner_cls(self.shards, **options) if self.shards else None
        super().__init__(self.params, options if self.inner is None else self.inner.defaults)
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


# Note [AdamW's implementation, pinned]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# torch.optim.AdamW picks its implementation from the parameters when none is asked for
# (torch/optim/optimizer.py, _default_to_fused_or_foreach, 2.10 and 2.13): foreach when every
# parameter is of a foreach-supported type (DTensor is one) on a device with foreach kernels
# (CUDA), else the single-tensor loop. The planner runs the step on fake CPU tensors, where the
# default is the single-tensor loop, whose temporaries are one parameter's; the GPU run is
# foreach, whose _foreach_sqrt(exp_avg_sq) is a new fp32 tensor for every parameter of the
# rank at once (torch/optim/adamw.py / adam.py, _multi_tensor_adam): 4 bytes per trainable
# parameter per rank at the optimizer's peak, a quarter of params + grads + state for a full
# fine-tune, that a plan made with the default would not show. So the implementation is pinned,
# foreach=True on every device: the trainer, the planner's fake step and the CPU tests all run
# the GPU's arithmetic and allocations (torch's CPU foreach ops loop over the tensors, at the
# single-tensor loop's speed). fused=True would allocate none of it, but its DTensor and CPU
# support across the admitted torch versions is not something this suite exercises.


def build_optimizer(name: str, params, *, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """``adamw`` (torch) or ``adamw8bit`` (bitsandbytes, on local shards)."""
    params = [p for p in params if p.requires_grad]
    if name == "adamw":  # foreach, pinned: Note [AdamW's implementation, pinned]
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, foreach=True)
    if name == "adamw8bit":
        try:
            import bitsandbytes as bnb
        except ImportError:
            raise ValueError("--optimizer adamw8bit needs bitsandbytes: pip install 'llama-cp[quant]'") from None

        return ShardLocalOptimizer(params, bnb.optim.AdamW8bit, lr=lr, weight_decay=weight_decay)
    raise ValueError(f"unknown --optimizer {name!r}; choose adamw or adamw8bit")
