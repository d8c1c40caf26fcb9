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
    """

    per_rank_state = True

    def __init__(self, params, inner_cls: type[torch.optim.Optimizer], **options: Any):
        self.params = [p for p in params]
        self.shards = [nn.Parameter(_local(p).detach(), requires_grad=p.requires_grad) for p in self.params]
        self.inner = inner_cls(self.shards, **options)
        super().__init__(self.params, self.inner.defaults)
        self.param_groups = self.inner.param_groups
        self.state = self.inner.state

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("ShardLocalOptimizer.step takes no closure")
        for param, shard in zip(self.params, self.shards):
            shard.grad = None if param.grad is None else _local(param.grad)
        self.inner.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for param, shard in zip(self.params, self.shards):
            shard.grad = None
            if param.grad is not None:
                if set_to_none:
                    param.grad = None
                else:
                    param.grad.zero_()

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.inner.load_state_dict(state_dict)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def build_optimizer(name: str, params, *, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """``adamw`` (torch) or ``adamw8bit`` (bitsandbytes, on local shards)."""
    params = [p for p in params if p.requires_grad]
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    if name == "adamw8bit":
        try:
            import bitsandbytes as bnb
        except ImportError:
            raise ValueError("--optimizer adamw8bit needs bitsandbytes: pip install 'llama-cp[quant]'") from None

        return ShardLocalOptimizer(params, bnb.optim.AdamW8bit, lr=lr, weight_decay=weight_decay)
    raise ValueError(f"unknown --optimizer {name!r}; choose adamw or adamw8bit")
