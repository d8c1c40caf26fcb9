"""Packed-document checks shared by the world-4 (cp 1, 2, 4) and world-3 (cp 3) test modules.

The reference is plain single-process transformers on the whole packed rows: with
restarting ``position_ids`` and no attention mask it masks across documents itself
(``masking_utils.find_packed_sequence_indices``); ``hf_packing_is_per_document``
checks that this reference is indeed every document run on its own.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from peft import LoraConfig, get_peft_model

from fsdp_checks import check_cp_against_reference, tiny_model
from llama_cp import ParallelDims
from llama_cp.sharding import SEQ_INDEX

VOCAB, SEQ_LEN = 96, 96  # 96 is a multiple of 2 x cp for cp 1, 2, 3 and 4
#: documents per row of the test batch; the 1-document row starts inside a document
DOCUMENTS_PER_ROW = (1, 2, 7, 50)
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float64: dict(atol=1e-10, rtol=1e-10)}


def document_lengths(count: int, g: torch.Generator) -> list[int]:
    """``count`` random lengths summing to SEQ_LEN, with a document of length 1 whenever
    count > 2; two documents are one that spans every cp shard and a short one."""
    if count == 1:
        return [SEQ_LEN]
    if count == 2:
        return [SEQ_LEN - 5, 5]
    cuts = (torch.randperm(SEQ_LEN - 2, generator=g)[: count - 2] + 1).sort().values.tolist()
    lengths = [b - a for a, b in zip([0, *cuts], [*cuts, SEQ_LEN - 1])]
    position = int(torch.randint(0, count, (1,), generator=g))
    return lengths[:position] + [1] + lengths[position:]


def packed_batch(seed: int = 3) -> tuple[dict[str, torch.Tensor], list[list[int]]]:
    """One row per entry of DOCUMENTS_PER_ROW: random tokens, position_ids restarting at
    every document, labels pre-shifted within each document (-100 at its last token) with a
    few more ignored. Returns (batch, document lengths per row)."""
    g = torch.Generator().manual_seed(seed)
    rows = len(DOCUMENTS_PER_ROW)
    input_ids = torch.randint(3, VOCAB, (rows, SEQ_LEN), generator=g)
    labels = torch.full_like(input_ids, -100)
    position_ids = torch.empty_like(input_ids)
    all_lengths = []
    for row, count in enumerate(DOCUMENTS_PER_ROW):
        lengths = document_lengths(count, g)
        assert sum(lengths) == SEQ_LEN and len(lengths) == count, lengths
        all_lengths.append(lengths)
        start = 0
        for index, length in enumerate(lengths):
            first = 3 if count == 1 else 0  # the one-document row continues a document
            position_ids[row, start : start + length] = torch.arange(first, first + length)
            labels[row, start : start + length - 1] = input_ids[row, start + 1 : start + length]
            start += length
    labels[0, :4] = -100
    labels[2, 10:13] = -100
    return {"input_ids": input_ids, "labels": labels, "position_ids": position_ids}, all_lengths


def reference_forward(model, batch):
    """Single-process transformers on the whole packed rows: (logits, mean CE)."""
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
    loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)
    return logits, loss


def lora(model):
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    torch.manual_seed(1)
    return get_peft_model(model, config)


#: 12 query heads split evenly for Ulysses at cp 2, 3 and 4; 4 KV heads (GQA)
HEADS = dict(num_attention_heads=12, num_key_value_heads=4, hidden_size=48)


def one_document_batch() -> dict[str, torch.Tensor]:
    """The tokens of :func:`packed_batch` as one document per row (labels shifted along the row)."""
    data, _ = packed_batch()
    labels = torch.cat([data["input_ids"][:, 1:], torch.full((data["input_ids"].shape[0], 1), -100)], dim=1)
    return {"input_ids": data["input_ids"], "labels": labels, "position_ids": torch.arange(SEQ_LEN).expand_as(labels)}


def shard_randomly(batch, cp_mesh):
    """Any assignment of tokens to ranks: each rank keeps a random quarter, third, ... of the
    row's tokens in random order (the same on every rank), named by ``seq_index``."""
    rank, cp = cp_mesh.get_local_rank(), cp_mesh.size()
    index = torch.randperm(SEQ_LEN, generator=torch.Generator().manual_seed(7)).view(cp, -1)[rank]
    return {**{key: value.index_select(1, index) for key, value in batch.items()}, SEQ_INDEX: index}


def check_documents(strategy: str, mesh, sharded: bool, dtype: torch.dtype, use_lora: bool = False, *,
                    data: dict[str, torch.Tensor] | None = None, shard=None, block_size: int = 0):
    """Logits, loss and every gradient of packed rows (or ``data``) under CP equal single-process
    transformers; ``shard``: how the batch is sharded (default: the strategy's layout);
    ``block_size``: the attention's tiles (Note [Tiled attention])."""
    tol = TOLERANCE[dtype]
    reference = tiny_model(**HEADS).to(dtype)
    if use_lora:
        reference = lora(reference)
    model = copy.deepcopy(reference)
    data = packed_batch()[0] if data is None else data
    ref_logits, ref_loss = reference_forward(reference, data)
    ref_loss.backward()

    check_cp_against_reference(model, reference, data, ref_logits, ref_loss, mesh, strategy=strategy,
                               sharded=sharded, tol=tol, max_seq_len=SEQ_LEN, shard=shard, block_size=block_size)


def mesh_for(cp: int, world_size: int):
    return ParallelDims(dp_shard=world_size // cp, cp=cp).build_mesh("cpu")
