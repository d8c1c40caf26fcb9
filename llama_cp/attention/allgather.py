"""All-gather context-parallel attention (Llama 3's long-context parallelism).

Every rank gathers the K/V of every rank, KV heads only (with GQA a quarter of the queries'
size or less), puts them in row order, and computes its own queries against the whole row with
the pieces of Note [Document masks under CP] in ``llama_cp/attention/documents.py`` (its spans
vs the row as one chunk). The backward gathers K/V again (nothing of the whole row is saved),
accumulates dK/dV of the whole row in float32 and reduce-scatters them back to their owners.
Because every rank sees every key, a rank may hold any tokens: the batch is sharded by Note
[Document-aware sharding] (``llama_cp/parallel/sharding.py``) so that packed rows are balanced
too, and the batch's ``seq_index`` says which rows a rank holds (absent: the zigzag layout).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from llama_cp.attention import kernels
from llama_cp.attention.documents import DocumentLayout, tiles
from llama_cp.attention.kernels import Backend
from llama_cp.attention.pieces import pieces_backward, pieces_forward
from llama_cp.attention.sinks import add_sinks, sink_gradient
from llama_cp.attention.wire import _count
from llama_cp.parallel.collectives import all_gather_into, reduce_scatter_into


def gather_rows(kv: torch.Tensor, group: dist.ProcessGroup, documents: DocumentLayout) -> torch.Tensor:
    """(2, B, Hkv, S/cp, D) local K/V -> (2, B, Hkv, L, D): every rank's, in row order."""
    cp = dist.get_world_size(group)
    gathered = kv.new_empty((cp * kv.shape[0], *kv.shape[1:]))
    _count("allgather K/V", kv.numel() * kv.element_size() * (cp - 1))
    all_gather_into(gathered, kv.contiguous(), group)
    gathered = gathered.unflatten(0, (cp, -1)).movedim(0, 3).flatten(3, 4)  # (2, B, Hkv, L, D), rank after rank
    return gathered.index_select(3, documents.row_order(kv.device))


def scatter_rows(dkv: torch.Tensor, group: dist.ProcessGroup, documents: DocumentLayout) -> torch.Tensor:
    """Inverse of :func:`gather_rows` for gradients: (2, B, Hkv, L, D) per rank -> the sum over
    the ranks of the local tokens' part, (2, B, Hkv, S/cp, D) (a reduce-scatter)."""
    cp = dist.get_world_size(group)
    by_rank = dkv.index_select(3, documents.row_order(dkv.device, inverse=True))  # all-gather order
    send = by_rank.unflatten(3, (cp, -1)).movedim(3, 0).contiguous()  # (cp, 2, B, Hkv, S/cp, D)
    local = dkv.new_empty(send.shape[1:])
    _count("allgather dK/dV", send.numel() * send.element_size() * (cp - 1) / cp)
    reduce_scatter_into(local, send.flatten(0, 1), group)
    return local


def allgather_forward(
    group: dist.ProcessGroup, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: DocumentLayout, *,
    scale: float, backend: Backend | None = None, block_size: int = 0, softcap: float = 0.0,
    window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """All-gather attention forward (see the module docstring). q: (B, H, S/cp, D), k/v:
    (B, Hkv, S/cp, D), the rank's tokens at rows ``documents.local_rows``. Returns out (q's
    dtype) and lse (float32)."""
    kv = gather_rows(torch.stack([k, v]), group, documents)
    block = tiles(documents.gathered_pieces(window), block_size)
    return pieces_forward(q, kv[0], kv[1], block, scale=scale, backend=backend, softcap=softcap)


def allgather_backward(
    group: dist.ProcessGroup, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    out: torch.Tensor, lse: torch.Tensor, documents: DocumentLayout, *,
    scale: float, backend: Backend | None = None, block_size: int = 0, softcap: float = 0.0,
    window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """All-gather attention backward: K/V gathered again, dK/dV of the row in float32,
    reduce-scattered to their owners and cast to the input dtype."""
    kv = gather_rows(torch.stack([k, v]), group, documents)
    dkv = torch.zeros_like(kv, dtype=kernels.accumulation_dtype(q))
    block = tiles(documents.gathered_pieces(window), block_size)
    dq = pieces_backward(
        dout, q, kv[0], kv[1], out, lse, block, scale=scale, backend=backend, dq=None, dk=dkv[0], dv=dkv[1],
        softcap=softcap,
    )
    dkv = scatter_rows(dkv, group, documents)
    return dq, dkv[0].to(k.dtype), dkv[1].to(v.dtype)


class _AllGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, scale, backend, documents, block_size, softcap, window, sinks=None):
        out, lse = allgather_forward(group, q, k, v, documents, scale=scale, backend=backend, block_size=block_size,
                                     softcap=softcap, window=window)
        if sinks is not None:  # Note [Attention sinks under CP] in llama_cp/attention/sinks.py
            out, lse = add_sinks(out, lse, sinks)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.group, ctx.scale, ctx.backend, ctx.documents, ctx.block_size = group, scale, backend, documents, block_size
        ctx.softcap, ctx.window = softcap, window
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        grads = allgather_backward(
            ctx.group, dout, q, k, v, out, lse, ctx.documents, scale=ctx.scale, backend=ctx.backend,
            block_size=ctx.block_size, softcap=ctx.softcap, window=ctx.window,
        )
        dsinks = sink_gradient(dout, out, lse, sinks) if ctx.needs_input_grad[-1] else None  # frozen: none
        return *grads, None, None, None, None, None, None, None, dsinks
