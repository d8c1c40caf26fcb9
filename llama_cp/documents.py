"""Packed documents: which keys each query may see, and attention over exactly those pairs.

Note [Document masks under CP]
==============================

A packed row holds several documents; a token may attend only to the earlier
tokens of its own document. Documents are told apart by ``position_ids`` with
transformers' rule (``masking_utils.find_packed_sequence_indices``): a new
document starts wherever ``position_ids[t] != position_ids[t - 1] + 1``, so a
row that begins inside a document, or padding that continues the last
document's positions, adds no boundary. Written as the row index of each
token's document start, ``start[t]``, query t sees exactly the keys s with

    start[t] <= s <= t                      (global row indices)

Nothing of size [L, L] is ever built. A rank's queries are cut into *spans*:
runs of tokens that are consecutive in the row and share one document. A block
of keys is a list of *chunks*, runs consecutive in the row (the zigzag chunks of
a ring step, or the whole row for Ulysses). A span [a, a + n) with document
start d meets a chunk [c, c + m) in at most two pieces of ordinary attention:

    keys  [max(d, c), min(a, c + m))  every query of the span sees all of them
    keys  [a, a + n)                  causal square, when the chunk holds the span

    row:      c ........................ c+m
    doc d:       d ----------------------------->
    span:                    a ====== a+n
    pieces:      [  full     )[ causal ]

Keys after the span or before its document are never computed, so a block that
no local query can see costs nothing but its transfer, and packed rows of short
documents do far less work than one document of the same length. Each piece
runs through ``llama_cp.kernels`` and the pieces of a row are merged by their
log-sum-exp (``kernels.merge_block``), starting from out = 0, lse = -inf. The
backward of a piece takes the final (out, lse) of its rows, as the ring does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from llama_cp import kernels
from llama_cp.kernels import Backend


class Span(NamedTuple):
    """Queries ``local[start : start + length]``, global rows ``first ...``, document start ``doc_start``."""

    start: int
    first: int
    length: int
    doc_start: int


class Chunk(NamedTuple):
    """Keys ``local[start : start + length]`` of a block, global rows ``first ... first + length - 1``."""

    start: int
    first: int
    length: int


class Piece(NamedTuple):
    """One call of the local kernel: queries ``q`` x keys ``k`` (local slices) of batch row ``row``."""

    row: int
    q: slice
    k: slice
    causal: bool


def document_starts(position_ids: torch.Tensor) -> torch.Tensor:
    """(B, L) position_ids -> (B, L): the row index where each token's document starts
    (Note [Document masks under CP])."""
    seq_len = position_ids.shape[-1]
    index = torch.arange(seq_len, device=position_ids.device).expand_as(position_ids)
    new = torch.ones_like(position_ids, dtype=torch.bool)
    new[..., 1:] = position_ids[..., 1:] != position_ids[..., :-1] + 1
    return torch.where(new, index, torch.zeros_like(index)).cummax(dim=-1).values


def spans(starts: torch.Tensor, rows: torch.Tensor) -> list[list[Span]]:
    """Cut queries into spans, per batch row.

    starts: (B, S) document start of each local token; rows: (S,) their global row
    indices. A span ends where the document or the run of consecutive rows ends.
    """
    starts, rows = starts.cpu(), rows.cpu()
    seq = rows.shape[0]
    cut = torch.ones(starts.shape, dtype=torch.bool)
    cut[:, 1:] = (starts[:, 1:] != starts[:, :-1]) | (rows[1:] != rows[:-1] + 1)
    result = []
    for row_starts, row_cut in zip(starts.tolist(), cut.tolist()):
        begins = [t for t, c in enumerate(row_cut) if c] + [seq]
        result.append([
            Span(b, int(rows[b]), e - b, row_starts[b]) for b, e in zip(begins[:-1], begins[1:])
        ])
    return result


def pieces(query_spans: list[list[Span]], chunks: list[Chunk]) -> list[Piece]:
    """The kernel calls that cover every visible (query, key) pair of a block and nothing else."""
    result = []
    for row, row_spans in enumerate(query_spans):
        for span in row_spans:
            for chunk in chunks:
                lo, hi = max(span.doc_start, chunk.first), min(span.first, chunk.first + chunk.length)
                if lo < hi:  # keys before the span, in its document: all visible
                    k = slice(chunk.start + lo - chunk.first, chunk.start + hi - chunk.first)
                    result.append(Piece(row, slice(span.start, span.start + span.length), k, False))
                if chunk.first <= span.first < chunk.first + chunk.length:  # the span's own keys
                    k0 = chunk.start + span.first - chunk.first
                    result.append(Piece(row, slice(span.start, span.start + span.length),
                                        slice(k0, k0 + span.length), True))
    return result


def pieces_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: list[Piece], *, scale: float,
    backend: Backend | None, out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of the pieces of one block, merged into the running (out, lse) in place.

    q: (B, H, Sq, D), k/v: (B, Hkv, Sk, D). ``out`` (accumulation dtype) and ``lse``
    start as zeros and -inf when not given; rows that see nothing keep them.
    """
    if out is None:
        out = torch.zeros_like(q, dtype=kernels.accumulation_dtype(q))
        lse = torch.full(q.shape[:3], float("-inf"), dtype=out.dtype, device=q.device)
    for piece in block:
        r = slice(piece.row, piece.row + 1)
        block_out, block_lse = kernels.attention_forward(
            q[r, :, piece.q], k[r, :, piece.k], v[r, :, piece.k], causal=piece.causal, scale=scale, backend=backend
        )
        kernels.merge_block(out[r, :, piece.q], lse[r, :, piece.q], block_out, block_lse)
    return out, lse


def pieces_backward(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    lse: torch.Tensor, block: list[Piece], *, scale: float, backend: Backend | None,
    dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor,
) -> None:
    """Add the gradients of the pieces of one block to the accumulators dq, dk, dv in place,
    given the final (out, lse) of every query row."""
    for piece in block:
        r, qs, ks = slice(piece.row, piece.row + 1), piece.q, piece.k
        grads = kernels.attention_backward(
            dout[r, :, qs], q[r, :, qs], k[r, :, ks], v[r, :, ks], out[r, :, qs], lse[r, :, qs],
            causal=piece.causal, scale=scale, backend=backend,
        )
        dq[r, :, qs] += grads[0]
        dk[r, :, ks] += grads[1]
        dv[r, :, ks] += grads[2]


@dataclass
class DocumentLayout:
    """The documents of one (cp-sharded) batch, made once per model call by
    ``cp_attention`` and handed to every attention layer.

    starts: (B, L) document start of every token of the whole row (global rows);
    cp_rank / cp_size: where this rank's zigzag chunks are.
    """

    starts: torch.Tensor
    cp_rank: int = 0
    cp_size: int = 1
    _cache: dict = field(default_factory=dict, repr=False)

    @property
    def seq_len(self) -> int:
        return self.starts.shape[-1]

    def zigzag_chunks(self, rank: int) -> list[Chunk]:
        """The two zigzag chunks of cp rank ``rank`` as a key block (one chunk when cp == 1)."""
        if self.cp_size == 1:
            return [Chunk(0, 0, self.seq_len)]
        size = self.seq_len // (2 * self.cp_size)
        return [Chunk(0, rank * size, size), Chunk(size, (2 * self.cp_size - 1 - rank) * size, size)]

    def local_spans(self) -> list[list[Span]]:
        """Spans of this rank's queries, in local (zigzag) order."""
        if "local" not in self._cache:
            rows = torch.cat([
                torch.arange(c.first, c.first + c.length) for c in self.zigzag_chunks(self.cp_rank)
            ])
            self._cache["local"] = spans(self.starts.cpu().index_select(1, rows), rows)
        return self._cache["local"]

    def ring_pieces(self, source_rank: int) -> list[Piece]:
        """Pieces of this rank's queries against the K/V block of cp rank ``source_rank``."""
        key = ("ring", source_rank)
        if key not in self._cache:
            self._cache[key] = pieces(self.local_spans(), self.zigzag_chunks(source_rank))
        return self._cache[key]

    def full_row_pieces(self) -> list[Piece]:
        """Pieces of the whole row in natural order against itself (Ulysses): one causal
        square per document of each row."""
        if "full" not in self._cache:
            seq = self.seq_len
            self._cache["full"] = pieces(spans(self.starts, torch.arange(seq)), [Chunk(0, 0, seq)])
        return self._cache["full"]

    def visible_pairs(self) -> torch.Tensor:
        """(cp,) number of (query, key) pairs each cp rank's queries see: its attention work."""
        rows = torch.arange(self.seq_len)
        per_token = (rows - self.starts.cpu() + 1).sum(0)  # (L,) summed over the batch
        return torch.stack([
            sum(per_token[c.first : c.first + c.length].sum() for c in self.zigzag_chunks(r))
            for r in range(self.cp_size)
        ])


class _DocumentAttention(torch.autograd.Function):
    """Attention of one process (cp 1, or Ulysses over the gathered row) restricted to documents."""

    @staticmethod
    def forward(ctx, q, k, v, block, scale, backend):
        out, lse = pieces_forward(q, k, v, block, scale=scale, backend=backend)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.block, ctx.scale, ctx.backend = block, scale, backend
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        acc = kernels.accumulation_dtype(q)
        dq, dk, dv = (torch.zeros_like(t, dtype=acc) for t in (q, k, v))
        pieces_backward(dout, q, k, v, out, lse, ctx.block, scale=ctx.scale, backend=ctx.backend, dq=dq, dk=dk, dv=dv)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def document_attention(q, k, v, block: list[Piece], *, scale: float, backend: Backend | None = None):
    """Differentiable attention of (q, k, v) restricted to ``block``'s pieces."""
    return _DocumentAttention.apply(q, k, v, block, scale, backend)
