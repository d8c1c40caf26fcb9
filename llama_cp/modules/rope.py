"""Rotary embeddings that pick their frequencies from the positions of the call, under context
parallelism: Note [Position-dependent RoPE under CP]."""

from __future__ import annotations

import types

import torch
import torch.distributed as dist
from torch import nn

# Note [Position-dependent RoPE under CP]
# =======================================
#
# transformers' "dynamic" and "longrope" RoPE choose their frequencies from the
# largest position of the call (``dynamic_rope_update``: max(position_ids) + 1),
# and "dynamic" keeps state across calls. Under CP a rank sees only its zigzag
# chunks, so each rank would choose from its own maximum. The rotary module of
# such a model therefore gets a forward that all-reduces the maximum over the cp
# group and calls the module's own forward on the local positions plus one extra
# column holding that maximum; cos/sin are per position, so dropping the extra
# column leaves exactly the local rows of the single-process call:
#
#     rank 1 of cp 2, L = 8:  position_ids [2 3 4 5]  ->  forward([2 3 4 5 | 7])  ->  cos/sin [:, :4]
def _reads_positions(module: nn.Module) -> bool:
    """Whether transformers' ``dynamic_rope_update`` updates this rotary module from the positions."""
    rope_type = getattr(module, "rope_type", None)
    rope_types = rope_type.values() if isinstance(rope_type, dict) else [rope_type]
    return any(isinstance(t, str) and ("dynamic" in t or t == "longrope") for t in rope_types)


def _global_rope_forward(self: nn.Module, x: torch.Tensor, position_ids: torch.Tensor, *args, **kwargs):
    """See Note [Position-dependent RoPE under CP]."""
    last = position_ids.amax().reshape(1)
    dist.all_reduce(last, op=dist.ReduceOp.MAX, group=self.cp_group)
    extended = torch.cat([position_ids, last.expand(*position_ids.shape[:-1], 1)], dim=-1)
    seq_dim, seq_len = position_ids.dim() - 1, position_ids.shape[-1]
    out = type(self).forward(self, x, extended, *args, **kwargs)
    if isinstance(out, torch.Tensor):  # DeepSeek-V2's one complex (B, S, D/2) freqs_cis, not (cos, sin)
        return out.narrow(seq_dim, 0, seq_len)
    return tuple(t.narrow(seq_dim, 0, seq_len) for t in out)


def bind_global_rope(model: nn.Module, group: dist.ProcessGroup | None) -> None:
    """Make position-dependent RoPE modules choose their frequencies from the global sequence
    (Note [Position-dependent RoPE under CP]); other rotary modules are left as they are."""
    for module in model.modules():
        # "inv_freq", or one per layer type ("full_attention_inv_freq": Gemma 3, OLMo 3)
        if not any(name.endswith("inv_freq") for name, _ in module.named_buffers(recurse=False)):
            continue
        if group is not None and _reads_positions(module):
            module.cp_group = group
            module.forward = types.MethodType(_global_rope_forward, module)
        elif "forward" in module.__dict__:  # re-applied with cp = 1 or a static RoPE: the class forward
            del module.forward
