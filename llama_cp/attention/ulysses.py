"""Ulysses (all-to-all) context-parallel attention.

Ulysses re-partitions [seq / cp, heads] into [seq, heads / cp] with one all-to-all per
tensor, puts the zigzag chunks (the layout of :mod:`llama_cp.parallel.sharding`, Note [Zigzag
ring attention] in ``llama_cp/attention/ring.py``) back in order, runs ordinary causal attention
on its heads over the whole sequence (:mod:`llama_cp.attention.local`), and returns by the
inverse all-to-all. It needs heads % cp == 0; K/V heads are repeated only as much as the split
needs (cp / gcd(kv_heads, cp) times). With packed documents the heads attend within each
document of the whole row (Note [Document masks under CP] in ``llama_cp/attention/documents.py``).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from llama_cp.attention import kernel_calls
from llama_cp.attention.documents import DocumentLayout
from llama_cp.attention.kernels import Backend
from llama_cp.attention.local import local_attention
from llama_cp.attention.sinks import local_sinks
from llama_cp.attention.wire import _count


def _zigzag_to_natural(num_chunks: int) -> list[int]:
    """perm with natural[c] = gathered[perm[c]], where rank j contributed chunks j, num_chunks-1-j."""
    cp = num_chunks // 2
    return [2 * c if c < cp else 2 * (num_chunks - 1 - c) + 1 for c in range(num_chunks)]


def _natural_to_zigzag(num_chunks: int) -> list[int]:
    """Inverse of :func:`_zigzag_to_natural`: gathered[g] = natural[perm[g]]."""
    return [g // 2 if g % 2 == 0 else num_chunks - 1 - g // 2 for g in range(num_chunks)]


def _seq_to_heads(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """(B, H, S/cp, D) zigzag-sharded sequence -> (B, H/cp, S, D), whole sequence in order."""
    cp = dist.get_world_size(group)
    b, h, s_local, d = x.shape
    send = x.reshape(b, cp, h // cp, s_local, d).transpose(0, 1).contiguous()  # (cp, B, H/cp, S/cp, D)
    recv = torch.empty_like(send)
    _count("ulysses all-to-all", send.numel() * send.element_size() * (cp - 1) / cp)
    dist.all_to_all_single(recv, send, group=group)  # recv[j]: our heads, rank j's tokens
    chunks = recv.permute(1, 2, 0, 3, 4).reshape(b, h // cp, 2 * cp, s_local // 2, d)
    index = torch.tensor(_zigzag_to_natural(2 * cp), device=x.device)
    return chunks.index_select(2, index).reshape(b, h // cp, cp * s_local, d)


def _heads_to_seq(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Inverse of :func:`_seq_to_heads`: (B, H/cp, S, D) -> (B, H, S/cp, D)."""
    cp = dist.get_world_size(group)
    b, h_local, s, d = x.shape
    chunks = x.reshape(b, h_local, 2 * cp, s // (2 * cp), d)
    index = torch.tensor(_natural_to_zigzag(2 * cp), device=x.device)
    zigzag = chunks.index_select(2, index).reshape(b, h_local, cp, s // cp, d)
    send = zigzag.permute(2, 0, 1, 3, 4).contiguous()  # (cp, B, H/cp, S/cp, D): rank j's tokens
    recv = torch.empty_like(send)
    _count("ulysses all-to-all", send.numel() * send.element_size() * (cp - 1) / cp)
    dist.all_to_all_single(recv, send, group=group)  # recv[j]: head group j, our tokens
    return recv.transpose(0, 1).reshape(b, cp * h_local, s // cp, d)


class _AllToAll(torch.autograd.Function):
    """Differentiable re-partition: ``forward_fn`` forward, its inverse ``backward_fn`` backward."""

    @staticmethod
    def forward(ctx, x, group, forward_fn, backward_fn):
        ctx.group, ctx.backward_fn = group, backward_fn
        return forward_fn(x, group)

    @staticmethod
    def backward(ctx, grad):
        return ctx.backward_fn(grad, ctx.group), None, None, None


def ulysses_attention(
    q, k, v, group, *, causal: bool, scale: float, backend: Backend | None = None,
    documents: DocumentLayout | None = None, block_size: int = 0, softcap: float = 0.0, window: int | None = None,
    sinks: torch.Tensor | None = None,
):
    """Ulysses attention; q: (B, H, S/cp, D), k/v: (B, Hkv, S/cp, D) zigzag shards. Differentiable.
    With ``documents``, causal attention within each document of the gathered row; ``block_size``:
    Note [Tiled attention]; ``sinks`` (H,): Note [Attention sinks under CP], the local heads' own."""
    cp = dist.get_world_size(group)
    kv_repeat = cp // math.gcd(k.shape[1], cp)  # make the KV heads split evenly across cp
    k, v = kernel_calls.expand_kv(k, kv_repeat), kernel_calls.expand_kv(v, kv_repeat)
    q, k, v = (_AllToAll.apply(t, group, _seq_to_heads, _heads_to_seq) for t in (q, k, v))
    block = None if documents is None else documents.full_row_pieces(window)
    out = local_attention(q, k, v, causal=causal, scale=scale, backend=backend, block_size=block_size, block=block,
                          softcap=softcap, sinks=local_sinks(sinks, group))
    return _AllToAll.apply(out, group, _heads_to_seq, _seq_to_heads)
