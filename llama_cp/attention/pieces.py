"""Attention over exactly the (query, key) pairs of a block's pieces: forward and backward, one
kernel call per piece or, on CUDA, a few varlen calls per block, and ``pieces_attention``, their
autograd function for one process. The pieces, tiles and windows themselves, and their Notes
([Document masks under CP], [Sliding windows under CP], [Tiled attention]), are in
``llama_cp/attention/documents.py``.

The varlen calls (CUDA) are ``llama_cp/attention/varlen.py``.
"""

from __future__ import annotations

import itertools

import torch

from llama_cp.attention import kernels, varlen
from llama_cp.attention.documents import Piece, planned_tiles
from llama_cp.attention.kernels import Backend
from llama_cp.attention.sinks import add_sinks, sink_gradient


def pieces_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: list[Piece], *, scale: float,
    backend: Backend | None, out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of the pieces of one block. q: (B, H, Sq, D), k/v: (B, Hkv, Sk, D).

    With ``out`` (accumulation dtype) and ``lse`` given, merges into them in place (the ring).
    Without, returns out in q's dtype and lse, each query slice accumulated in float32 over
    its pieces (consecutive in ``block``) and then written (Note [Tiled attention]); rows
    that see nothing get out = 0, lse = -inf.
    """
    backend, plan = _resolve(backend, block, q)  # auto (None) named here: the varlen calls need the name
    if plan is not None:
        return varlen.varlen_pieces_forward(q, k, v, plan, scale, backend, out, lse, softcap)
    block = planned_tiles(block, q)
    if out is not None:
        for piece in block:
            block_out, block_lse = _piece_forward(q, k, v, piece, scale, backend, softcap)
            kernels.merge_block(out[piece.rows, :, piece.q], lse[piece.rows, :, piece.q], block_out, block_lse)
        return out, lse
    acc = kernels.accumulation_dtype(q)
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:3], float("-inf"), dtype=acc, device=q.device)
    for _, group in itertools.groupby(block, key=lambda p: p.queries):
        group = list(group)
        rows, qs = group[0].rows, group[0].q
        query_out = torch.zeros_like(q[rows, :, qs], dtype=acc)
        query_lse = torch.full(query_out.shape[:3], float("-inf"), dtype=acc, device=q.device)
        for piece in group:
            kernels.merge_block(query_out, query_lse, *_piece_forward(q, k, v, piece, scale, backend, softcap))
        out[rows, :, qs] = query_out
        lse[rows, :, qs] = query_lse
    return out, lse


def _resolve(backend: Backend | None, block: list[Piece], q: torch.Tensor) -> tuple[Backend, list | None]:
    """(``backend`` resolved, the block's ``varlen.varlen_plan`` for it), the block's varlen calls worked
    out once. "auto" (None) is the fastest backend, unless the block's documents take fewer calls
    through a varlen kernel: then the fastest varlen backend (on an H100, sdpa_cudnn is the fastest
    and has none; hundreds of per-document launches would cost more than it saves)."""
    if backend is None:
        fastest = kernels.select_backend(q, varlen=True)  # the fastest backend with a varlen kernel
        windows = varlen.varlen_windows(block) if fastest is not None else None
        return (fastest, varlen.indexed_plan(windows, q)) if windows is not None else (kernels.select_backend(q), None)
    backend = kernels.resolve_backend(backend, q)
    return backend, varlen.varlen_plan(block, q, backend)


def _piece_forward(q, k, v, piece: Piece, scale, backend, softcap=0.0):
    r = piece.rows
    return kernels.attention_forward(
        q[r, :, piece.q], k[r, :, piece.k], v[r, :, piece.k], causal=piece.causal, scale=scale, backend=backend,
        softcap=softcap, lag=piece.call_lag,
    )



def pieces_backward(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    lse: torch.Tensor, block: list[Piece], *, scale: float, backend: Backend | None,
    dq: torch.Tensor | None, dk: torch.Tensor, dv: torch.Tensor, softcap: float = 0.0,
) -> torch.Tensor | None:
    """Add the gradients of the pieces of one block to the accumulators dk, dv (and dq when
    given, the ring) in place, given the final (out, lse) of every query row. Without ``dq``,
    returns dq in q's dtype, accumulated in float32 per query slice (Note [Tiled attention])."""
    backend, plan = _resolve(backend, block, q)
    if plan is not None:
        return varlen.varlen_pieces_backward(dout, q, k, v, out, lse, plan, scale, backend, dq, dk, dv, softcap)
    block = planned_tiles(block, q)
    acc = kernels.accumulation_dtype(q)
    result = None if dq is not None else torch.zeros_like(q)
    for _, group in itertools.groupby(block, key=lambda p: p.queries):
        group = list(group)
        rows, qs = group[0].rows, group[0].q
        query_dq = dq[rows, :, qs] if dq is not None else torch.zeros_like(q[rows, :, qs], dtype=acc)
        for piece in group:
            ks = piece.k
            grads = kernels.attention_backward(
                dout[rows, :, qs], q[rows, :, qs], k[rows, :, ks], v[rows, :, ks], out[rows, :, qs],
                lse[rows, :, qs], causal=piece.causal, scale=scale, backend=backend, softcap=softcap,
                lag=piece.call_lag,
            )
            query_dq += grads[0]
            dk[rows, :, ks] += grads[1]
            dv[rows, :, ks] += grads[2]
        if result is not None:
            result[rows, :, qs] = query_dq
    return result


class _PiecesAttention(torch.autograd.Function):
    """Attention of one process (cp 1, or Ulysses over the gathered row) over the pieces of a
    block: packed documents, tiles (Note [Tiled attention]), or both."""

    @staticmethod
    def forward(ctx, q, k, v, block, scale, backend, softcap, sinks):
        out, lse = pieces_forward(q, k, v, block, scale=scale, backend=backend, softcap=softcap)
        if sinks is not None:  # Note [Attention sinks under CP] in llama_cp/attention/sinks.py
            out, lse = add_sinks(out, lse, sinks)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.block, ctx.scale, ctx.backend, ctx.softcap = block, scale, backend, softcap
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        acc = kernels.accumulation_dtype(q)
        dk, dv = (torch.zeros_like(t, dtype=acc) for t in (k, v))  # every query block adds to every key
        dq = pieces_backward(
            dout, q, k, v, out, lse, ctx.block, scale=ctx.scale, backend=ctx.backend, dq=None, dk=dk, dv=dv,
            softcap=ctx.softcap,
        )
        dsinks = sink_gradient(dout, out, lse, sinks) if ctx.needs_input_grad[-1] else None  # frozen: none
        return dq, dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, dsinks


def pieces_attention(q, k, v, block: list[Piece], *, scale: float, backend: Backend | None = None,
                     softcap: float = 0.0, sinks: torch.Tensor | None = None):
    """Differentiable attention of (q, k, v) restricted to ``block``'s pieces (one query slice's
    pieces consecutive, as :func:`pieces` and :func:`tiles` make them); ``sinks``: Note
    [Attention sinks under CP]."""
    return _PiecesAttention.apply(q, k, v, block, scale, backend, softcap, sinks)
