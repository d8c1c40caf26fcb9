"""Packed-document checks shared by the world-4 (cp 1, 2, 4) and world-3 (cp 3) test modules.

The reference is plain single-process transformers on the whole packed rows: with
restarting ``position_ids`` and no attention mask it masks across documents itself
(``masking_utils.find_packed_sequence_indices``); ``hf_packing_is_per_document``
checks that this reference is indeed every document run on its own.
"""

from __future__ import annotations

import collections
import copy
import functools

import torch
import torch.nn.functional as F
from peft import LoraConfig, get_peft_model

from fsdp_checks import check_cp_against_reference, tiny_config_as, tiny_model
from llama_cp import ParallelDims, apply_context_parallel, shard_batch
from llama_cp.attention.wire import wire_bytes
from llama_cp.parallel.sharding import SEQ_INDEX

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
    input_ids = torch.randint(3, VOCAB, (len(DOCUMENTS_PER_ROW), SEQ_LEN), generator=g)
    all_lengths = [document_lengths(count, g) for count in DOCUMENTS_PER_ROW]
    for lengths, count in zip(all_lengths, DOCUMENTS_PER_ROW):
        assert sum(lengths) == SEQ_LEN and len(lengths) == count, lengths
    batch = documents_batch(input_ids, all_lengths)
    batch["labels"][0, :4] = -100
    batch["labels"][2, 10:13] = -100
    return batch, all_lengths


def documents_batch(input_ids: torch.Tensor, all_lengths: list[list[int]]) -> dict[str, torch.Tensor]:
    """Rows of ``input_ids`` packed with documents of the given lengths: position_ids restarting
    at every document (a one-document row continues one, from 3), labels shifted within each."""
    labels = torch.full_like(input_ids, -100)
    position_ids = torch.empty_like(input_ids)
    for row, lengths in enumerate(all_lengths):
        start = 0
        for length in lengths:
            first = 3 if len(lengths) == 1 else 0
            position_ids[row, start : start + length] = torch.arange(first, first + length)
            labels[row, start : start + length - 1] = input_ids[row, start + 1 : start + length]
            start += length
    return {"input_ids": input_ids, "labels": labels, "position_ids": position_ids}


def documents_alone(model, batch: dict[str, torch.Tensor], all_lengths: list[list[int]]) -> torch.Tensor:
    """The logits of ``batch``'s packed rows (``documents_batch`` of ``all_lengths``) with each document run
    alone through ``model``, put back in their rows: the reference a packed row's logits must equal."""
    rows = []
    for row, lengths in enumerate(all_lengths):
        pieces = (batch[key][row].split(lengths) for key in ("input_ids", "position_ids"))
        rows.append(torch.cat([model(input_ids=ids[None], position_ids=positions[None]).logits[0]
                               for ids, positions in zip(*pieces, strict=True)]))
    return torch.stack(rows)


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


def windowed_model(window: int, seed: int = 0):
    """The tiny model of HEADS as a Qwen2 whose second layer has a sliding window of ``window``
    tokens and whose first is full (``max_window_layers``: Note [Sliding windows under CP])."""
    from transformers import Qwen2ForCausalLM

    config = tiny_config_as("qwen2", HEADS, use_sliding_window=True, sliding_window=window, max_window_layers=1)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    assert [layer.self_attn.sliding_window for layer in model.model.layers] == [None, window]
    return model


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


def _data_key(data: dict[str, torch.Tensor]) -> tuple:
    return tuple((key, value.dtype, tuple(value.shape), value.numpy().tobytes()) for key, value in sorted(data.items()))


_REFERENCES: dict = {}


def reference_for(dtype: torch.dtype, use_lora: bool, window: int | None, data: dict[str, torch.Tensor]):
    """(pristine, reference, logits, loss): the model of :func:`check_documents` (tiny, or
    :func:`windowed_model`; LoRA), ``pristine`` an untouched copy of it, ``reference`` the same
    after single-process transformers' forward on ``data`` and its backward. Built once per rank
    for each (dtype, LoRA, window, batch) and shared by every check of that case: the checks copy
    ``pristine`` and only read ``reference``'s gradients."""
    key = (dtype, use_lora, window, _data_key(data))
    if key not in _REFERENCES:
        reference = (tiny_model(**HEADS) if window is None else windowed_model(window)).to(dtype)
        if use_lora:
            reference = lora(reference)
        pristine = copy.deepcopy(reference)
        ref_logits, ref_loss = reference_forward(reference, data)
        ref_loss.backward()
        _REFERENCES[key] = (pristine, reference, ref_logits.detach(), ref_loss.detach())
    return _REFERENCES[key]


def check_documents(strategy: str, mesh, sharded: bool, dtype: torch.dtype, use_lora: bool = False, *,
                    data: dict[str, torch.Tensor] | None = None, shard=None, block_size: int = 0,
                    ulysses_degree: int = 0, window: int | None = None):
    """Logits, loss and every gradient of packed rows (or ``data``) under CP equal single-process
    transformers; ``shard``: how the batch is sharded (default: the strategy's layout);
    ``block_size``: the attention's tiles (Note [Tiled attention]); ``window``: the model of
    :func:`windowed_model`."""
    tol = TOLERANCE[dtype]
    data = packed_batch()[0] if data is None else data
    pristine, reference, ref_logits, ref_loss = reference_for(dtype, use_lora, window, data)
    check_cp_against_reference(copy.deepcopy(pristine), reference, data, ref_logits, ref_loss, mesh,
                               strategy=strategy, sharded=sharded, tol=tol, max_seq_len=SEQ_LEN, shard=shard,
                               block_size=block_size, ulysses_degree=ulysses_degree)


@functools.cache
def mesh_for(cp: int, world_size: int):
    """A (1, world_size / cp, cp) mesh, built once per cp in the same order on every rank."""
    return new_mesh(cp, world_size)


def new_mesh(cp: int, world_size: int):
    """A mesh built anew (its groups made now)."""
    return ParallelDims(dp_shard=world_size // cp, cp=cp).build_mesh("cpu")


#: short documents that mostly stay inside the zigzag chunks (12 tokens at cp 4, 24 at cp 2),
#: so a rank's queries see nothing of most other ranks' blocks (Note [Ring transfers])
SPARSE_LENGTHS = [[12, 18, 6, 12, 24, 12, 12], [24, 12, 36, 24]]


def sparse_batch():
    tokens = torch.randint(3, VOCAB, (len(SPARSE_LENGTHS), SEQ_LEN), generator=torch.Generator().manual_seed(5))
    return documents_batch(tokens, SPARSE_LENGTHS)


def seen_blocks(cp: int, all_lengths: list[list[int]] = SPARSE_LENGTHS, window: int | None = None) -> torch.Tensor:
    """(cp, cp) bool, from the dense (L, L) masks of rows of documents of ``all_lengths`` (and a
    sliding ``window``): [t, s] whether a query of zigzag rank t sees a key of rank s in some row."""
    chunk = torch.arange(SEQ_LEN) // (SEQ_LEN // (2 * cp))
    owner = torch.where(chunk < cp, chunk, 2 * cp - 1 - chunk)
    seen = torch.zeros(cp, cp, dtype=torch.bool)
    rows = torch.arange(SEQ_LEN)
    in_window = torch.ones(SEQ_LEN, SEQ_LEN, dtype=torch.bool) if window is None else (
        rows[:, None] - rows[None, :] < window)
    for lengths in all_lengths:
        document = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
        mask = (document[:, None] == document[None, :]) & torch.ones(SEQ_LEN, SEQ_LEN, dtype=torch.bool).tril()
        mask &= in_window
        for t in range(cp):
            for s in range(cp):
                seen[t, s] |= bool(mask[owner == t][:, owner == s].any())
    return seen


def one_step_wire_bytes(strategy: str, mesh, dtype: torch.dtype, data, model=None):
    """What this rank sends in one forward + backward of the tiny model (or ``model``), its config
    and cp rank."""
    model = tiny_model(**HEADS) if model is None else model
    model = apply_context_parallel(model.to(dtype), mesh["cp"], strategy=strategy)
    local = shard_batch(data, mesh["cp"], layout="documents" if strategy == "allgather" else "zigzag")
    extra = {"seq_index": local["seq_index"]} if strategy == "allgather" else {}
    with wire_bytes() as meter:
        model(input_ids=local["input_ids"], position_ids=local["position_ids"], **extra).logits.sum().backward()
    return meter.sent, model.config, mesh["cp"].get_local_rank()


def shard_bytes(config, dtype: torch.dtype, heads: int, cp: int) -> int:
    """Bytes of one (B, heads, L / cp, head_dim) shard of the test batch."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return len(SPARSE_LENGTHS) * heads * (SEQ_LEN // cp) * head_dim * dtype.itemsize


def check_ring_skips(cp: int, world_size: int, dtype: torch.dtype):
    """Exact, and a block goes only to the ranks that see it: K/V in forward and again in
    backward, and each rank's share of a block's dK/dV (float32, float64 for float64) straight
    back to its owner; the counts follow the dense masks."""
    mesh = mesh_for(cp, world_size)
    check_documents("ring", mesh, False, dtype, data=sparse_batch())
    sent, config, rank = one_step_wire_bytes("ring", mesh, dtype, sparse_batch())
    seen = seen_blocks(cp)
    assert not bool(seen.all())  # some transfers are skipped
    kv = 2 * shard_bytes(config, dtype, config.num_key_value_heads, cp)
    sends, receives = int(seen[:, rank].sum()) - 1, int(seen[rank].sum()) - 1
    layers = config.num_hidden_layers
    assert sent == collections.Counter({"ring K/V": 2 * layers * sends * kv, "ring dK/dV": layers * receives * kv}), (
        sent, seen)
