"""Sequence layout across the cp group: the zigzag (head-tail) split and its inverse.

The sequence is cut into 2 x cp equal chunks and cp rank r keeps chunks r and
2cp-1-r (see Note [Zigzag ring attention] in ``cp_attention.py``)::

    L = 16, cp = 2:   chunks  [0..3] [4..7] [8..11] [12..15]
                      rank 0:  [0..3]                [12..15]
                      rank 1:         [4..7] [8..11]
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

CpGroup = DeviceMesh | dist.ProcessGroup | None


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


def shard_batch(batch: Mapping[str, Any], cp: CpGroup, seq_dim: int = 1) -> dict[str, Any]:
    """Keep this cp rank's zigzag shards of every sequence tensor in ``batch``.

    ``batch["input_ids"]`` (B, L) sets the sequence length L; every tensor whose
    ``seq_dim`` has size L (labels, position_ids, attention_mask, ...) is split,
    everything else passes through. ``position_ids`` are created as 0..L-1 when
    missing, because after the split each rank must still know the global
    position of its tokens (RoPE). Labels are expected already shifted
    (labels[t] is the target for input t), so no shift crosses a shard border.
    An ``attention_mask`` that masks anything is refused (the attention has no mask).
    """
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
    index = zigzag_index(seq_len, size, rank, device=input_ids.device)
    return {
        key: value.index_select(seq_dim, index)
        if isinstance(value, torch.Tensor) and value.dim() > seq_dim and value.shape[seq_dim] == seq_len
        else value
        for key, value in batch.items()
    }


def unshard(x: torch.Tensor, cp: CpGroup, seq_dim: int = 1) -> torch.Tensor:
    """Gather the full sequence from every rank's zigzag shard, on every rank (no autograd)."""
    rank, size = cp_rank_and_size(cp)
    if size == 1:
        return x
    shards = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(shards, x.contiguous(), group=_group(cp))
    return unshard_sequence(shards, seq_dim)


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
