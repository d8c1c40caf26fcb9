"""Sequence layout across the cp group: which tokens of a row each cp rank keeps, and the inverse.

``layout="zigzag"`` (ring, Ulysses; the default): the sequence is cut into 2 x cp
equal chunks and cp rank r keeps chunks r and 2cp-1-r (see Note [Zigzag ring
attention] in ``llama_cp/attention/ring.py``)::

    L = 16, cp = 2:   chunks  [0..3] [4..7] [8..11] [12..15]
                      rank 0:  [0..3]                [12..15]
                      rank 1:         [4..7] [8..11]

``layout="documents"`` (the all-gather strategy): more, smaller chunks, assigned
from the batch's documents so that every rank does the same attention work;
Note [Document-aware sharding]. Its batches carry ``batch["seq_index"]``, the
rows of the rank's tokens, which the model and :func:`unshard` take.

Note [Document-aware sharding]
==============================

With packed documents the attention work of a query is the number of keys it
sees, t - start[t] + 1 (Note [Document masks under CP]), so the zigzag's equal
halves are unequal work: a long document's late chunks cost far more than a
row of short documents. The all-gather strategy lets any rank hold any tokens,
so the row is cut into n equal chunks (n a multiple of cp, more than 2 x cp:
:func:`document_chunk_count`, 8-16 per rank) and each rank gets n / cp of them,
the same number of tokens (the per-token work: MLP, norms, loss), chosen by
longest processing time first under that count:

    work[j] = sum over the batch's rows and chunk j's tokens t of (t - start[t] + 1)
    for j in chunks by work, largest first (ties: lower j):
        give j to the rank with the least work among those holding < n / cp chunks
        (ties: lower rank)

    cp = 2, n = 8, one document:  work 1 3 5 7 9 11 13 15  (x chunk^2 / 2)
                                  rank 0: chunks 7 4 3 0   rank 1: chunks 6 5 2 1

Each rank keeps its chunks in row order (neighbouring chunks form one span, one
kernel call). The assignment depends only on the full position_ids, so every
rank computes the same one. Measured bound (``python benchmarks/document_mask.py
balance``, docs/benchmarks.md: 64 rows of each of four document-length mixes,
32K and 128K tokens, cp 2, 4 and 8): the busiest rank's attention work is at
most 1.044x the mean on the worst row (1.001-1.012x on average), against 1.5-3.9x
for the zigzag, and a Llama-3-8B step (dense layers + attention, FLOP estimate) at
most 1.002x. The bound is measured, not proven: with many chunks, each small next to a
rank's share, the last chunks placed fill the gaps the large ones left.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

CpGroup = DeviceMesh | dist.ProcessGroup | None
#: The layouts of :func:`shard_batch`.
LAYOUTS: tuple[str, ...] = ("zigzag", "documents")
#: Batch key (and model keyword) of the rows of a rank's tokens, (S/cp,), made by ``layout="documents"``.
SEQ_INDEX = "seq_index"


def layout_for(strategy: str) -> str:
    """The :func:`shard_batch` layout a cp strategy reads its rows in: "documents" for the
    all-gather strategy, "zigzag" for the others."""
    return "documents" if strategy == "allgather" else "zigzag"


def document_starts(position_ids: torch.Tensor) -> torch.Tensor:
    """(B, L) position_ids -> (B, L): the row index where each token's document starts
    (Note [Document masks under CP] in llama_cp/attention/documents.py)."""
    seq_len = position_ids.shape[-1]
    index = torch.arange(seq_len, device=position_ids.device).expand_as(position_ids)
    new = torch.ones_like(position_ids, dtype=torch.bool)
    new[..., 1:] = position_ids[..., 1:] != position_ids[..., :-1] + 1
    return torch.where(new, index, torch.zeros_like(index)).cummax(dim=-1).values


def visible_pairs_per_token(starts: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """(B, L) document starts -> (L,): the keys each query sees, t - start[t] + 1 (at most
    ``window``, a sliding window), summed over the batch."""
    seen = torch.arange(starts.shape[-1], device=starts.device) - starts + 1
    return (seen if window is None else seen.clamp(max=window)).sum(0)


def cp_rank_and_size(cp: CpGroup) -> tuple[int, int]:
    """(rank in the cp group, cp size) for a 1-D mesh, a process group, or None (no CP)."""
    if cp is None:
        return 0, 1
    if isinstance(cp, DeviceMesh):
        return cp.get_local_rank(), cp.size()
    return dist.get_rank(cp), dist.get_world_size(cp)


def _group(cp: CpGroup) -> dist.ProcessGroup | None:
    return cp.get_group() if isinstance(cp, DeviceMesh) else cp


def check_seq_len(seq_len: int, cp_size: int) -> None:
    """Raise a ValueError naming the nearest valid lengths unless seq_len % (2 x cp) == 0."""
    multiple = 2 * cp_size
    if seq_len % multiple:
        lower, upper = seq_len // multiple * multiple, (seq_len // multiple + 1) * multiple
        nearest = f"{lower} or {upper}" if lower else f"{upper}"
        raise ValueError(
            f"sequence length {seq_len} is not divisible by 2 x cp = {multiple}; "
            f"pad or truncate it to {nearest} (context_length must be a multiple of {multiple})"
        )


def check_context_length(context_length: int, cp: int) -> None:
    """The ``--context_length`` flag's check: ValueError naming the next valid length unless it
    is a positive multiple of 2 x cp."""
    multiple = 2 * cp
    if context_length <= 0 or context_length % multiple:
        padded = max(multiple, -(-context_length // multiple) * multiple)
        raise ValueError(
            f"--context_length {context_length} must be a multiple of 2 x cp = {multiple} (each row is split "
            f"into 2 x cp equal chunks); the padded length would be {padded}: use --context_length {padded}"
        )


def zigzag_index(seq_len: int, cp_size: int, cp_rank: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Positions (into the full sequence) of the tokens cp rank ``cp_rank`` keeps, in local order."""
    check_seq_len(seq_len, cp_size)
    chunk = seq_len // (2 * cp_size)
    first, second = cp_rank * chunk, (2 * cp_size - 1 - cp_rank) * chunk
    return torch.cat([torch.arange(first, first + chunk), torch.arange(second, second + chunk)]).to(device)


def shard_sequence(x: torch.Tensor, cp_size: int, cp_rank: int, seq_dim: int = 1) -> torch.Tensor:
    """This rank's two zigzag chunks of ``x`` along ``seq_dim``."""
    index = zigzag_index(x.shape[seq_dim], cp_size, cp_rank, device=x.device)
    return x.index_select(seq_dim, index)


def unshard_sequence(shards: list[torch.Tensor], seq_dim: int = 1) -> torch.Tensor:
    """Inverse of :func:`shard_sequence` given every rank's shard, in cp-rank order."""
    cp_size = len(shards)
    pieces = [shard.chunk(2, dim=seq_dim) for shard in shards]
    ordered = [pieces[r][0] for r in range(cp_size)] + [pieces[r][1] for r in reversed(range(cp_size))]
    return torch.cat(ordered, dim=seq_dim)


def document_chunk_count(seq_len: int, cp_size: int) -> int:
    """Chunks of a row under ``layout="documents"``: k x cp for the largest k <= 16 with
    seq_len % (k x cp) == 0 (2 x cp at worst, which every valid length allows)."""
    return next(k * cp_size for k in range(16, 1, -1) if seq_len % (k * cp_size) == 0)


def document_assignment(position_ids: torch.Tensor, cp_size: int, chunks: int = 0) -> list[list[int]]:
    """The chunks (of ``chunks`` equal chunks; 0: :func:`document_chunk_count`) each cp rank
    keeps, in row order, from (B, L) position_ids: Note [Document-aware sharding]."""
    seq_len = position_ids.shape[-1]
    chunks = chunks or document_chunk_count(seq_len, cp_size)
    if chunks % cp_size or seq_len % chunks:
        raise ValueError(
            f"document sharding needs a chunk count that is a multiple of cp ({cp_size}) and divides the "
            f"sequence length ({seq_len}); got chunks={chunks} (0 chooses one)"
        )
    work = visible_pairs_per_token(document_starts(position_ids.reshape(-1, seq_len).cpu()))
    work = work.view(chunks, -1).sum(1).tolist()
    per_rank, load = chunks // cp_size, [0] * cp_size
    assigned: list[list[int]] = [[] for _ in range(cp_size)]
    for j in sorted(range(chunks), key=lambda j: -work[j]):
        rank = min((r for r in range(cp_size) if len(assigned[r]) < per_rank), key=lambda r: load[r])
        assigned[rank].append(j)
        load[rank] += work[j]
    return [sorted(a) for a in assigned]


def document_index(position_ids: torch.Tensor, cp_size: int, cp_rank: int, chunks: int = 0) -> torch.Tensor:
    """Rows of the tokens cp rank ``cp_rank`` keeps under ``layout="documents"``, in local order."""
    seq_len = position_ids.shape[-1]
    assigned = document_assignment(position_ids, cp_size, chunks)
    size = seq_len // (len(assigned[0]) * cp_size)  # tokens per chunk
    return torch.cat([torch.arange(j * size, (j + 1) * size) for j in assigned[cp_rank]]).to(position_ids.device)


def shard_batch(
    batch: Mapping[str, Any], cp: CpGroup, seq_dim: int = 1, *, layout: str = "zigzag", chunks: int = 0
) -> dict[str, Any]:
    """Keep this cp rank's shards of every sequence tensor in ``batch``.

    ``batch["input_ids"]`` (B, L) sets the sequence length L; every tensor whose
    ``seq_dim`` has size L (labels, position_ids, attention_mask, a preference row's
    sequence_ids, ...) is split, everything else passes through (a preference batch's
    (B,) pair_count). ``position_ids`` are created as 0..L-1 when
    missing, because after the split each rank must still know the global
    position of its tokens (RoPE). Labels are expected already shifted
    (labels[t] is the target for input t), so no shift crosses a shard border.
    An ``attention_mask`` that masks anything is refused (the attention has no mask).

    ``layout``: "zigzag" (ring, Ulysses) or "documents" (``cp_strategy="allgather"`` only:
    ``chunks`` chunks, 0 = chosen, balanced by the documents of ``position_ids``; Note
    [Document-aware sharding]). "documents" adds ``batch["seq_index"]``: pass it to the
    model (``causal_lm_loss_sum`` does) and to :func:`unshard`.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"unknown sharding layout {layout!r}; choose one of {LAYOUTS}")
    if "input_ids" not in batch:
        raise KeyError("shard_batch needs batch['input_ids'] (B, L) to know the sequence length")
    check_attention_mask(batch.get("attention_mask"))
    rank, size = cp_rank_and_size(cp)
    input_ids = batch["input_ids"]
    seq_len = input_ids.shape[seq_dim]
    check_seq_len(seq_len, size)
    batch = dict(batch)
    if batch.get("position_ids") is None:
        positions = torch.arange(seq_len, device=input_ids.device)
        batch["position_ids"] = positions.unsqueeze(0).expand(input_ids.shape[0], -1)
    if layout == "zigzag":
        index = zigzag_index(seq_len, size, rank, device=input_ids.device)
    else:
        index = document_index(batch["position_ids"].movedim(seq_dim, -1), size, rank, chunks)
    local = {
        key: value.index_select(seq_dim, index)
        if isinstance(value, torch.Tensor) and value.dim() > seq_dim and value.shape[seq_dim] == seq_len
        else value
        for key, value in batch.items()
    }
    if layout == "documents":
        local[SEQ_INDEX] = index
    return local


def unshard(x: torch.Tensor, cp: CpGroup, seq_dim: int = 1, seq_index: torch.Tensor | None = None) -> torch.Tensor:
    """Gather the full sequence, in row order, from every rank's shard, on every rank (no autograd).
    ``seq_index``: the rows of this rank's tokens (``batch["seq_index"]`` of ``layout="documents"``,
    or any assignment); None: the zigzag layout."""
    rank, size = cp_rank_and_size(cp)
    if size == 1:
        return x if seq_index is None else x.index_select(seq_dim, seq_index.to(x.device).argsort())
    shards = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(shards, x.contiguous(), group=_group(cp))
    if seq_index is None:
        return unshard_sequence(shards, seq_dim)
    indices = [torch.empty_like(seq_index) for _ in range(size)]
    dist.all_gather(indices, seq_index.contiguous(), group=_group(cp))
    return torch.cat(shards, seq_dim).index_select(seq_dim, torch.cat(indices).to(x.device).argsort())


def check_attention_mask(attention_mask: torch.Tensor | None) -> None:
    """Raise unless ``attention_mask`` is None or a 2-D mask of ones (which masks nothing).

    llama-cp's attention is causal over the whole sequence and has no mask input; transformers
    hands an attention function it has no mask builder for ``None`` whatever mask the caller
    gave, so a padding mask must be refused before it reaches the model, not inside it.
    """
    if attention_mask is None:
        return
    if attention_mask.dim() != 2 or not bool(attention_mask.all()):
        raise ValueError(
            "llama-cp's attention is causal over the whole sequence and takes no attention mask: got a "
            f"{attention_mask.dim()}-D attention_mask that masks tokens. Drop the mask and give padded positions "
            "labels=-100 (right padding), so they neither attend nor count"
        )
