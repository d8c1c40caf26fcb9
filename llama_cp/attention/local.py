"""Attention of one process over its local (q, k, v): the whole sequence at cp 1, or the heads
Ulysses and hybrid hold after their all-to-all. Differentiable, through the ``kernels``
backend, in tiles of ``block_size`` (Note [Tiled attention] in ``llama_cp/attention/documents.py``)."""

from __future__ import annotations

import torch

from llama_cp.attention import kernels
from llama_cp.attention.documents import Piece, tiles
from llama_cp.attention.kernels import Backend
from llama_cp.attention.pieces import pieces_attention
from llama_cp.attention.sinks import add_sinks, sink_gradient


def local_attention(q, k, v, *, causal: bool, scale: float, backend: Backend | None, block_size: int,
                    block: list[Piece] | None = None, softcap: float = 0.0, sinks: torch.Tensor | None = None):
    """Attention of one process (cp 1, or Ulysses' local heads): ``block``'s pieces (documents)
    or the whole (q, k, v), in tiles of ``block_size`` (Note [Tiled attention]); ``sinks`` (H,):
    Note [Attention sinks under CP]. Differentiable."""
    if block is None:
        if not block_size or max(q.shape[2], k.shape[2]) <= block_size:
            return _LocalAttention.apply(q, k, v, causal, scale, backend, softcap, sinks)
        block = [Piece(None, slice(0, q.shape[2]), slice(0, k.shape[2]), causal)]
    return pieces_attention(q, k, v, tiles(block, block_size), scale=scale, backend=backend, softcap=softcap,
                            sinks=sinks)


class _LocalAttention(torch.autograd.Function):
    """Attention over the whole (local) sequence with the ``kernels`` backend."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, backend, softcap, sinks):
        out, lse = kernels.attention_forward(q, k, v, causal=causal, scale=scale, backend=backend, softcap=softcap)
        if sinks is not None:  # Note [Attention sinks under CP]
            out, lse = add_sinks(out, lse, sinks)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.causal, ctx.scale, ctx.backend, ctx.softcap = causal, scale, backend, softcap
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        dq, dk, dv = kernels.attention_backward(
            dout, q, k, v, out, lse, causal=ctx.causal, scale=ctx.scale, backend=ctx.backend, softcap=ctx.softcap
        )
        dsinks = sink_gradient(dout, out, lse, sinks) if ctx.needs_input_grad[-1] else None  # frozen: none
        return dq, dk, dv, None, None, None, None, dsinks
