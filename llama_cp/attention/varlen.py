"""The pieces of a block as a few calls of a varlen kernel (CUDA): which segments each call holds
(``varlen_calls``), their index tensors (``varlen_plan``) and the calls' forward and backward, which
``llama_cp/attention/pieces.py`` takes instead of one kernel call per piece where they make fewer.

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
  ``block_size`` query and key rows, unless one piece alone is longer; 0 (untiled):
  ``UNTILED_ROWS``. A window's rows are gathered: copies of its q, k, v (and out, dout
  in backward) and its float32 accumulators, which one call per piece does not make.
  Under fake tensors, one forward + backward over 65536 tokens of 126 documents
  (Llama-3-8B's heads, flash-attn's stand-in) peaked at 8.53 GiB gathered whole, 4.31
  GiB in windows of 16384 rows, 3.35 GiB a call per piece; one document, as the memory
  planner plans a row, 8.27 GiB (``python benchmarks/document_mask.py gathers``).
  The varlen backward's workspace grows with the rows of the call (mha_varlen_bwd:
  dq_accum float32 (total_q + 128 n, H, D rounded to 32), softmax_d float32
  (H, total_q + 128 n), with GQA dK/dV (total_k, H, D)), so the bound keeps the
  per-block workspace of Note [Tiled attention] (in ``llama_cp/attention/documents.py``),
  plus 128 rows per segment. At 16384 the chat row takes 18 calls at cp 1 instead of 528.

Two pieces of one call may share query rows (a query tile against several key
tiles; a ring block's two chunks): their packed rows are separate copies with
their own outputs and lse, merged into the window's accumulator by
``kernels.merge_block`` in *rounds*, the i-th piece of each query slice in round i,
so that no round writes a row twice (an indexed write of repeated rows keeps only
one of them). In backward, dq of repeated rows adds up (``index_add_``), as do
dK/dV of keys that several pieces see (``index_put_`` with ``accumulate``). Each
segment is computed as its per-piece call is, so the two paths agree to rounding
(tests/attention/test_varlen.py: 1e-5 in float32, 1e-10 in float64, through the CPU stand-ins).

Sliding windows (Note [Sliding windows under CP] in ``llama_cp/attention/documents.py``): a
varlen call takes one window, flash's (window_size_left, window_size_right), aligned to
each segment's own bottom-right corner: query i of a segment of sq queries and sk keys
sees key j iff i + sk - sq - left <= j <= i + sk - sq + right. So a call holds the
segments of one window (``varlen_calls``, a ``Segment`` each):

- a windowed causal square (a document longer than the window) is one segment with
  (left, right) = (w - 1, 0) for a w-token window, the same for every document of a
  layer, and the unwindowed squares of that block (documents of at most w tokens, which
  the window hides nothing of: left >= their length - 1) join their call;
- a windowed full piece is cut as the per-piece path cuts it (``windows.flash_segments``,
  from ``windows.window_parts``): the rows that see every key, without a window; the rows
  that see a suffix of the keys, with (keys - queries of the part, -1), which joins the
  parts of other pieces with the same difference; the rows that see nothing are left out.

No windowed segment has a row that sees no key (flash writes lse = +inf for one) or more
queries than keys (a right side of -1 becomes max_seqlen_k, which would then cut keys on
the right: flash-attn issue #895). Rows without documents (the layout windowed layers get
for them; the all-gather's of such a batch) are not gathered: their pieces are every row's,
one call for all rows (``DocumentLayout.single``). Read, for this: Dao-AILab/flash-attention v2.6.3 and
v2.8.3, csrc/flash_attn/flash_api.cpp ``mha_varlen_fwd`` / ``mha_varlen_bwd`` (causal sets
right to 0; a side >= max_seqlen_k becomes -1; ``set_params_fprop`` turns a remaining -1
into max_seqlen_k), src/block_info.h (each segment's actual lengths from cu_seqlens) and
src/mask.h (the bounds above), the local kernels built unless FLASHATTENTION_DISABLE_LOCAL;
torch's copy of mha_varlen_fwd/bwd (flash_api.cpp at pytorch 03b7c19d, the same rules), the
schemas of ``_flash_attention_forward`` / ``_backward`` at torch 2.10 and 2.13 (window
sides ``SymInt?``, None read as -1 and passed to mha_varlen_fwd/bwd), and torch 2.13's
torch/nn/attention/varlen.py, whose windowed ``varlen_attn`` calls the same two ops. The
stand-ins read the window so (``workspace._varlen_bounds``).

The varlen path is taken when the backend has varlen kernels, every piece belongs
to one batch row (documents: a block without them is tiles that fill their calls
already) and it makes fewer calls than the per-piece path (``varlen_windows``: a
windowed piece is a call per part there); otherwise, and on CPU (sdpa_cpu, math),
one call per piece.

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
  softmax_lse, S_dmask, rng_state). ``kernel_calls.call_by_keyword`` passes only the
  names a release takes. softmax_lse is (H, total_q) float32 in all three.
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

import torch

from llama_cp.attention import kernels
from llama_cp.attention.documents import Piece
from llama_cp.attention.kernels import Backend
from llama_cp.attention.windows import NO_WINDOW, flash_segments


#: The most query rows of a window, and query or key rows of a call, in an untiled block (block size 0).
UNTILED_ROWS = 16384


class Segment(NamedTuple):
    """One segment of a varlen call: queries ``q`` x keys ``k`` (local slices, inside ``piece``'s:
    a windowed piece is cut into :func:`windows.flash_segments`) of ``piece``'s batch row, with
    flash's ``window`` (left, right), ``windows.NO_WINDOW`` for none."""

    piece: Piece
    q: slice
    k: slice
    window: tuple[int, int]

    @property
    def causal(self) -> bool:
        return self.piece.causal

    @property
    def row(self) -> int | None:
        return self.piece.row


def segments(piece: Piece) -> list[Segment]:
    """``piece`` as the segments of varlen calls: itself, or the parts its window cuts it into."""
    n_q, n_k = piece.q.stop - piece.q.start, piece.k.stop - piece.k.start
    return [Segment(piece, slice(piece.q.start + rows.start, piece.q.start + rows.stop),
                    slice(piece.k.start + keys.start, piece.k.start + keys.stop), window)
            for rows, keys, window in flash_segments(n_q, n_k, piece.causal, piece.call_lag)]


def _call_key(segment: Segment, causal_windows: set[tuple[int, int]]) -> tuple[bool, tuple[int, int]]:
    """Which call a segment can join: one kind (causal or full) and one window a call. A causal square
    without a window joins the causal squares of the window that hides nothing in it, when its
    window has one (left >= its length - 1): a model's windowed layer, documents shorter than it."""
    if segment.causal and segment.window == NO_WINDOW and len(causal_windows) == 1:
        (window,) = causal_windows
        if window[0] >= segment.q.stop - segment.q.start - 1:
            return True, window
    return segment.causal, segment.window


def varlen_calls(block: list[Piece], block_size: int) -> list[list[list[Segment]]]:
    """``block`` (pieces of one query slice consecutive) as windows of whole query slices, each
    a list of varlen calls (causal calls, then full ones; one flash window a call), each a list of
    segments; a window's query rows, and a call's query and key rows, at most ``block_size``
    (0: ``UNTILED_ROWS``) unless one query slice or segment alone is longer."""
    budget = block_size or UNTILED_ROWS
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
        cut = [segment for piece in window for segment in segments(piece)]
        causal_windows = {s.window for s in cut if s.causal and s.window != NO_WINDOW}
        kinds: dict[tuple[bool, tuple[int, int]], list[Segment]] = {}
        for segment in cut:
            kinds.setdefault(_call_key(segment, causal_windows), []).append(segment)
        calls = []
        for key in sorted(kinds, key=lambda key: (not key[0], key[1])):  # causal calls first
            call, total_q, total_k = [], 0, 0
            for segment in kinds[key]:
                n_q, n_k = segment.q.stop - segment.q.start, segment.k.stop - segment.k.start
                if call and (total_q + n_q > budget or total_k + n_k > budget):
                    calls.append(call)
                    call, total_q, total_k = [], 0, 0
                call.append(segment if segment.window == key[1] else segment._replace(window=key[1]))
                total_q, total_k = total_q + n_q, total_k + n_k
            if call:
                calls.append(call)
        result.append(calls)
    return result


class _VarlenCall(NamedTuple):
    """One varlen kernel call: where its packed rows come from and where its results go."""

    causal: bool
    window: tuple[int, int]  # flash's (window_size_left, window_size_right); windows.NO_WINDOW for none
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


def varlen_windows(block: list[Piece]) -> list[list[list[Segment]]] | None:
    """:func:`varlen_calls` of ``block`` (bounded by the block size :func:`tiles` cut it to), or
    None where a varlen backend still makes one call per piece: pieces of every batch row (a block
    without documents, whose tiles fill their calls already), or no fewer calls than the per-piece
    path makes (a windowed piece is one call per part there: ``windows.window_parts``)."""
    if any(p.row is None for p in block):
        return None
    windows = varlen_calls(block, getattr(block, "block_size", 0))
    per_piece = sum(len(call) for calls in windows for call in calls)  # a segment is a per-piece call
    return windows if sum(len(calls) for calls in windows) < per_piece else None


def varlen_plan(block: list[Piece], q: torch.Tensor, backend: Backend | None) -> list[_VarlenWindow] | None:
    """The varlen calls of ``block`` as index tensors on q's device, or None where the per-piece
    calls are taken (a backend without varlen kernel, or :func:`varlen_windows` None); ``backend``
    resolved (``kernels.resolve_backend``)."""
    return indexed_plan(varlen_windows(block) if kernels.has_varlen(backend) else None, q)


def indexed_plan(windows: list[list[list[Segment]]] | None, q: torch.Tensor) -> list[_VarlenWindow] | None:
    """:func:`varlen_windows`' calls as index tensors on q's device; None for None (per-piece calls)."""
    if windows is None:
        return None

    def index(values: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(values).to(q.device)

    def rows_of(parts: list[Segment | Piece], side: str) -> tuple[torch.Tensor, torch.Tensor]:
        ranges = [getattr(p, side) for p in parts]
        return (index([torch.full((r.stop - r.start,), p.row) for p, r in zip(parts, ranges)]),
                index([torch.arange(r.start, r.stop) for r in ranges]))

    plan = []
    for calls in windows:
        first_slot, groups, rows = {}, [], 0  # each query slice of the window: its first accumulator row
        for segment in itertools.chain.from_iterable(calls):
            piece = segment.piece
            if piece.queries not in first_slot:
                first_slot[piece.queries] = rows
                groups.append(piece)
                rows += piece.q.stop - piece.q.start
        made = []
        for call in calls:
            slots, rounds, seen, packed = [], {}, {}, 0
            for segment in call:
                piece, n_q = segment.piece, segment.q.stop - segment.q.start
                first = first_slot[piece.queries] + segment.q.start - piece.q.start
                segment_slots = torch.arange(first, first + n_q)
                slots.append(segment_slots)
                turn = seen[piece.queries] = seen.get(piece.queries, -1) + 1  # a query slice's n-th segment here
                rounds.setdefault(turn, []).append((torch.arange(packed, packed + n_q), segment_slots))
                packed += n_q
            lengths_q = [s.q.stop - s.q.start for s in call]
            lengths_k = [s.k.stop - s.k.start for s in call]
            made.append(_VarlenCall(
                call[0].causal, call[0].window, rows_of(call, "q"), rows_of(call, "k"), index(slots),
                [(index([r for r, _ in parts]), index([s for _, s in parts])) for parts in rounds.values()],
                _cumulative(lengths_q, q.device), _cumulative(lengths_k, q.device), max(lengths_q), max(lengths_k),
            ))
        plan.append(_VarlenWindow(rows_of(groups, "q"), made))
    return plan


def _cumulative(lengths: list[int], device) -> torch.Tensor:
    """(n + 1,) int32 offsets of n segments: what the varlen kernels take as cu_seqlens."""
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)


def varlen_pieces_forward(q, k, v, plan: list[_VarlenWindow], scale, backend, out, lse, softcap=0.0):
    """``pieces.pieces_forward`` as varlen calls: each window's query rows accumulate in float32
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
                softcap=softcap, window=call.window,
            )
            call_lse = call_lse.t()  # (Tq, H)
            for packed, slots in call.rounds:
                slot_out, slot_lse = window_out[slots], window_lse[slots]
                kernels.merge_block(slot_out, slot_lse, call_out[packed], call_lse[packed])
                window_out[slots], window_lse[slots] = slot_out, slot_lse
        out_[window.rows] = window_out.to(out.dtype)
        lse_[window.rows] = window_lse
    return out, lse


def varlen_pieces_backward(
    dout, q, k, v, out, lse, plan: list[_VarlenWindow], scale, backend, dq, dk, dv, softcap=0.0,
):
    """``pieces.pieces_backward`` as varlen calls: dq summed per window in float32 (or straight into
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
                window=call.window,
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
