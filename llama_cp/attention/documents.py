"""Packed documents under CP: which keys each query may see. A rank's queries are cut into
spans, a block of keys into chunks, and where they meet into pieces, cut further into tiles and
to sliding windows; ``DocumentLayout`` holds the documents of one batch and hands each strategy
its pieces. Attention over exactly those pieces is ``llama_cp/attention/pieces.py``.

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
runs through ``llama_cp.attention.kernels`` (``llama_cp/attention/pieces.py``) and the
pieces of a row are merged by their log-sum-exp (``kernels.merge_block``), starting from
out = 0, lse = -inf. The backward of a piece takes the final (out, lse) of its rows, as
the ring does. Pieces longer than ``--attention_block_size`` are cut into tiles: Note
[Tiled attention]. On CUDA the pieces of a block go to the kernel together: Note [Varlen
document calls] in ``llama_cp/attention/varlen.py``.

Note [Sliding windows under CP]
===============================

A sliding window of w tokens (Mistral's ``sliding_window``, Qwen2's with
``use_sliding_window``, the "sliding_attention" layers of Gemma 2 and 3) lets query t
see key s only when t - s < w (transformers' ``sliding_window_overlay``: kv_idx >
q_idx - w), on top of the document mask:

    max(start[t], t - w + 1) <= s <= t      (global row indices)

A piece is made of consecutive query rows and consecutive key rows, so within it the
window is one band, written in the piece's local indices as ``Piece.lag``: key j is
hidden from query i when i - j > lag (lag = w - 1 - (first query row - first key row),
shifted by where the slices sit in the local tensors). ``pieces`` cuts each piece's
keys to those its queries can reach (from the span's first row - w + 1), so a block
entirely outside the window has no piece: it costs nothing, and the ring does not send
it (Note [Ring transfers]); ``tiles`` drops the tiles the band misses and clears the lag
of those it does not cut. A row with one document and a window is a layout like any
other (every token's start 0), so the ring, Ulysses, all-gather and hybrid run windows
through their document paths. A model with windowed and full layers (Gemma 2 and 3
``layer_types``) passes each layer's window with its call (``sliding_window``), and each
layer gets the pieces of its own window from the one layout of the batch.

The kernels take the lag of a call (``kernels.attention_forward(lag=)``); rows that see
no key of a call get out = 0, lse = -inf, as document masks already have. On CUDA,
flash-attn's ``window_size``, or torch's flash kernel's (Note [Windows on torch's flash
kernel] in ``llama_cp/attention/kernel_calls.py``); on CPU, the exact kernel of ``llama_cp/attention/dense.py``
(Sq x Sk scores, 512 query rows at a time, so tiles bound it). On CUDA the windowed
pieces of packed documents also go into varlen calls, one window a call (Note [Varlen
document calls] in ``llama_cp/attention/varlen.py``).

Note [Tiled attention]
======================

A kernel call over Sq queries and Sk keys allocates workspace in proportion to
them: flash-attn's backward a float32 dq_accum [B, round_up(Sq, 128), H, D] and,
with GQA, dK/dV expanded to every query head [B, Sk, H, D]; torch's SDPA ops K/V
expanded to every query head (``kernel_calls.expand_kv``); the math kernel the whole
(Sq, Sk) score matrix. At cp 1 a call covers the whole sequence, so for
Llama-3-8B (32 heads of 128, 8 KV heads) at 512K tokens that is 8 GiB of
dq_accum and 8 GiB of expanded dK/dV. ``tiles`` cuts every piece (a whole
block is one piece) into kernel calls of at most ``block_size`` queries x
``block_size`` keys: a full piece into a grid, a causal square into causal
squares on its diagonal and full tiles below it, the tiles above skipped
(block_size 3, a causal square of 8 queries x 8 keys; c: causal tile, f: full
tile):

    keys:    0..2  3..5  6..7
    q 0..2   [ c ]
    q 3..5   [ f ] [ c ]
    q 6..7   [ f ] [ f ] [c]

The tiles are queries-outer: all tiles of one query block follow each other.
Per block (the kernel's workspace, and the fp32 accumulators of one query
block): at 16384 tokens for 8B, dq_accum 16384 x 32 x 128 x 4 B = 256 MiB and
the expanded dK/dV 2 x 16384 x 32 x 128 x 2 B = 256 MiB. Per sequence, as
without tiles: q, k, v, out (input dtype) and lse, which attention saves for
backward anyway, and the dK/dV sums in float32 at the KV head count (4 GiB at
512K for 8B, half the expanded bf16 ones): every query block adds to every
key, so they cannot be finished block by block. The output and dQ of a query
block are accumulated in float32 over its tiles and written in the input dtype
when the block is done, so the fp32 output of the whole sequence (8 GiB at 512K)
never exists; in the ring, tiles merge straight into the ring's own fp32
accumulators, which span the local shard anyway (Note [Zigzag ring attention]).
Exact: the tiles' results merge by log-sum-exp as the pieces do, and each
tile's backward takes the final (out, lse) of its rows.

The default block, 16384 (``--attention_block_size``), bounds that workspace at
~0.5 GiB for 8B: blocks up to 16384 local tokens take the untiled path unchanged,
the FLOPs are the same (causal kernels skip the tiles above the diagonal too), and
a 16384 x 16384 call is far larger than the kernels' own 128-row tiles, so only the
merges and the fp32 accumulators are extra. Measured on an H200 (torch 2.11,
sdpa_flash; a 4-layer Llama-3-8B, LoRA, checkpointing, 65536 tokens at cp 1; docs/benchmarks.md, One GPU,
measured): 3.30 s a step tiled against 3.14 s untiled (10 kernel calls a layer and pass
against 1), at the same peak (23.44 GB; planned 23.38 for both).
``--memory auto`` (the default on CUDA) turns the tiles off unless a run needs them.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from llama_cp.modules.tiling import planning
from llama_cp.parallel.sharding import visible_pairs_per_token


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
    """One call of the local kernel: queries ``q`` x keys ``k`` (local slices) of batch row ``row``
    (None: every row); ``lag``: a sliding window, key j hidden from query i (local indices) when
    i - j > lag (Note [Sliding windows under CP])."""

    row: int | None
    q: slice
    k: slice
    causal: bool
    lag: int | None = None

    @property
    def rows(self) -> slice:
        return slice(None) if self.row is None else slice(self.row, self.row + 1)

    @property
    def queries(self) -> tuple[int | None, int, int]:
        """Which queries the piece computes, as a key for grouping: (row, first, end)."""
        return self.row, self.q.start, self.q.stop

    @property
    def call_lag(self) -> int | None:
        """The lag in the indices of the piece's own kernel call (query ``q.start`` is row 0)."""
        return None if self.lag is None else self.lag - self.q.start + self.k.start


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


def pieces(query_spans: list[list[Span]], chunks: list[Chunk], window: int | None = None) -> list[Piece]:
    """The kernel calls that cover every visible (query, key) pair of a block and nothing else;
    ``window``: a sliding window of that many tokens (Note [Sliding windows under CP])."""
    result = []
    for row, row_spans in enumerate(query_spans):
        for span in row_spans:
            last = span.first + span.length - 1  # the span's last query row
            for chunk in chunks:
                lo, hi = max(span.doc_start, chunk.first), min(span.first, chunk.first + chunk.length)
                lag = None
                if window is not None:
                    lo = max(lo, span.first - window + 1)  # older keys are out of every query's window
                    lag = window - 1 - (span.first - span.start) + (chunk.first - chunk.start)  # row - key row < window
                if lo < hi:  # keys before the span, in its document (and window)
                    k = slice(chunk.start + lo - chunk.first, chunk.start + hi - chunk.first)
                    cut = window is not None and last - lo >= window  # the last query misses the first key
                    result.append(Piece(row, slice(span.start, span.start + span.length), k, False,
                                        lag if cut else None))
                if chunk.first <= span.first < chunk.first + chunk.length:  # the span's own keys
                    k0 = chunk.start + span.first - chunk.first
                    cut = window is not None and span.length > window
                    result.append(Piece(row, slice(span.start, span.start + span.length),
                                        slice(k0, k0 + span.length), True, lag if cut else None))
    return result


class Tiles(list):
    """The pieces of one block as :func:`tiles` cuts them, with the ``block_size`` they were cut
    to, which also bounds the varlen calls made of them (Note [Varlen document calls] in
    ``llama_cp/attention/varlen.py``)."""

    def __init__(self, pieces=(), block_size: int = 0):
        super().__init__(pieces)
        self.block_size = block_size


def tiles(block: list[Piece], block_size: int) -> Tiles:
    """``block`` cut into kernel calls of at most ``block_size`` queries x ``block_size`` keys,
    queries-outer (Note [Tiled attention]); ``block``'s pieces unchanged when none is longer (or 0).
    Windowed pieces (``lag``) lose the tiles their band misses, and the lag of the tiles it
    does not cut (Note [Sliding windows under CP])."""
    if not block_size or all(max(p.q.stop - p.q.start, p.k.stop - p.k.start) <= block_size for p in block):
        return Tiles(block, block_size)
    result = []

    def add(row, q: slice, k: slice, causal: bool, lag: int | None) -> None:
        if lag is not None:
            if q.start - (k.stop - 1) > lag:  # even the first query misses the last key
                return
            if q.stop - 1 - k.start <= lag:  # the last query sees the first key: nothing cut
                lag = None
        result.append(Piece(row, q, k, causal, lag))

    # pieces of one query slice (a span's full and causal pieces) are consecutive: tile them together
    for (row, q_start, q_stop), group in itertools.groupby(block, key=lambda p: p.queries):
        group = list(group)
        for q0 in range(q_start, q_stop, block_size):
            q = slice(q0, min(q0 + block_size, q_stop))
            for piece in group:
                if not piece.causal:
                    for k0 in range(piece.k.start, piece.k.stop, block_size):
                        add(row, q, slice(k0, min(k0 + block_size, piece.k.stop)), False, piece.lag)
                    continue
                shift = piece.k.start - q_start  # a causal piece is square: key q_start + i is query i's own
                for k0 in range(piece.k.start, q0 + shift, block_size):
                    add(row, q, slice(k0, k0 + block_size), False, piece.lag)
                add(row, q, slice(q.start + shift, q.stop + shift), True, piece.lag)
    return Tiles(result, block_size)


def planned_tiles(block: list[Piece], q: torch.Tensor) -> list[Piece]:
    """``block`` itself on real tensors; under fake tensors (the memory planner), one tile of
    each shape per query slice and one query slice of each kind (Note [Planning tiles])."""
    if not planning(q):
        return block
    kept, kinds = [], set()
    for (_, q_start, q_stop), group in itertools.groupby(block, key=lambda p: p.queries):
        shapes = {}
        for piece in group:  # first of each shape, in order
            shapes.setdefault((piece.k.stop - piece.k.start, piece.causal), piece)
        kind = (q_stop - q_start, tuple(shapes))
        if kind not in kinds:
            kinds.add(kind)
            kept += shapes.values()
    return kept



@dataclass
class DocumentLayout:
    """The documents of one (cp-sharded) batch, made once per model call by
    ``cp_attention`` and handed to every attention layer.

    starts: (B, L) document start of every token of the whole row (global rows);
    cp_rank / cp_size: where this rank's zigzag chunks are. The all-gather strategy, whose
    ranks may hold any tokens, gives ``local_rows`` (S,), the rows of this rank's tokens in
    local order, and ``gathered_rows`` (cp x S,), the rows of every rank's tokens, rank after
    rank (the order of an all-gather). ``single``: every row is the same one document (the
    layout made for windowed layers, Note [Sliding windows under CP], and the all-gather's of a
    batch without documents): its pieces are every row's, one kernel call for all rows.
    ``positions`` (B, L): the call's global position_ids, which Llama 4's chunks may count (Note
    [Chunked attention under CP] in ``llama_cp/attention/chunks.py``).
    """

    starts: torch.Tensor
    cp_rank: int = 0
    cp_size: int = 1
    local_rows: torch.Tensor | None = None
    gathered_rows: torch.Tensor | None = None
    single: bool = False
    positions: torch.Tensor | None = None
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
        """Spans of this rank's queries, in local order (zigzag, or ``local_rows``)."""
        if self.local_rows is None:
            return self.rank_spans(self.cp_rank)
        if "local" not in self._cache:
            rows = self.local_rows.cpu()
            self._cache["local"] = spans(self.starts.cpu().index_select(1, rows), rows)
        return self._cache["local"]

    def rank_spans(self, rank: int) -> list[list[Span]]:
        """Spans of the queries of cp rank ``rank``'s zigzag chunks, in local order."""
        key = ("spans", rank)
        if key not in self._cache:
            rows = torch.cat([torch.arange(c.first, c.first + c.length) for c in self.zigzag_chunks(rank)])
            self._cache[key] = spans(self.starts.cpu().index_select(1, rows), rows)
        return self._cache[key]

    # ``window`` below: a sliding window of that many tokens, None for none (Note [Sliding
    # windows under CP]); a model may mix windowed and full layers, each asks with its own.
    def ring_pieces(self, source_rank: int, window: int | None = None) -> list[Piece]:
        """Pieces of this rank's queries against the K/V block of cp rank ``source_rank``."""
        key = ("ring", source_rank, window)
        if key not in self._cache:
            self._cache[key] = self._pieces(self.local_spans(), self.zigzag_chunks(source_rank), window)
        return self._cache[key]

    def sees(self, receiver: int, source: int, window: int | None = None) -> bool:
        """Whether a query of cp rank ``receiver`` (zigzag chunks, any batch row) sees a key of
        rank ``source``'s: the ring sends only such blocks (Note [Ring transfers])."""
        key = ("sees", receiver, source, window)
        if key not in self._cache:
            self._cache[key] = bool(pieces(self.rank_spans(receiver), self.zigzag_chunks(source), window))
        return self._cache[key]

    def ring_dense(self, window: int | None = None) -> bool:
        """Whether every rank sees every other rank's block: the ring then skips nothing."""
        key = ("dense", window)
        if key not in self._cache:
            ranks = range(self.cp_size)
            self._cache[key] = all(self.sees(r, s, window) for r in ranks for s in ranks)
        return self._cache[key]

    def gathered_pieces(self, window: int | None = None) -> list[Piece]:
        """Pieces of this rank's queries against the whole row in row order (the all-gather)."""
        key = ("gathered", window)
        if key not in self._cache:
            self._cache[key] = self._pieces(self.local_spans(), [Chunk(0, 0, self.seq_len)], window)
        return self._cache[key]

    def row_order(self, device: torch.device, inverse: bool = False) -> torch.Tensor:
        """(L,) index into the all-gathered tokens of the token of each row: gathered[row_order]
        is the row in order (the inverse permutation of ``gathered_rows``); ``inverse``:
        ``gathered_rows`` itself, row[gathered_rows] is the all-gather order. On ``device``."""
        key = ("order", inverse, str(device))
        if key not in self._cache:
            self._cache[key] = (self.gathered_rows if inverse else self.gathered_rows.argsort()).to(device)
        return self._cache[key]

    def full_row_pieces(self, window: int | None = None) -> list[Piece]:
        """Pieces of the whole row in natural order against itself (Ulysses): one causal
        square per document of each row (with a window, the band of each)."""
        key = ("full", window)
        if key not in self._cache:
            seq = self.seq_len
            self._cache[key] = self._pieces(spans(self.starts, torch.arange(seq)), [Chunk(0, 0, seq)], window)
        return self._cache[key]

    def _pieces(self, query_spans: list[list[Span]], chunks: list[Chunk], window: int | None) -> list[Piece]:
        """:func:`pieces`; of a ``single`` layout (every row the same one document), batch row 0's as
        pieces of every row (``Piece.row`` None): one kernel call for all rows, as without a window,
        and not gathered into varlen calls (Note [Varlen document calls])."""
        if self.single:
            return [piece._replace(row=None) for piece in pieces(query_spans[:1], chunks, window)]
        return pieces(query_spans, chunks, window)

    def visible_pairs(self) -> torch.Tensor:
        """(cp,) number of (query, key) pairs each cp rank's queries see: its attention work."""
        per_token = visible_pairs_per_token(self.starts.cpu())
        return torch.stack([
            sum(per_token[c.first : c.first + c.length].sum() for c in self.zigzag_chunks(r))
            for r in range(self.cp_size)
        ])
