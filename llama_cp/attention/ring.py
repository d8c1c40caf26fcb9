"""Zigzag ring attention: each rank's K/V block travels around the cp group while every rank
computes its own queries against the block in hand.

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
unchanged. ``wire_bytes()`` counts what a rank sends (tests/attention/test_documents.py
checks it against the formula; docs/benchmarks.md has the figures).

Packed documents (position_ids that restart) change only which pairs each block computes:
Note [Document masks under CP] in ``llama_cp/attention/documents.py``. A step's block longer
than ``block_size`` is computed in tiles: Note [Tiled attention] there.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from llama_cp.attention import kernels
from llama_cp.attention.documents import DocumentLayout, Piece, tiles
from llama_cp.attention.kernels import Backend
from llama_cp.attention.pieces import pieces_backward, pieces_forward
from llama_cp.attention.sinks import add_sinks, sink_gradient
from llama_cp.attention.wire import _count


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
    def forward(ctx, q, k, v, group, causal, scale, backend, documents, block_size, softcap=0.0, window=None,
                sinks=None):
        out, lse = ring_forward(
            RingComm(group), q, k, v, causal=causal, scale=scale, backend=backend, documents=documents,
            block_size=block_size, softcap=softcap, window=window,
        )
        if sinks is not None:  # after the last block's merge: Note [Attention sinks under CP]
            out, lse = add_sinks(out, lse, sinks)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.group, ctx.causal, ctx.scale, ctx.backend, ctx.documents = group, causal, scale, backend, documents
        ctx.block_size, ctx.softcap, ctx.window = block_size, softcap, window
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        dq, dk, dv = ring_backward(
            RingComm(ctx.group, tag=0), RingComm(ctx.group, tag=1, kind="ring dK/dV"), dout, q, k, v, out, lse,
            causal=ctx.causal, scale=ctx.scale, backend=ctx.backend, documents=ctx.documents,
            block_size=ctx.block_size, softcap=ctx.softcap, window=ctx.window,
        )
        dsinks = sink_gradient(dout, out, lse, sinks) if ctx.needs_input_grad[-1] else None  # frozen: none
        return dq, dk, dv, None, None, None, None, None, None, None, None, dsinks
