"""Context-parallel attention for HF Llama-family models: ring (zigzag), Ulysses and all-gather.

Each rank of the cp group holds 2 of the 2 x cp chunks of the sequence (the
zigzag layout of :mod:`llama_cp.parallel.sharding`). Everything in the model except
attention is per token, so attention is the only place where ranks talk.

Note [Zigzag ring attention]
============================

The sequence is cut into 2 x cp chunks; cp rank r keeps chunks r and 2cp-1-r,
so every rank owns one early and one late chunk and does the same causal work
(cp = 4, rank 1 owns chunks 1 and 6):

    chunk:  0    1    2    3    4    5    6    7
    rank:   r0   r1   r2   r3   r3   r2   r1   r0

K/V blocks travel around the ring (rank r sends to r+1, receives from r-1), so
at step i rank r holds the K/V of rank s = (r - i) mod cp. Which query rows of
rank r may see that block follows from the chunk order alone:

    step 0 (s == r): q [r | 2cp-1-r] x kv [r | 2cp-1-r], causal, a square block
    s <  r:          all of q        x first half of kv  (chunk s < r < 2cp-1-r)
    s >  r:          second half of q x all of kv        (r < s, 2cp-1-s < 2cp-1-r)

            kv from s < r              kv from s > r
          kv[s]  kv[2cp-1-s]         kv[s]  kv[2cp-1-s]
    q[r]   ####      .          q[r]    .        .
    q[..]  ####      .          q[..]  ####     ####

so after step 0 every step costs the same: half the q x kv block. The partial
results are merged by their log-sum-exp (``kernels.merge_block``) in float32.

The next block's K/V is in flight (``batch_isend_irecv``) while the current
block computes. K and V are sent with their own number of heads: with GQA the
query groups are expanded inside the local kernel, never on the wire.

Backward runs the same ring again. dQ stays on its rank; the dK/dV of a block
travel *with* that block, one hop behind it: a rank adds its contribution to
the dK/dV it received and passes them on, and after cp hops each block's
dK/dV arrive back at its owner, summed over all ranks (float32 on the wire).

Note [Ring transfers]
---------------------

With packed documents (Note [Document masks under CP]) a rank's queries may see
nothing of another rank's block: short documents that stay inside one chunk
never reach the others. Such a block is neither sent nor received. Hop by hop
forwarding cannot skip it (rank r + 1 relays it when r + 2 needs it), so when
the layout has a block that some rank does not see, the transfers go straight
from the owner: at step i rank r sends its own K/V to r + i (if r + i sees it)
and receives the block of r - i (if it sees that), the same block the ring
would have brought, one step ahead as before. In backward the K/V move the same
way and each rank sends its share of a block's dK/dV straight back to the owner,
which sums them in float32 as they arrive (one transfer fewer than the ring's cp
hops, and one more float32 dK/dV buffer of the local shard: the owner's sum).
Both ends decide from the layout, which every rank holds whole
(``DocumentLayout.sees``: the block's piece list for the receiver is not empty),
so every posted send has its receive. When every rank sees every block (one
document per row, or documents that cross every chunk) the neighbour ring runs
unchanged. ``wire_bytes()`` counts what a rank sends (tests/test_documents.py
checks it against the formula; docs/benchmarks.md has the figures).

Ulysses (all-to-all) instead re-partitions [seq / cp, heads] into
[seq, heads / cp], puts the zigzag chunks back in order, runs ordinary causal
attention on its heads over the whole sequence, and returns by the inverse
all-to-all. It needs heads % cp == 0; K/V heads are repeated only as much as
the split needs (cp / gcd(kv_heads, cp) times).

All-gather (Llama 3's long-context parallelism) instead gathers the K/V of
every rank, KV heads only (with GQA a quarter of the queries' size or less), puts
them in row order, and computes the rank's own queries against the whole row
with the pieces of Note [Document masks under CP] (its spans vs the row as one
chunk). The backward gathers K/V again (nothing of the whole row is saved),
accumulates dK/dV of the whole row in float32 and reduce-scatters them back to
their owners. Because every rank sees every key, a rank may hold any tokens:
the batch is sharded by Note [Document-aware sharding] (``sharding.py``) so that
packed rows are balanced too, and the batch's ``seq_index`` says which rows a
rank holds (absent: the zigzag layout).

Note [Hybrid attention]
-----------------------

Ulysses needs heads % cp == 0, so with 32 heads it stops at cp 32, and its
all-to-all spans the whole cp group (across nodes, where links are slow). The
hybrid strategy (USP's idea) splits cp = u x r: Ulysses inside groups of u
consecutive cp ranks (``--ulysses_degree u``, usually a node), the ring across
the r groups. No new layout is needed: under the zigzag layout of cp, the u
ranks of group j hold exactly the two ring chunks j and 2r-1-j of the zigzag of
r, each rank two of their 2u sub-chunks in the zigzag order of u (cp 4, u 2,
r 2; 8 sub-chunks, ring chunks of 2):

    sub-chunk:    0    1    2    3    4    5    6    7
    cp rank:      0    1    2    3    3    2    1    0
    ring chunk:   0         1         1'        0'        (group 0 = ranks 0, 1 holds 0 and 0')

So Ulysses' own all-to-all (``_seq_to_heads`` over the group of u) leaves each
rank with heads / u heads of its group's two ring chunks in order, which is the
ring's local layout for ring rank j of r; the ring runs over the outer group (the
cp ranks with the same place in their groups) with that layout, documents
included, and the inverse all-to-all returns the output. u = cp is Ulysses,
u = 1 the ring. Needs heads % u == 0 (KV heads are repeated as Ulysses does).

Note [Choosing a strategy]
--------------------------

``--cp_strategy auto`` (``choose_strategy``) decides from the heads, cp and
whether rows are packed (a file or hub dataset with --document_mask):

- packed rows: allgather. Document-aware sharding makes the ranks' step work
  equal within 0.2% where the zigzag layout leaves the busiest rank of the
  worst row up to 59% over the mean at cp 8 (docs/benchmarks.md, balance). It
  sends more than Ulysses (Llama-3-8B, 131K tokens, cp 4: 48 GiB per rank per
  step against 30), a small part of a step on NVLink; the busiest rank's extra
  attention work is not.
- one document per row and heads % cp == 0: Ulysses, the fewest bytes per step
  of the strategies that need no packing (30 GiB in that example, against 56
  for the ring), in one all-to-all round per tensor.
- otherwise hybrid with u = gcd(heads, cp) when that is > 1, else the ring.

The basis is the bytes and balance tables of docs/benchmarks.md; the CPU step
times there do not separate the strategies (compute-bound, within 5%), no GPU
has measured them yet, and a GPU's overlap of the ring's transfers with its
compute may favour the ring over what bytes alone say.

Packed documents (position_ids that restart) change only which pairs each block
computes: see Note [Document masks under CP] in ``llama_cp/attention/documents.py``. A
step's block longer than ``block_size`` is computed in tiles: Note [Tiled
attention] there.
"""

from __future__ import annotations

import collections
import contextlib
import math
import types
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from llama_cp.attention import kernels
from llama_cp.parallel.collectives import all_gather_into, reduce_scatter_into, warm_up_group
from llama_cp.attention.documents import (
    DocumentLayout, Piece, pieces_attention, pieces_backward, pieces_forward, tiles,
)
from llama_cp.attention.kernels import Backend
from llama_cp.modules.causal_lm import base_causal_lm
from llama_cp.modules.families import check_supported, sliding_windows
from llama_cp.parallel.sharding import SEQ_INDEX, check_attention_mask, document_starts, unshard, zigzag_index

Strategy = Literal["ring", "ulysses", "allgather", "hybrid"]
STRATEGIES: tuple[str, ...] = ("ring", "ulysses", "allgather", "hybrid")

#: Name under which the attention function is registered with transformers.
ATTENTION_NAME = "llama_cp"
#: Keyword under which the decoder hands the batch's :class:`DocumentLayout` to every attention call.
DOCUMENTS_KWARG = "llama_cp_documents"


class WireMeter:
    """Bytes this rank sends to other ranks for context-parallel attention, by transfer kind
    (``sent``: kind -> bytes). The ring's transfers are counted as posted; a collective as the
    data it must move from this rank: an all-gather its shard to cp - 1 ranks, an all-to-all
    or reduce-scatter the (cp - 1) / cp of its input meant for others."""

    def __init__(self):
        self.sent: collections.Counter[str] = collections.Counter()


_METERS: list[WireMeter] = []


@contextlib.contextmanager
def wire_bytes():
    """Count the bytes sent by the attention calls inside the block: ``with wire_bytes() as meter``."""
    meter = WireMeter()
    _METERS.append(meter)
    try:
        yield meter
    finally:
        _METERS.remove(meter)


def _count(kind: str, nbytes: float) -> None:
    for meter in _METERS:
        meter.sent[kind] += int(nbytes)


class RingComm:
    """Point-to-point transfers of one process group's ring steps.

    ``exchange(send, to, recv_like, source)`` posts "send ``send`` to group rank ``to``,
    receive a tensor like ``recv_like`` from group rank ``source``" (either may be None:
    not posted) and returns the receive buffer; ``wait()`` blocks until both are done. Two
    RingComm objects with different tags may be in flight at once (the K/V and the dK/dV
    transfers of the backward). ``kind`` names the transfers for :func:`wire_bytes`.
    """

    def __init__(self, group: dist.ProcessGroup, tag: int = 0, kind: str = "ring K/V"):
        self.group = group
        self.tag = tag
        self.kind = kind
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self._requests: list = []

    def exchange(
        self, send: torch.Tensor | None, to: int, recv_like: torch.Tensor | None, source: int
    ) -> torch.Tensor | None:
        if self._requests:
            raise RuntimeError("RingComm.exchange called again before wait()")
        ops, recv = [], None
        if send is not None:
            ops.append(dist.P2POp(dist.isend, send, dist.get_global_rank(self.group, to), self.group, self.tag))
            _count(self.kind, send.numel() * send.element_size())
        if recv_like is not None:
            recv = torch.empty_like(recv_like)
            ops.append(dist.P2POp(dist.irecv, recv, dist.get_global_rank(self.group, source), self.group, self.tag))
        if ops:  # the backends keep the tensors of a pending transfer alive themselves
            self._requests = dist.batch_isend_irecv(ops)
        return recv

    def neighbours(self, x: torch.Tensor) -> torch.Tensor:
        """Send ``x`` to the next rank and receive its like from the previous one."""
        return self.exchange(x, (self.rank + 1) % self.size, x, (self.rank - 1) % self.size)

    def wait(self) -> None:
        for request in self._requests:
            request.wait()
        self._requests = []


def _kv_transfer(comm: RingComm, step: int, own: torch.Tensor, held: torch.Tensor | None,
                 documents: DocumentLayout | None, window: int | None = None) -> torch.Tensor | None:
    """Post the transfer that brings ring step ``step``'s K/V block (that of rank - step) to this
    rank, ``held`` being the block of step - 1; returns the receive buffer, None when no query
    of this rank sees the block (Note [Ring transfers]; ``window``: Note [Sliding windows under CP])."""
    if documents is None or documents.ring_dense(window):
        return comm.neighbours(held)
    rank, size = comm.rank, comm.size
    to, source = (rank + step) % size, (rank - step) % size
    return comm.exchange(
        own if documents.sees(to, rank, window) else None, to,
        own if documents.sees(rank, source, window) else None, source,
    )


# ---------------------------------------------------------------- ring
def ring_forward(
    comm: RingComm,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    scale: float,
    backend: Backend | None = None,
    documents: DocumentLayout | None = None,
    block_size: int = 0,
    softcap: float = 0.0,
    window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Zigzag ring attention forward; see Note [Zigzag ring attention].

    q: (B, H, S, D), k/v: (B, Hkv, S, D), the rank's two zigzag chunks.
    Returns out (B, H, S, D) in q's dtype and lse (B, H, S) in float32.
    With ``documents`` only the pairs of Note [Document masks under CP] are computed, and
    only the blocks some query sees are sent (Note [Ring transfers]);
    ``block_size``: kernel calls of at most that many queries x keys (Note [Tiled attention]);
    ``window``: a sliding window, which needs ``documents`` (Note [Sliding windows under CP]).
    """
    own = kv = torch.stack([k, v])  # (2, B, Hkv, S, D): one message per step
    out = lse = None
    for step in range(comm.size):
        if step + 1 < comm.size:
            next_kv = _kv_transfer(comm, step + 1, own, kv, documents, window)
        if kv is not None:  # else no query of this rank sees the block, and it was not sent
            out, lse = _ring_block_forward(comm.rank, comm.size, step, causal, documents, block_size, q, kv,
                                           scale, backend, out, lse, softcap, window)
        if step + 1 < comm.size:
            comm.wait()
            kv = next_kv
    return out.to(q.dtype), lse


def ring_backward(
    comm_kv: RingComm,
    comm_dkv: RingComm,
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    causal: bool,
    scale: float,
    backend: Backend | None = None,
    documents: DocumentLayout | None = None,
    block_size: int = 0,
    softcap: float = 0.0,
    window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Zigzag ring attention backward; see Note [Zigzag ring attention] (and Note [Document
    masks under CP] and Note [Ring transfers] with ``documents``, Note [Tiled attention] with
    ``block_size``)."""
    rank, size, half = comm_kv.rank, comm_kv.size, q.shape[2] // 2
    acc = kernels.accumulation_dtype(q)
    direct = documents is not None and not documents.ring_dense(window)
    dq = torch.zeros_like(q, dtype=acc)
    own = kv = torch.stack([k, v])
    own_dkv = torch.zeros_like(own, dtype=acc) if direct else None  # our block's dK/dV, summed here
    dkv_in_flight = None
    for step in range(size):
        if step + 1 < size:
            next_kv = _kv_transfer(comm_kv, step + 1, own, kv, documents, window)
        dkv = None
        if kv is not None:
            dkv = own_dkv if direct and step == 0 else torch.zeros_like(kv, dtype=acc)  # our share of its dK/dV
            _ring_block_backward(rank, size, step, half, causal, documents, block_size, dout, q, kv, out, lse,
                                 scale, backend, dq, dkv, softcap, window)
        if not direct:  # the block's dK/dV travel with it, one hop behind (Note [Zigzag ring attention])
            if dkv_in_flight is not None:
                comm_dkv.wait()
                dkv.add_(dkv_in_flight)
            dkv_in_flight = comm_dkv.neighbours(dkv)
        elif step > 0:  # straight back to the block's owner; ours come from the ranks that saw it
            comm_dkv.wait()
            if dkv_in_flight is not None:
                own_dkv.add_(dkv_in_flight)
            seen_by = (rank + step) % size
            dkv_in_flight = comm_dkv.exchange(
                dkv, (rank - step) % size, own_dkv if documents.sees(seen_by, rank, window) else None, seen_by
            )
        if step + 1 < size:
            comm_kv.wait()
            kv = next_kv
    comm_dkv.wait()  # the last transfer: our own block's dK/dV (the rest of its sum, when direct)
    if direct:
        if dkv_in_flight is not None:
            own_dkv.add_(dkv_in_flight)
        dkv_in_flight = own_dkv
    return dq.to(q.dtype), dkv_in_flight[0].to(k.dtype), dkv_in_flight[1].to(v.dtype)


def _ring_block_forward(rank, size, step, causal, documents, block_size, q, kv, scale, backend, out, lse,
                        softcap=0.0, window=None):
    """Merge ring step ``step``'s block into (out, lse), the rank's float32 accumulators (None
    before the first block)."""
    half = q.shape[2] // 2
    block = _ring_step_pieces(rank, size, step, q.shape[2], causal, documents, block_size, window)
    if block is not None:
        if out is None:  # rows start empty: merge_block takes a block's values into them
            out = torch.zeros_like(q, dtype=kernels.accumulation_dtype(q))
            lse = torch.full(q.shape[:3], float("-inf"), dtype=out.dtype, device=q.device)
        pieces_forward(q, kv[0], kv[1], block, scale=scale, backend=backend, out=out, lse=lse, softcap=softcap)
    elif step == 0:
        block_out, lse = kernels.attention_forward(q, kv[0], kv[1], causal=causal, scale=scale, backend=backend, softcap=softcap)
        out = block_out.to(kernels.accumulation_dtype(q))
    elif not causal:
        block_out, block_lse = kernels.attention_forward(q, kv[0], kv[1], causal=False, scale=scale, backend=backend, softcap=softcap)
        kernels.merge_block(out, lse, block_out, block_lse)
    elif step <= rank:  # block from an earlier rank: all q vs its first chunk
        block_out, block_lse = kernels.attention_forward(
            q, kv[0, :, :, :half], kv[1, :, :, :half], causal=False, scale=scale, backend=backend, softcap=softcap
        )
        kernels.merge_block(out, lse, block_out, block_lse)
    else:  # block from a later rank: our late chunk vs all of it
        block_out, block_lse = kernels.attention_forward(
            q[:, :, half:], kv[0], kv[1], causal=False, scale=scale, backend=backend, softcap=softcap
        )
        kernels.merge_block(out[:, :, half:], lse[:, :, half:], block_out, block_lse)
    return out, lse


def _ring_block_backward(rank, size, step, half, causal, documents, block_size, dout, q, kv, out, lse, scale,
                         backend, dq, dkv, softcap=0.0, window=None) -> None:
    """Add ring step ``step``'s gradients to dq and dkv (the block's dK/dV) in place."""
    block = _ring_step_pieces(rank, size, step, q.shape[2], causal, documents, block_size, window)
    if block is not None:
        pieces_backward(dout, q, kv[0], kv[1], out, lse, block, scale=scale, backend=backend, dq=dq,
                        dk=dkv[0], dv=dkv[1], softcap=softcap)
        return
    if step == 0 or not causal:
        grads = kernels.attention_backward(
            dout, q, kv[0], kv[1], out, lse, causal=causal and step == 0, scale=scale, backend=backend, softcap=softcap
        )
        dq.add_(grads[0])
        dkv[0].add_(grads[1])
        dkv[1].add_(grads[2])
    elif step <= rank:
        grads = kernels.attention_backward(
            dout, q, kv[0, :, :, :half], kv[1, :, :, :half], out, lse, causal=False, scale=scale, backend=backend, softcap=softcap,
        )
        dq.add_(grads[0])
        dkv[0, :, :, :half].add_(grads[1])
        dkv[1, :, :, :half].add_(grads[2])
    else:
        grads = kernels.attention_backward(
            dout[:, :, half:], q[:, :, half:], kv[0], kv[1], out[:, :, half:], lse[:, :, half:],
            causal=False, scale=scale, backend=backend, softcap=softcap,
        )
        dq[:, :, half:].add_(grads[0])
        dkv[0].add_(grads[1])
        dkv[1].add_(grads[2])


def _ring_step_pieces(
    rank: int, size: int, step: int, seq_len: int, causal: bool, documents: DocumentLayout | None, block_size: int,
    window: int | None = None,
) -> list[Piece] | None:
    """The kernel calls of ring step ``step`` on ``rank`` of ``size`` as pieces, tiled to
    ``block_size``; None when the step is one untiled call (the ring's own branches)."""
    if documents is not None:
        return tiles(documents.ring_pieces((rank - step) % size, window), block_size)
    if not block_size or seq_len <= block_size:
        return None
    whole, half = slice(0, seq_len), seq_len // 2
    if step == 0 or not causal:
        block = Piece(None, whole, whole, causal and step == 0)
    elif step <= rank:  # Note [Zigzag ring attention]: from an earlier rank, all q vs its first chunk
        block = Piece(None, whole, slice(0, half), False)
    else:  # from a later rank: our late chunk vs all of it
        block = Piece(None, slice(half, seq_len), whole, False)
    return tiles([block], block_size)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, causal, scale, backend, documents, block_size, softcap=0.0, window=None):
        out, lse = ring_forward(
            RingComm(group), q, k, v, causal=causal, scale=scale, backend=backend, documents=documents,
            block_size=block_size, softcap=softcap, window=window,
        )
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.causal, ctx.scale, ctx.backend, ctx.documents = group, causal, scale, backend, documents
        ctx.block_size, ctx.softcap, ctx.window = block_size, softcap, window
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ring_backward(
            RingComm(ctx.group, tag=0), RingComm(ctx.group, tag=1, kind="ring dK/dV"), dout, q, k, v, out, lse,
            causal=ctx.causal, scale=ctx.scale, backend=ctx.backend, documents=ctx.documents,
            block_size=ctx.block_size, softcap=ctx.softcap, window=ctx.window,
        )
        return dq, dk, dv, None, None, None, None, None, None, None, None


# ---------------------------------------------------------------- local block
def local_attention(q, k, v, *, causal: bool, scale: float, backend: Backend | None, block_size: int,
                    block: list[Piece] | None = None, softcap: float = 0.0):
    """Attention of one process (cp 1, or Ulysses' local heads): ``block``'s pieces (documents)
    or the whole (q, k, v), in tiles of ``block_size`` (Note [Tiled attention]). Differentiable."""
    if block is None:
        if not block_size or max(q.shape[2], k.shape[2]) <= block_size:
            return _LocalAttention.apply(q, k, v, causal, scale, backend, softcap)
        block = [Piece(None, slice(0, q.shape[2]), slice(0, k.shape[2]), causal)]
    return pieces_attention(q, k, v, tiles(block, block_size), scale=scale, backend=backend, softcap=softcap)


class _LocalAttention(torch.autograd.Function):
    """Attention over the whole (local) sequence with the ``kernels`` backend."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, backend, softcap):
        out, lse = kernels.attention_forward(q, k, v, causal=causal, scale=scale, backend=backend, softcap=softcap)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.scale, ctx.backend, ctx.softcap = causal, scale, backend, softcap
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = kernels.attention_backward(
            dout, q, k, v, out, lse, causal=ctx.causal, scale=ctx.scale, backend=ctx.backend, softcap=ctx.softcap
        )
        return dq, dk, dv, None, None, None, None


# ---------------------------------------------------------------- ulysses
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
):
    """Ulysses attention; q: (B, H, S/cp, D), k/v: (B, Hkv, S/cp, D) zigzag shards. Differentiable.
    With ``documents``, causal attention within each document of the gathered row; ``block_size``:
    Note [Tiled attention]."""
    cp = dist.get_world_size(group)
    kv_repeat = cp // math.gcd(k.shape[1], cp)  # make the KV heads split evenly across cp
    k, v = kernels._expand_kv(k, kv_repeat), kernels._expand_kv(v, kv_repeat)
    q, k, v = (_AllToAll.apply(t, group, _seq_to_heads, _heads_to_seq) for t in (q, k, v))
    block = None if documents is None else documents.full_row_pieces(window)
    out = local_attention(q, k, v, causal=causal, scale=scale, backend=backend, block_size=block_size, block=block,
                          softcap=softcap)
    return _AllToAll.apply(out, group, _heads_to_seq, _seq_to_heads)


# ---------------------------------------------------------------- all-gather
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
    def forward(ctx, q, k, v, group, scale, backend, documents, block_size, softcap, window):
        out, lse = allgather_forward(group, q, k, v, documents, scale=scale, backend=backend, block_size=block_size,
                                     softcap=softcap, window=window)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.scale, ctx.backend, ctx.documents, ctx.block_size = group, scale, backend, documents, block_size
        ctx.softcap, ctx.window = softcap, window
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        grads = allgather_backward(
            ctx.group, dout, q, k, v, out, lse, ctx.documents, scale=ctx.scale, backend=ctx.backend,
            block_size=ctx.block_size, softcap=ctx.softcap, window=ctx.window,
        )
        return *grads, None, None, None, None, None, None, None


# ---------------------------------------------------------------- hybrid
def check_ulysses_degree(strategy: str, ulysses_degree: int, cp: int, heads: int | None = None) -> None:
    """One line naming --ulysses_degree and the fix unless it fits ``strategy``, cp and the heads."""
    if strategy != "hybrid":
        if ulysses_degree:
            raise ValueError(f"--ulysses_degree {ulysses_degree} is only read by --cp_strategy hybrid (got "
                             f"{strategy!r}): add --cp_strategy hybrid or drop --ulysses_degree")
        return
    if ulysses_degree < 1 or cp % ulysses_degree:
        raise ValueError(f"--cp_strategy hybrid needs --ulysses_degree, a divisor of --cp {cp} (the Ulysses ranks "
                         f"inside each ring rank), got {ulysses_degree}")
    if heads is not None and heads % ulysses_degree:
        raise ValueError(f"--ulysses_degree {ulysses_degree} must divide num_attention_heads ({heads}): choose a "
                         f"common divisor of {heads} and --cp {cp}")


_HYBRID_GROUPS: dict = {}


def hybrid_groups(group: dist.ProcessGroup, ulysses_degree: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """(inner, outer) sub-groups of cp group ``group`` for Note [Hybrid attention]: inner, the
    ``ulysses_degree`` consecutive cp ranks of this rank; outer, every ``ulysses_degree``-th.
    Collective over the default group (new groups are made for every cp group), cached."""
    key = (tuple(dist.get_process_group_ranks(group)), ulysses_degree)
    if key not in _HYBRID_GROUPS:
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, key[0])
        u, me, found = ulysses_degree, dist.get_rank(), {}
        for ranks in sorted(set(map(tuple, every))):  # the same new_group calls, in the same order, everywhere
            for kind, members in [*(("inner", ranks[j : j + u]) for j in range(0, len(ranks), u)),
                                  *(("outer", ranks[i::u]) for i in range(u))]:
                new = dist.new_group(list(members))
                if me in members:
                    found[kind] = new
        for new in found.values():  # every group made, each before its first ring transfer
            warm_up_group(new)
        _HYBRID_GROUPS[key] = (found["inner"], found["outer"])
    return _HYBRID_GROUPS[key]


def hybrid_attention(
    q, k, v, inner: dist.ProcessGroup, outer: dist.ProcessGroup, *, causal: bool, scale: float,
    backend: Backend | None = None, documents: DocumentLayout | None = None, block_size: int = 0,
    softcap: float = 0.0, window: int | None = None,
):
    """Ulysses over ``inner``, then the ring over ``outer`` (Note [Hybrid attention]); q: (B, H,
    S/cp, D), k/v: (B, Hkv, S/cp, D) zigzag shards of the cp group. ``documents``: the layout of
    the outer ring (``cp_size`` its size). Differentiable."""
    u = dist.get_world_size(inner)
    kv_repeat = u // math.gcd(k.shape[1], u)
    k, v = kernels._expand_kv(k, kv_repeat), kernels._expand_kv(v, kv_repeat)
    q, k, v = (_AllToAll.apply(t, inner, _seq_to_heads, _heads_to_seq) for t in (q, k, v))
    if dist.get_world_size(outer) == 1:  # u = cp: Ulysses
        block = None if documents is None else documents.ring_pieces(0, window)
        out = local_attention(q, k, v, causal=causal, scale=scale, backend=backend, block_size=block_size, block=block,
                              softcap=softcap)
    else:
        out = _RingAttention.apply(q, k, v, outer, causal, scale, backend, documents, block_size, softcap, window)
    return _AllToAll.apply(out, inner, _heads_to_seq, _seq_to_heads)


def choose_strategy(heads: int, cp: int, packed: bool) -> tuple[Strategy, int]:
    """``--cp_strategy auto``: (strategy, ulysses_degree) by Note [Choosing a strategy]."""
    if cp == 1:
        return "ring", 0
    if packed:
        return "allgather", 0
    if heads % cp == 0:
        return "ulysses", 0
    u = math.gcd(heads, cp)
    return ("hybrid", u) if u > 1 else ("ring", 0)


# ---------------------------------------------------------------- HF binding
@dataclass(frozen=True)
class ContextParallelAttention:
    """The context-parallel attention bound to one attention module by :func:`apply_context_parallel`."""

    group: dist.ProcessGroup | None
    strategy: Strategy
    backend: Backend | None = None
    document_mask: bool = True
    #: tokens per query block and per key block of every local kernel call; 0: one call per block
    block_size: int = 0
    #: hybrid: the Ulysses and the ring sub-groups of ``group`` (Note [Hybrid attention])
    inner: dist.ProcessGroup | None = None
    outer: dist.ProcessGroup | None = None
    #: some layer has a sliding window: every batch gets a layout (Note [Sliding windows under CP])
    sliding: bool = False

    @property
    def cp_size(self) -> int:
        return 1 if self.group is None else dist.get_world_size(self.group)

    def gathered_layout(self, position_ids: torch.Tensor, seq_index: torch.Tensor | None) -> DocumentLayout:
        """The all-gather strategy's layout of a batch: its documents (one per row without
        ``document_mask``) and which rows every rank holds; ``seq_index`` (S/cp,): this rank's
        rows, None: the zigzag layout. A collective over the cp group."""
        rank, cp, device = dist.get_rank(self.group), self.cp_size, position_ids.device
        if seq_index is None:
            local_rows = zigzag_index(position_ids.shape[-1] * cp, cp, rank, device=device)
        else:
            local_rows = seq_index.to(device)
        gathered = [torch.empty_like(local_rows) for _ in range(cp)]
        dist.all_gather(gathered, local_rows, group=self.group)  # on the device: NCCL has no CPU tensors
        positions = unshard(position_ids, self.group, seq_index=local_rows)
        starts = document_starts(positions) if self.document_mask else torch.zeros_like(positions)
        return DocumentLayout(
            starts, cp_rank=rank, cp_size=cp, local_rows=local_rows.cpu(), gathered_rows=torch.cat(gathered).cpu()
        )

    def document_layout(self, position_ids: torch.Tensor) -> DocumentLayout | None:
        """The documents of a batch from its local (B, S/cp) global ``position_ids``; None when
        every row is one document (Note [Document masks under CP]). A collective over the cp group."""
        starts = document_starts(unshard(position_ids, self.group))
        if not bool(starts.any()):
            return None
        return self.zigzag_layout(starts)

    def one_document_layout(self, rows: int, seq_len: int, device: torch.device) -> DocumentLayout:
        """The layout of ``rows`` rows of one document of ``seq_len`` tokens each (global): what the
        windowed layers run on when the batch has no documents (Note [Sliding windows under CP])."""
        starts = torch.zeros((rows, seq_len), dtype=torch.long, device=device)
        return self.zigzag_layout(starts, single=True)

    def zigzag_layout(self, starts: torch.Tensor, single: bool = False) -> DocumentLayout:
        """The layout of (B, L) document ``starts`` on this rank's zigzag chunks (hybrid: the
        outer ring's); ``single``: every row one document (DocumentLayout.single)."""
        rank, size = (0, 1) if self.group is None else (dist.get_rank(self.group), self.cp_size)
        if self.strategy == "hybrid":  # the outer ring's layout: its ranks hold the ring's zigzag chunks
            rank, size = dist.get_rank(self.outer), dist.get_world_size(self.outer)
        return DocumentLayout(starts, cp_rank=rank, cp_size=size, single=single)

    def __call__(
        self, q, k, v, *, causal: bool, scale: float | None, documents: DocumentLayout | None = None,
        softcap: float = 0.0, window: int | None = None,
    ) -> torch.Tensor:
        """q: (B, H, S/cp, D), k/v: (B, Hkv, S/cp, D) -> (B, H, S/cp, D). ``documents``: attend
        only within each packed document (Note [Document masks under CP]); ``softcap``: Note
        [Soft-capped attention] in ``llama_cp/attention/kernels.py``; ``window``: a sliding window of that
        many tokens (Note [Sliding windows under CP] in ``llama_cp/attention/documents.py``)."""
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        seq_len = q.shape[2] * self.cp_size
        if window is not None and window < 1:
            raise ValueError(f"a sliding window must hold at least 1 token, got {window}")
        if window is not None and window >= seq_len:
            window = None  # it cuts nothing
        if window is not None and not causal:
            raise ValueError("sliding windows are causal here; got a non-causal attention call with a window")
        if window is not None and documents is None:  # one document per row: called without the decoder's hook
            documents = self.one_document_layout(q.shape[0], seq_len, q.device)
        if window is None and documents is not None and documents.single and self.strategy != "allgather":
            documents = None  # a full layer of a windowed model: the plain strategies
        if documents is not None and not causal:
            raise ValueError("document masks are causal; got a non-causal attention call with documents")
        if self.cp_size == 1:
            block = None if documents is None else documents.ring_pieces(0, window)
            return local_attention(
                q, k, v, causal=causal, scale=scale, backend=self.backend, block_size=self.block_size, block=block,
                softcap=softcap,
            )
        if self.strategy == "allgather":
            if documents is None or documents.gathered_rows is None:
                raise RuntimeError("all-gather attention called without its layout; call the model, not the layer")
            return _AllGatherAttention.apply(
                q, k, v, self.group, scale, self.backend, documents, self.block_size, softcap, window
            )
        if self.strategy == "ring":
            if q.shape[2] % 2:
                raise ValueError(
                    f"ring attention needs an even local sequence length (two zigzag chunks), got {q.shape[2]}; "
                    "shard the batch with llama_cp.shard_batch"
                )
            return _RingAttention.apply(
                q, k, v, self.group, causal, scale, self.backend, documents, self.block_size, softcap, window
            )
        if self.strategy == "hybrid":
            return hybrid_attention(
                q, k, v, self.inner, self.outer, causal=causal, scale=scale, backend=self.backend,
                documents=documents, block_size=self.block_size, softcap=softcap, window=window,
            )
        return ulysses_attention(
            q, k, v, self.group, causal=causal, scale=scale, backend=self.backend, documents=documents,
            block_size=self.block_size, softcap=softcap, window=window,
        )


def _prepare_decoder_call(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Forward pre-hook of the decoder (``LlamaModel``), where the batch enters the model:
    refuse a padding mask (transformers would hand the attention None), require global
    ``position_ids`` under CP, and hand every attention layer the batch's documents (and,
    all-gather, which rows each rank holds: the batch's ``seq_index``)."""
    check_attention_mask(kwargs.get("attention_mask", args[1] if len(args) > 1 else None))
    attention: ContextParallelAttention = module.cp_attention
    seq_index = kwargs.get(SEQ_INDEX)
    kwargs = {key: value for key, value in kwargs.items() if key != SEQ_INDEX}
    position_ids = kwargs.get("position_ids", args[2] if len(args) > 2 else None)
    if position_ids is None:
        if attention.cp_size > 1:
            raise ValueError(
                "context-parallel model called without position_ids: each rank holds zigzag chunks of the "
                "sequence and needs their global positions; shard the batch with llama_cp.shard_batch, "
                "which creates them"
            )
        return args, kwargs
    gathered = attention.strategy == "allgather" and attention.cp_size > 1
    if seq_index is not None and not gathered:
        rank = 0 if attention.group is None else dist.get_rank(attention.group)
        zigzag = zigzag_index(seq_index.shape[0] * attention.cp_size, attention.cp_size, rank)
        if not torch.equal(seq_index.cpu(), zigzag):
            raise ValueError(
                f"this batch was sharded with shard_batch(layout='documents'), which only cp_strategy='allgather' "
                f"can run (this model uses {attention.strategy!r} at cp {attention.cp_size}); shard it with "
                "layout='zigzag' or use --cp_strategy allgather"
            )
    if attention.document_mask or gathered or attention.sliding:
        tokens = kwargs.get("input_ids", args[0] if args else None)
        tokens = kwargs.get("inputs_embeds") if tokens is None else tokens
        if tokens is not None:
            rows = tokens.shape[0]
        else:
            rows = position_ids.shape[0] if position_ids.dim() == 2 else 1
        positions = position_ids.reshape(-1, position_ids.shape[-1]).expand(rows, -1)
        if gathered:
            documents = attention.gathered_layout(positions, seq_index)
        else:
            documents = attention.document_layout(positions) if attention.document_mask else None
            if documents is None and attention.sliding:  # one layout for every windowed layer of the batch
                documents = attention.one_document_layout(rows, positions.shape[-1] * attention.cp_size,
                                                          positions.device)
        if documents is not None:
            kwargs = {**kwargs, DOCUMENTS_KWARG: documents}
    return args, kwargs


def cp_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The function registered as ``attn_implementation="llama_cp"``; same signature as
    transformers' ``sdpa_attention_forward``. Returns ((B, S/cp, H, D), None)."""
    attention: ContextParallelAttention | None = getattr(module, "cp_attention", None)
    if attention is None:
        raise RuntimeError(
            f"{type(module).__name__} uses attn_implementation={ATTENTION_NAME!r} but has no context-parallel "
            "binding; call llama_cp.apply_context_parallel(model, cp_mesh) instead of setting it by hand"
        )
    check_attention_mask(attention_mask)
    if dropout:
        raise ValueError(f"context-parallel attention does not support attention dropout (got {dropout})")
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    out = attention(query, key, value, causal=causal, scale=scaling, documents=kwargs.get(DOCUMENTS_KWARG),
                    softcap=kwargs.get("softcap") or 0.0, window=kwargs.get("sliding_window"))
    return out.transpose(1, 2).contiguous(), None


# ---------------------------------------------------------------- RoPE
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
    return tuple(t.narrow(seq_dim, 0, seq_len) for t in type(self).forward(self, x, extended, *args, **kwargs))


def bind_global_rope(model: nn.Module, group: dist.ProcessGroup | None) -> None:
    """Make position-dependent RoPE modules choose their frequencies from the global sequence
    (Note [Position-dependent RoPE under CP]); other rotary modules are left as they are."""
    for module in model.modules():
        if "inv_freq" not in dict(module.named_buffers(recurse=False)):
            continue
        if group is not None and _reads_positions(module):
            module.cp_group = group
            module.forward = types.MethodType(_global_rope_forward, module)
        elif "forward" in module.__dict__:  # re-applied with cp = 1 or a static RoPE: the class forward
            del module.forward


def apply_context_parallel(
    model: nn.Module,
    cp_mesh: DeviceMesh | dist.ProcessGroup | None,
    strategy: Strategy = "ring",
    *,
    backend: Backend | None = None,
    max_seq_len: int | None = None,
    document_mask: bool = True,
    block_size: int = 0,
    ulysses_degree: int = 0,
) -> nn.Module:
    """Make every attention layer of an HF Llama-family ``model`` context-parallel over ``cp_mesh``.

    The model then expects the zigzag shards made by :func:`llama_cp.shard_batch`
    (with global ``position_ids``) on every rank of the cp group. Only attention
    changes: parameter gradients stay per rank, and their sum over the cp group is
    the full-sequence gradient (reducing them is FSDP's job, see ``shard_model``).
    With a cp group of size 1 the attention is the ordinary local causal attention.

    ``document_mask`` (default): a row whose ``position_ids`` restart holds several
    packed documents, and each token attends only to the earlier tokens of its own
    document, as single-process transformers does (Note [Document masks under CP]).
    ``False``: every token attends to all earlier tokens of the row.

    ``block_size`` (``--attention_block_size``): every local kernel call covers at most that
    many queries x keys, so its workspace is per block, not per sequence (Note [Tiled
    attention] in ``llama_cp/attention/documents.py``); 0: one call per block of the strategy.

    Models llama-cp cannot compute exactly are refused here (``llama_cp.modules.families``);
    ``max_seq_len``, the longest global sequence to come, lets a sliding window that needs
    flash-attn on CUDA be refused now rather than at the first forward when ``backend`` names
    one of torch's CUDA kernels. A padding attention mask is refused when the model is called.

    ``strategy="hybrid"``: Ulysses inside groups of ``ulysses_degree`` consecutive cp ranks,
    the ring across them (Note [Hybrid attention]); the batch keeps the zigzag layout.
    """
    from transformers import AttentionInterface

    if strategy not in STRATEGIES:
        raise ValueError(f"unknown cp strategy {strategy!r}; choose one of {STRATEGIES}")
    if backend is not None and backend not in kernels.BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; choose one of {kernels.BACKENDS}")
    if block_size < 0:
        raise ValueError(f"attention block_size must be >= 0 (0 = untiled), got {block_size}")
    check_supported(model)
    windows = sliding_windows(model)
    if backend in ("sdpa_flash", "sdpa_efficient") and windows and max_seq_len and min(windows) < max_seq_len:
        raise ValueError(
            f"--attention_backend {backend}: this model's sliding window of {min(windows)} tokens is shorter than "
            f"the sequence ({max_seq_len} tokens), and llama-cp passes windows to flash_attn only: use "
            "--attention_backend flash_attn (pip install flash-attn --no-build-isolation)"
        )
    group = cp_mesh.get_group() if isinstance(cp_mesh, DeviceMesh) else cp_mesh
    cp = 1 if group is None else dist.get_world_size(group)

    config = model.config
    heads = config.num_attention_heads
    if strategy == "ulysses" and heads % cp:
        raise ValueError(
            f"cp_strategy='ulysses' needs num_attention_heads ({heads}) divisible by cp ({cp}); "
            f"use cp_strategy='ring' or a cp that divides {heads}"
        )
    check_ulysses_degree(strategy, ulysses_degree, cp, heads)
    layers = [m for m in model.modules()
              if (hasattr(m, "q_proj") or hasattr(m, "qkv_proj")) and hasattr(m, "o_proj") and hasattr(m, "config")]
    if not layers:
        raise ValueError(f"found no attention layers (modules with q_proj or qkv_proj, and o_proj) in "
                         f"{type(model).__name__}")

    inner = outer = None
    if strategy == "hybrid" and cp > 1:
        inner, outer = hybrid_groups(group, ulysses_degree)
    attention = ContextParallelAttention(
        group=group if cp > 1 else None, strategy=strategy, backend=backend, document_mask=document_mask,
        block_size=block_size, inner=inner, outer=outer, sliding=bool(windows),
    )
    decoder = base_causal_lm(model).get_decoder()
    for module in (*layers, decoder):
        module.cp_attention = attention  # a plain attribute: bound per model, no module globals
    bind_global_rope(model, attention.group)
    if not getattr(decoder, "_llama_cp_hook", False):
        decoder.register_forward_pre_hook(_prepare_decoder_call, with_kwargs=True)
        decoder._llama_cp_hook = True
    AttentionInterface.register(ATTENTION_NAME, cp_attention_forward)
    model.set_attn_implementation(ATTENTION_NAME)
    return model
