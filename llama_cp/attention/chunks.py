"""Llama 4's attention under CP: the chunked local attention of its RoPE layers and the query
temperature of its NoPE layers, both of which single-process transformers computes from the row
of each token in the call, which under CP is not the row in a rank's shard.

Note [Chunked attention under CP]
=================================

Llama 4's "chunked_attention" layers (config.layer_types: its RoPE layers) let a query see only
the keys of its own chunk of ``attention_chunk_size`` (C) tokens. transformers builds the chunks
into the mask only (create_chunked_causal_mask, picked per layer type in transformers 5.24
models/llama4/modeling_llama4.py, Llama4TextModel.forward), and llama-cp's attention receives no
mask, so the chunks reach it as a layout: each chunk a document of its own, cut out of the batch's
documents (Note [Document masks under CP] in ``llama_cp/attention/documents.py``):

    chunk_start[t] = max(start[t], t - key[t] % C)          (global rows)

    C = 4, one document:   rows    0 1 2 3 | 4 5 6 7 | 8 9
                           starts  0 0 0 0   4 4 4 4   8 8

key[t] is what transformers' masking_utils.chunked_overlay compares (kv_idx // C == q_idx // C):

- the row index t, in every release through 5.18.0 (read in 4.56.2, 4.57.6, 5.0.0 and 5.18.0:
  the packed documents' mask is and-ed on top), and in 5.24 for a call whose rows each hold one
  document;
- in 5.24, for a call where some row holds several documents (find_packed_sequence_indices), the
  token's position_id, in every row of that call (remap_positions_for_packed_sequence). A row
  that continues a document from position p then has its chunks counted from p, not from its first
  token; which rule a row gets depends on the other rows of the call, in transformers as here
  (``DocumentLayout.starts`` holds every row of the call: under data parallelism, the rank's
  micro-batch, as a transformers process of that rank would count them).

The layout is one like any other, so ring, Ulysses, all-gather and hybrid compute it exactly
through their document paths (a chunk no local query sees is neither computed nor, by the ring,
sent). ContextParallelAttention makes it from the batch's layout (one document per row without
one) for the chunked layers only (its ``chunk=``, from layers.attention_chunk); the full (NoPE)
layers take the batch's documents. The planner runs chunked layers as full ones (an upper bound).

Note [Query temperature under CP]
=================================

Llama 4's NoPE layers (attn_temperature_tuning) scale their queries by

    s(row) = 1 + attn_scale * log1p(floor((row + 1) / floor_scale))       (in float32)

row being the token's row in the call (transformers 5.24 Llama4TextAttention.forward:
arange(S) + the cached tokens; 4.56.2 to 5.0.0: cache_position, the same rows in training;
4.56.2 writes log(x + 1)), not its position_id: packed documents do not restart it. A rank's
call holds its zigzag rows, which the module would scale as rows 0 .. S/cp - 1. So
apply_context_parallel turns the module's own scaling off (its forward reads
``self.attn_temperature_tuning``) and cp_attention_forward scales the queries of the global
rows (``zigzag_index``, or the all-gather's ``local_rows``) with transformers' own ops,
(q * s).to(q.dtype): the same float32 scales and the same product as single-process transformers.
"""

from __future__ import annotations

import dataclasses

import torch
import transformers
from transformers import masking_utils

from llama_cp.attention.documents import DocumentLayout
from llama_cp.modules.families import release

#: transformers 5.24 counts a packed call's chunks by position_ids, earlier releases by rows
#: (Note [Chunked attention under CP]): the function that remaps them came with the change.
CHUNKS_BY_POSITION = hasattr(masking_utils, "remap_positions_for_packed_sequence")
#: transformers 4.56 computes the temperature's log as log(x + 1), 4.57.6 on as log1p(x)
_LOG1P = release(transformers.__version__) >= (4, 57)


def chunked_layout(documents: DocumentLayout, chunk_size: int) -> DocumentLayout:
    """``documents`` with each attention chunk of ``chunk_size`` tokens a document of its own
    (Note [Chunked attention under CP]); ``documents.positions`` (B, L): the call's position_ids.
    Made once per batch: kept in ``documents``' cache for the next chunked layer."""
    if ("chunked", chunk_size) in documents._cache:
        return documents._cache[("chunked", chunk_size)]
    starts = chunk_starts(documents.starts, documents.positions, chunk_size)
    chunked = dataclasses.replace(documents, starts=starts, single=False, _cache={})
    documents._cache[("chunked", chunk_size)] = chunked
    return chunked


def chunk_starts(starts: torch.Tensor, positions: torch.Tensor | None, chunk_size: int) -> torch.Tensor:
    """(B, L) the row where each token's attention chunk starts, from the call's document ``starts``
    and ``positions`` (B, L) (None: count by row) (Note [Chunked attention under CP])."""
    rows = torch.arange(starts.shape[-1], device=starts.device).expand_as(starts)
    packed = positions is not None and bool(starts.any())
    keys = positions.to(starts.device) if packed and CHUNKS_BY_POSITION else rows
    return torch.maximum(starts, rows - keys % chunk_size)


def take_query_temperature(module) -> None:
    """Move a NoPE layer's query temperature from its forward to cp_attention_forward (Note
    [Query temperature under CP]); other modules are left as they are."""
    if getattr(module, "attn_temperature_tuning", False) and not getattr(module, "use_rope", True):
        module.cp_temperature = (module.floor_scale, module.attn_scale)
        module.attn_temperature_tuning = False


def scale_queries(query: torch.Tensor, rows: torch.Tensor, floor_scale: float, attn_scale: float) -> torch.Tensor:
    """query (B, H, S, D) of global ``rows`` (S,) scaled as transformers scales them (Note [Query
    temperature under CP])."""
    steps = torch.floor((rows.float() + 1.0) / floor_scale)
    scales = (torch.log1p(steps) if _LOG1P else torch.log(steps + 1.0)) * attn_scale + 1.0
    return (query * scales.view(1, 1, -1, 1)).to(query.dtype)
