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
runs through ``llama_cp.attention.kernels`` and the pieces of a row are merged by their
log-sum-exp (``kernels.merge_block``), starting from out = 0, lse = -inf. The
backward of a piece takes the final (out, lse) of its rows, as the ring does.
Pieces longer than ``--attention_block_size`` are cut into tiles: Note [Tiled
attention]. On CUDA the pieces of a block go to the kernel together: Note [Varlen
document calls].

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
flash-attn's ``window_size``; on CPU, the exact kernel of ``llama_cp/attention/dense.py``
(Sq x Sk scores, 512 query rows at a time, so tiles bound it). Windowed pieces are not
put into varlen calls: flash-attn's window is one pair of numbers per call, aligned to
each segment's bottom-right corner, and the pieces' bands differ; they take one call
each.

Note [Tiled attention]
======================

A kernel call over Sq queries and Sk keys allocates workspace in proportion to
them: flash-attn's backward a float32 dq_accum [B, round_up(Sq, 128), H, D] and,
with GQA, dK/dV expanded to every query head [B, Sk, H, D]; torch's SDPA ops K/V
expanded to every query head (``kernels._expand_kv``); the math kernel the whole
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
~0.5 GiB for 8B while costing nothing measurable: blocks up to 16384 local
tokens take the untiled path unchanged, the FLOPs are the same (causal kernels
skip the tiles above the diagonal too), and a 16384 x 16384 call is far larger
than the kernels' own 128-row tiles, so only the merges and the fp32 query-block
accumulators are extra, ~1/16384 of the attention's work.

Note [Varlen document calls]
============================

On CUDA a packed row of short documents is hundreds of tiny pieces per block, and
one kernel launch per piece leaves the GPU idle between launches (the chat mix of
docs/benchmarks.md: ~264 documents in a 128K row, 528 calls per layer's forward +
backward at cp 1). flash-attn's and torch's flash kernels have a *varlen* form
(``kernels.varlen_forward`` / ``varlen_backward``, backends ``kernels.VARLEN``): one
call computes n independent segments, query rows ``cu_seqlens_q[i] : [i + 1]`` of a
packed (total_q, H, D) tensor against key rows ``cu_seqlens_k[i] : [i + 1]`` of
(total_k, Hkv, D) ones, each segment its own softmax. A piece is a segment: its
query and key rows are gathered into the packed tensors (copies), and the results
go back to the rows they came from (r0: batch row 0):

    pieces:       (r0, q 0..4, k 0..4, causal)  (r0, q 5..7, k 0..4)  (r0, q 5..7, k 5..7, causal)
    causal call:  q = [q0..4 | q5..7]   k = [k0..4 | k5..7]   cu_seqlens_q = cu_seqlens_k = [0, 5, 8]
    full call:    q = [q5..7]           k = [k0..4]           cu_seqlens_q = [0, 3], cu_seqlens_k = [0, 5]

``varlen_calls`` groups the pieces (tiles) of a block:

- into windows of whole query slices (the pieces of one query slice are
  consecutive): a window's query rows accumulate in float32 and are written when
  the window is done, as one query slice's are in the per-piece path;
- in a window, one kind per call, since ``causal`` is a flag of the whole call:
  the causal pieces (squares, where the top-left and bottom-right masks agree;
  flash-attn aligns a causal mask bottom-right), then the full ones;
- a window holds at most ``block_size`` query rows (the ``--attention_block_size``
  that ``tiles`` cut the block to, carried by its ``Tiles``), a call at most
  ``block_size`` query and key rows, unless one piece alone is longer; 0: no bound.
  The varlen backward's workspace grows with the rows of the call (mha_varlen_bwd:
  dq_accum float32 (total_q + 128 n, H, D rounded to 32), softmax_d float32
  (H, total_q + 128 n), with GQA dK/dV (total_k, H, D)), so the bound keeps Note
  [Tiled attention]'s per-block workspace, plus 128 rows per segment. At 16384 the
  chat row takes 18 calls at cp 1 instead of 528.

Two pieces of one call may share query rows (a query tile against several key
tiles; a ring block's two chunks): their packed rows are separate copies with
their own outputs and lse, merged into the window's accumulator by
``kernels.merge_block`` in *rounds*, the i-th piece of each query slice in round i,
so that no round writes a row twice (an indexed write of repeated rows keeps only
one of them). In backward, dq of repeated rows adds up (``index_add_``), as do
dK/dV of keys that several pieces see (``index_put_`` with ``accumulate``). Each
segment is computed as its per-piece call is, so the two paths agree to rounding
(tests/test_varlen.py: 1e-5 in float32, 1e-10 in float64, through the CPU stand-ins).

The varlen path is taken when the backend has varlen kernels, every piece belongs
to one batch row (documents: a block without them is tiles that fill their calls
already) and it makes fewer calls than pieces (``varlen_windows``); otherwise, and
on CPU (sdpa_cpu, math), one call per piece.

What the glue relies on, read in the libraries' sources:

- torch (2.13; ``aten::_flash_attention_forward`` / ``_flash_attention_backward``
  schemas and meta kernels in torch/_meta_registrations.py; CUDA code in
  aten/src/ATen/native/transformers/cuda/flash_attn/flash_api.cpp, ``mha_varlen_fwd``
  / ``mha_varlen_bwd``): q/k/v (total, heads, D) with the last dimension
  contiguous, ``cum_seq_q`` / ``cum_seq_k`` int32 of n + 1 offsets, ``max_q`` /
  ``max_k`` the longest segments, GQA native (num_heads % num_heads_k == 0, dK/dV
  expanded and summed inside); it returns (output, logsumexp (H, total_q) float32,
  rng_state, unused, debug mask); the backward takes philox seed/offset tensors,
  unread without dropout.
- flash-attn, flash_attn/flash_attn_interface.py and csrc/flash_attn/flash_api.cpp
  at tags v2.6.3, v2.7.4 and v2.8.3: ``_flash_attn_varlen_forward(q, k, v,
  cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
  causal, ...)`` and ``_flash_attn_varlen_backward(dout, q, k, v, out, softmax_lse,
  dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
  softmax_scale, causal, ...)``. 2.6.3 takes ``window_size=(left, right)`` and its
  forward returns (out, q, k, v, out_padded, softmax_lse, S_dmask, rng_state);
  2.7.4 and 2.8.3 (identical here) are torch custom ops taking
  ``window_size_left/right`` and ``zero_tensors``, the forward returning (out,
  softmax_lse, S_dmask, rng_state). ``kernels._call_by_keyword`` passes only the
  names a release takes. softmax_lse is (H, total_q) float32 in all three.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from llama_cp.attention import kernels
from llama_cp.attention.kernels import Backend
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
    to, which also bounds the varlen calls made of them (Note [Varlen document calls])."""

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
    plan = _varlen_plan(block, q, backend)
    if plan is not None:
        return _varlen_forward(q, k, v, plan, scale, backend, out, lse, softcap)
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


def _piece_forward(q, k, v, piece: Piece, scale, backend, softcap=0.0):
    r = piece.rows
    return kernels.attention_forward(
        q[r, :, piece.q], k[r, :, piece.k], v[r, :, piece.k], causal=piece.causal, scale=scale, backend=backend,
        softcap=softcap, lag=_call_lag(piece),
    )


def _call_lag(piece: Piece) -> int | None:
    """The piece's lag in the indices of its own kernel call (query piece.q.start is row 0)."""
    return None if piece.lag is None else piece.lag - piece.q.start + piece.k.start


def pieces_backward(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    lse: torch.Tensor, block: list[Piece], *, scale: float, backend: Backend | None,
    dq: torch.Tensor | None, dk: torch.Tensor, dv: torch.Tensor, softcap: float = 0.0,
) -> torch.Tensor | None:
    """Add the gradients of the pieces of one block to the accumulators dk, dv (and dq when
    given, the ring) in place, given the final (out, lse) of every query row. Without ``dq``,
    returns dq in q's dtype, accumulated in float32 per query slice (Note [Tiled attention])."""
    plan = _varlen_plan(block, q, backend)
    if plan is not None:
        return _varlen_backward(dout, q, k, v, out, lse, plan, scale, backend, dq, dk, dv, softcap)
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
                lag=_call_lag(piece),
            )
            query_dq += grads[0]
            dk[rows, :, ks] += grads[1]
            dv[rows, :, ks] += grads[2]
        if result is not None:
            result[rows, :, qs] = query_dq
    return result


# ---------------------------------------------------------------- varlen calls
# Note [Varlen document calls]: the pieces of a block as a few calls of a varlen kernel.
def varlen_calls(block: list[Piece], block_size: int) -> list[list[list[Piece]]]:
    """``block`` (pieces of one query slice consecutive) as windows of whole query slices, each
    a list of varlen calls (causal calls, then full ones), each a list of pieces; a window's
    query rows, and a call's query and key rows, at most ``block_size`` (0: no bound) unless
    one query slice or piece alone is longer."""
    budget = block_size or float("inf")
    windows, window, rows = [], [], 0
    for _, group in itertools.groupby(block, key=lambda p: p.queries):
        group = list(group)
        length = group[0].q.stop - group[0].q.start
        if window and rows + length > budget:
            windows.append(window)
            window, rows = [], 0
        window += group
        rows += length
    if window:
        windows.append(window)
    result = []
    for window in windows:
        calls = []
        for causal in (True, False):
            call, total_q, total_k = [], 0, 0
            for piece in (p for p in window if p.causal == causal):
                n_q, n_k = piece.q.stop - piece.q.start, piece.k.stop - piece.k.start
                if call and (total_q + n_q > budget or total_k + n_k > budget):
                    calls.append(call)
                    call, total_q, total_k = [], 0, 0
                call.append(piece)
                total_q, total_k = total_q + n_q, total_k + n_k
            if call:
                calls.append(call)
        result.append(calls)
    return result


class _VarlenCall(NamedTuple):
    """One varlen kernel call: where its packed rows come from and where its results go."""

    causal: bool
    q_rows: tuple[torch.Tensor, torch.Tensor]  # (Tq,) batch row and local query of each packed query row
    k_rows: tuple[torch.Tensor, torch.Tensor]  # (Tk,) likewise for the packed keys
    slots: torch.Tensor  # (Tq,) the window accumulator's row of each packed query row
    rounds: list[tuple[torch.Tensor, torch.Tensor]]  # (packed rows, their slots), no slot twice in a round
    cu_seqlens_q: torch.Tensor  # (n + 1,) int32
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int


class _VarlenWindow(NamedTuple):
    rows: tuple[torch.Tensor, torch.Tensor]  # (U,) batch row and local query of each accumulator row
    calls: list[_VarlenCall]


def varlen_windows(block: list[Piece]) -> list[list[list[Piece]]] | None:
    """:func:`varlen_calls` of ``block`` (bounded by the block size :func:`tiles` cut it to), or
    None where a varlen backend still makes one call per piece: pieces of every batch row (a block
    without documents, whose tiles fill their calls already), windowed pieces, or no fewer calls
    than pieces."""
    if any(p.row is None or p.lag is not None for p in block):  # windows: Note [Sliding windows under CP]
        return None
    windows = varlen_calls(block, getattr(block, "block_size", 0))
    return windows if sum(len(calls) for calls in windows) < len(block) else None


def _varlen_plan(block: list[Piece], q: torch.Tensor, backend: Backend | None) -> list[_VarlenWindow] | None:
    """The varlen calls of ``block`` as index tensors on q's device, or None where the per-piece
    calls are taken (a backend without varlen kernel, or :func:`varlen_windows` None)."""
    if not kernels.has_varlen(kernels.resolve_backend(backend, q)):
        return None
    windows = varlen_windows(block)
    if windows is None:
        return None

    def index(values: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(values).to(q.device)

    def rows_of(pieces: list[Piece], part: str) -> tuple[torch.Tensor, torch.Tensor]:
        ranges = [getattr(p, part) for p in pieces]
        return (index([torch.full((r.stop - r.start,), p.row) for p, r in zip(pieces, ranges)]),
                index([torch.arange(r.start, r.stop) for r in ranges]))

    plan = []
    for calls in windows:
        first_slot, groups, rows = {}, [], 0  # each query slice of the window: its first accumulator row
        for piece in itertools.chain.from_iterable(calls):
            if piece.queries not in first_slot:
                first_slot[piece.queries] = rows
                groups.append(piece)
                rows += piece.q.stop - piece.q.start
        made = []
        for call in calls:
            slots, rounds, seen, packed = [], {}, {}, 0
            for piece in call:
                n_q = piece.q.stop - piece.q.start
                piece_slots = torch.arange(first_slot[piece.queries], first_slot[piece.queries] + n_q)
                slots.append(piece_slots)
                turn = seen[piece.queries] = seen.get(piece.queries, -1) + 1  # a query slice's n-th piece here
                rounds.setdefault(turn, []).append((torch.arange(packed, packed + n_q), piece_slots))
                packed += n_q
            lengths_q = [p.q.stop - p.q.start for p in call]
            lengths_k = [p.k.stop - p.k.start for p in call]
            made.append(_VarlenCall(
                call[0].causal, rows_of(call, "q"), rows_of(call, "k"), index(slots),
                [(index([r for r, _ in parts]), index([s for _, s in parts])) for parts in rounds.values()],
                _cumulative(lengths_q, q.device), _cumulative(lengths_k, q.device), max(lengths_q), max(lengths_k),
            ))
        plan.append(_VarlenWindow(rows_of(groups, "q"), made))
    return plan


def _cumulative(lengths: list[int], device) -> torch.Tensor:
    """(n + 1,) int32 offsets of n segments: what the varlen kernels take as cu_seqlens."""
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)


def _varlen_forward(q, k, v, plan: list[_VarlenWindow], scale, backend, out, lse, softcap=0.0):
    """:func:`pieces_forward` as varlen calls: each window's query rows accumulate in float32
    (gathered from ``out``/``lse`` when given, the ring), merged by lse round by round."""
    acc = kernels.accumulation_dtype(q)
    given = out is not None
    if not given:
        out = torch.zeros_like(q)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=acc, device=q.device)
    q_, k_, v_, out_, lse_ = (t.transpose(1, 2) for t in (q, k, v, out, lse))  # (B, S, H, D), lse (B, S, H)
    for window in plan:
        if given:
            window_out, window_lse = out_[window.rows], lse_[window.rows]  # (U, H, D), (U, H)
        else:
            rows = window.rows[0].shape[0]
            window_out = torch.zeros((rows, q.shape[1], q.shape[3]), dtype=acc, device=q.device)
            window_lse = torch.full((rows, q.shape[1]), float("-inf"), dtype=acc, device=q.device)
        for call in window.calls:
            call_out, call_lse = kernels.varlen_forward(
                q_[call.q_rows], k_[call.k_rows], v_[call.k_rows], call.cu_seqlens_q, call.cu_seqlens_k,
                call.max_seqlen_q, call.max_seqlen_k, causal=call.causal, scale=scale, backend=backend,
                softcap=softcap,
            )
            call_lse = call_lse.t()  # (Tq, H)
            for packed, slots in call.rounds:
                slot_out, slot_lse = window_out[slots], window_lse[slots]
                kernels.merge_block(slot_out, slot_lse, call_out[packed], call_lse[packed])
                window_out[slots], window_lse[slots] = slot_out, slot_lse
        out_[window.rows] = window_out.to(out.dtype)
        lse_[window.rows] = window_lse
    return out, lse


def _varlen_backward(dout, q, k, v, out, lse, plan: list[_VarlenWindow], scale, backend, dq, dk, dv, softcap=0.0):
    """:func:`pieces_backward` as varlen calls: dq summed per window in float32 (or straight into
    ``dq`` when given, the ring), dk/dv into their accumulators; repeated rows add up."""
    acc = kernels.accumulation_dtype(q)
    result = None if dq is not None else torch.zeros_like(q)
    dout_, q_, k_, v_, out_, lse_, dk_, dv_ = (t.transpose(1, 2) for t in (dout, q, k, v, out, lse, dk, dv))
    for window in plan:
        if result is not None:
            window_dq = torch.zeros((window.rows[0].shape[0], q.shape[1], q.shape[3]), dtype=acc, device=q.device)
        for call in window.calls:
            call_dq, call_dk, call_dv = kernels.varlen_backward(
                dout_[call.q_rows], q_[call.q_rows], k_[call.k_rows], v_[call.k_rows], out_[call.q_rows],
                lse_[call.q_rows].t(), call.cu_seqlens_q, call.cu_seqlens_k, call.max_seqlen_q,
                call.max_seqlen_k, causal=call.causal, scale=scale, backend=backend, softcap=softcap,
            )
            if result is not None:
                window_dq.index_add_(0, call.slots, call_dq.to(acc))
            else:
                dq.transpose(1, 2).index_put_(call.q_rows, call_dq.to(dq.dtype), accumulate=True)
            dk_.index_put_(call.k_rows, call_dk.to(dk.dtype), accumulate=True)
            dv_.index_put_(call.k_rows, call_dv.to(dv.dtype), accumulate=True)
        if result is not None:
            result.transpose(1, 2)[window.rows] = window_dq.to(q.dtype)
    return result


@dataclass
class DocumentLayout:
    """The documents of one (cp-sharded) batch, made once per model call by
    ``cp_attention`` and handed to every attention layer.

    starts: (B, L) document start of every token of the whole row (global rows);
    cp_rank / cp_size: where this rank's zigzag chunks are. The all-gather strategy, whose
    ranks may hold any tokens, gives ``local_rows`` (S,), the rows of this rank's tokens in
    local order, and ``gathered_rows`` (cp x S,), the rows of every rank's tokens, rank after
    rank (the order of an all-gather). ``single``: every row is one document, a layout made
    only for the windowed layers (Note [Sliding windows under CP]).
    """

    starts: torch.Tensor
    cp_rank: int = 0
    cp_size: int = 1
    local_rows: torch.Tensor | None = None
    gathered_rows: torch.Tensor | None = None
    single: bool = False
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
            self._cache[key] = pieces(self.local_spans(), self.zigzag_chunks(source_rank), window)
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
            self._cache[key] = pieces(self.local_spans(), [Chunk(0, 0, self.seq_len)], window)
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
            self._cache[key] = pieces(spans(self.starts, torch.arange(seq)), [Chunk(0, 0, seq)], window)
        return self._cache[key]

    def visible_pairs(self) -> torch.Tensor:
        """(cp,) number of (query, key) pairs each cp rank's queries see: its attention work."""
        per_token = visible_pairs_per_token(self.starts.cpu())
        return torch.stack([
            sum(per_token[c.first : c.first + c.length].sum() for c in self.zigzag_chunks(r))
            for r in range(self.cp_size)
        ])


class _PiecesAttention(torch.autograd.Function):
    """Attention of one process (cp 1, or Ulysses over the gathered row) over the pieces of a
    block: packed documents, tiles (Note [Tiled attention]), or both."""

    @staticmethod
    def forward(ctx, q, k, v, block, scale, backend, softcap):
        out, lse = pieces_forward(q, k, v, block, scale=scale, backend=backend, softcap=softcap)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.block, ctx.scale, ctx.backend, ctx.softcap = block, scale, backend, softcap
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        acc = kernels.accumulation_dtype(q)
        dk, dv = (torch.zeros_like(t, dtype=acc) for t in (k, v))  # every query block adds to every key
        dq = pieces_backward(
            dout, q, k, v, out, lse, ctx.block, scale=ctx.scale, backend=ctx.backend, dq=None, dk=dk, dv=dv,
            softcap=ctx.softcap,
        )
        return dq, dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def pieces_attention(q, k, v, block: list[Piece], *, scale: float, backend: Backend | None = None,
                     softcap: float = 0.0):
    """Differentiable attention of (q, k, v) restricted to ``block``'s pieces (one query slice's
    pieces consecutive, as :func:`pieces` and :func:`tiles` make them)."""
    return _PiecesAttention.apply(q, k, v, block, scale, backend, softcap)
