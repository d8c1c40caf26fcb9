"""Packed documents that never see each other, on 4 CPU ranks (gloo): cp 1, 2 and 4.

Rows of 1, 2, 7 and 50 documents of random lengths (a document of one token, one
that spans every cp shard, a row that starts inside a document) give the logits,
loss and every gradient of single-process transformers, for ring and Ulysses, with
and without FSDP over dp_shard x cp, full fine-tuning and LoRA, float32 and float64.
All-gather (its document-aware sharding, and any assignment of tokens to ranks) at
cp 2 and 4, plain in both dtypes, FSDP and LoRA once each, and one-document rows.
cp 3 runs in ``test_documents_cp3.py`` (world 3).
"""

import collections
import copy
import dataclasses
import functools
import re

import pytest
import torch
import torch.distributed as dist

from dist_harness import Checks
from document_checks import (
    HEADS, check_documents, check_ring_skips, mesh_for, new_mesh, one_document_batch, one_step_wire_bytes,
    packed_batch, reference_forward, shard_bytes, shard_randomly, sparse_batch,
)
from fsdp_checks import tiny_model
from llama_cp import apply_context_parallel, shard_batch, unshard
from llama_cp.attention import hybrid

WORLD_SIZE = 4
checks = Checks(setup=lambda sizes: [mesh_for(cp, WORLD_SIZE) for cp in sorted(sizes)])  # the cp groups' meshes

for _strategy in ("ring", "ulysses"):
    for _cp in (1, 2, 4):
        if _cp == 1 and _strategy == "ulysses":
            continue  # cp 1 has no strategy
        for _mode in ("plain", "fsdp", "lora"):
            for _dtype in (torch.float32, torch.float64):
                checks.add(
                    functools.partial(
                        lambda s, c, m, d: check_documents(s, mesh_for(c, WORLD_SIZE), m != "plain", d, m == "lora"),
                        _strategy, _cp, _mode, _dtype,
                    ),
                    name=f"{_strategy}_cp{_cp}_{_mode}_{str(_dtype)[6:]}",
                    group=_cp if _mode == "plain" else None,  # Note [Checks side by side] in dist_harness.py
                )

for _cp in (2, 4):
    for _dtype in (torch.float32, torch.float64):
        checks.add(
            functools.partial(lambda c, d: check_documents("allgather", mesh_for(c, WORLD_SIZE), False, d), _cp, _dtype),
            name=f"allgather_cp{_cp}_plain_{str(_dtype)[6:]}", group=_cp,
        )


@checks.add
def allgather_cp4_fsdp_float32():
    check_documents("allgather", mesh_for(4, WORLD_SIZE), True, torch.float32)


@checks.add
def allgather_cp2_lora_float32():
    check_documents("allgather", mesh_for(2, WORLD_SIZE), True, torch.float32, use_lora=True)


@checks.add
def allgather_cp4_one_document_rows_float64():
    """One document per row, computed in tiles of at most 5 queries x 5 keys (Note [Tiled attention])."""
    check_documents("allgather", mesh_for(4, WORLD_SIZE), False, torch.float64, data=one_document_batch(),
                    block_size=5)


@checks.add
def allgather_cp4_any_assignment_float64():
    """Every rank holds random tokens of the row in random order: still exact."""
    check_documents("allgather", mesh_for(4, WORLD_SIZE), False, torch.float64, shard=shard_randomly)

# hybrid (Note [Hybrid attention]): Ulysses over pairs of cp ranks, the ring across the pairs
for _mode in ("plain", "fsdp", "lora"):
    for _dtype in (torch.float32, torch.float64):
        checks.add(
            functools.partial(lambda m, d: check_documents("hybrid", mesh_for(4, WORLD_SIZE), m != "plain", d,
                                                           m == "lora", ulysses_degree=2), _mode, _dtype),
            name=f"hybrid_cp4_u2_{_mode}_{str(_dtype)[6:]}",
        )


@checks.add
def hybrid_cp4_u2_one_document_rows_tiled_float64():
    check_documents("hybrid", mesh_for(4, WORLD_SIZE), False, torch.float64, data=one_document_batch(),
                    block_size=5, ulysses_degree=2)


@checks.add
def hybrid_cp4_u2_skips_blocks_float64():
    """Sparse rows: the outer ring of 2 skips the block rank 0 does not see (Note [Ring transfers])."""
    check_documents("hybrid", mesh_for(4, WORLD_SIZE), False, torch.float64, data=sparse_batch(), ulysses_degree=2)


@checks.add
def hybrid_degenerate_degrees_float64():
    """u = cp is Ulysses and u = 1 the ring; at cp 2 next to a second cp group (dp 2)."""
    for cp, u in ((4, 4), (4, 1), (2, 2), (2, 1)):
        check_documents("hybrid", mesh_for(cp, WORLD_SIZE), False, torch.float64, ulysses_degree=u)


@checks.add
def hybrid_refuses_heads_not_divisible():
    model = tiny_model(num_attention_heads=6, num_key_value_heads=2, hidden_size=48)
    with pytest.raises(ValueError, match=re.escape("--ulysses_degree 4 must divide num_attention_heads (6)")):
        apply_context_parallel(model, mesh_for(4, WORLD_SIZE)["cp"], strategy="hybrid", ulysses_degree=4)


@checks.add(group=2)
def document_sharding_is_refused_by_ring_and_ulysses():
    mesh = mesh_for(2, WORLD_SIZE)
    local = shard_batch(packed_batch()[0], mesh["cp"], layout="documents")
    for strategy in ("ring", "ulysses"):
        model = apply_context_parallel(tiny_model(**HEADS), mesh["cp"], strategy=strategy)
        message = re.escape(f"which only cp_strategy='allgather' can run (this model uses '{strategy}' at cp 2); "
                            "shard it with layout='zigzag' or use --cp_strategy allgather")
        with pytest.raises(ValueError, match=message):
            model(input_ids=local["input_ids"], position_ids=local["position_ids"], seq_index=local["seq_index"])


@checks.add(group=1)
def hf_packing_is_per_document():
    """The reference itself: transformers on packed rows equals each document run alone."""
    model = tiny_model(**HEADS).double()
    data, lengths = packed_batch()
    packed, _ = reference_forward(model, data)
    for row, row_lengths in enumerate(lengths):
        start = 0
        for length in row_lengths:
            piece = slice(start, start + length)
            alone = model(input_ids=data["input_ids"][row : row + 1, piece],
                          position_ids=data["position_ids"][row : row + 1, piece], use_cache=False).logits
            torch.testing.assert_close(packed[row : row + 1, piece], alone, atol=1e-10, rtol=1e-10)
            start += length


@checks.add(group=2)
def document_mask_false_attends_across_documents():
    """--document_mask false: the whole row is one causal sequence (transformers with the
    position_ids of one document), which differs from the packed reference; ring, and
    all-gather on its document-aware shards."""
    mesh = mesh_for(2, WORLD_SIZE)
    reference = tiny_model(**HEADS).double()
    data, _ = packed_batch()
    with torch.no_grad():
        # same rows, but RoPE positions as packed and attention over the whole row: eager with a plain causal mask
        whole_row = reference(input_ids=data["input_ids"], position_ids=data["position_ids"],
                              attention_mask=torch.ones_like(data["input_ids"]), use_cache=False).logits
        packed, _ = reference_forward(reference, data)
    for strategy, layout in (("ring", "zigzag"), ("allgather", "documents")):
        model = apply_context_parallel(copy.deepcopy(reference), mesh["cp"], strategy, document_mask=False)
        local = shard_batch(data, mesh["cp"], layout=layout)
        extra = {"seq_index": local["seq_index"]} if layout == "documents" else {}
        with torch.no_grad():
            got = model(input_ids=local["input_ids"], position_ids=local["position_ids"], **extra).logits
        got = unshard(got, mesh["cp"], seq_index=local.get("seq_index"))
        torch.testing.assert_close(got, whole_row, atol=1e-10, rtol=1e-10)
        assert (got - packed).abs().max() > 1e-3
        if strategy == "allgather":  # rows of one document: one kernel call for all rows, never gathered into varlen
            attention = next(m.cp_attention for m in model.modules() if hasattr(m, "cp_attention"))
            layout = attention.gathered_layout(local["position_ids"], local["seq_index"])
            assert layout.single and all(p.row is None for p in layout.gathered_pieces(4))
            masked = dataclasses.replace(attention, document_mask=True)  # the packed rows' layout: pieces of each row
            assert not masked.gathered_layout(local["position_ids"], local["seq_index"]).single


@checks.add(group=2)
def position_ids_are_required_under_cp():
    mesh = mesh_for(2, WORLD_SIZE)
    model = apply_context_parallel(tiny_model(**HEADS), mesh["cp"])
    local = shard_batch(packed_batch()[0], mesh["cp"])
    with pytest.raises(ValueError, match="without position_ids.*llama_cp.shard_batch"):
        model(input_ids=local["input_ids"])


for _cp in (2, 4):
    for _dtype in (torch.float32, torch.float64):
        checks.add(functools.partial(check_ring_skips, _cp, WORLD_SIZE, _dtype),
                   name=f"ring_skips_blocks_no_query_sees_cp{_cp}_{str(_dtype)[6:]}", group=_cp)


@checks.add
def wire_bytes_match_the_formulas_cp4():
    """Dense rows (packed_batch has a one-document row): the ring sends cp - 1 K/V blocks per
    pass and cp float32 dK/dV hops; Ulysses all-to-alls q, k, v and out (and their gradients)
    with (cp - 1) / cp leaving the rank; all-gather sends its K/V shard to cp - 1 ranks per pass
    and reduce-scatters the row's float32 dK/dV."""
    cp, dtype = 4, torch.float32
    data = packed_batch()[0]
    data = {key: value[:2] for key, value in data.items()}  # as many rows as SPARSE_LENGTHS
    sent, config, _ = one_step_wire_bytes("ring", mesh_for(cp, WORLD_SIZE), dtype, data)
    layers, heads, kv_heads = config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads
    kv = 2 * shard_bytes(config, dtype, kv_heads, cp)
    assert sent == collections.Counter({"ring K/V": 2 * layers * (cp - 1) * kv, "ring dK/dV": layers * cp * kv})
    sent, *_ = one_step_wire_bytes("ulysses", mesh_for(cp, WORLD_SIZE), dtype, data)
    per_pass = shard_bytes(config, dtype, 2 * heads + 2 * kv_heads, cp) * (cp - 1) // cp  # q, out, k, v
    assert sent == collections.Counter({"ulysses all-to-all": 2 * layers * per_pass})
    sent, *_ = one_step_wire_bytes("allgather", mesh_for(cp, WORLD_SIZE), dtype, data)
    assert sent == collections.Counter({"allgather K/V": 2 * layers * (cp - 1) * kv,
                                        "allgather dK/dV": layers * (cp - 1) * kv})



@checks.add
def allgather_cp4_on_the_floor_torch_names_float64():
    """torch 2.10-2.12 have no all_gather_single / reduce_scatter_single (Note [Collective names
    across torch versions]): with them taken away, all-gather is still exact."""
    taken = {name: getattr(dist, name) for name in ("all_gather_single", "reduce_scatter_single") if hasattr(dist, name)}
    for name in taken:
        delattr(dist, name)
    try:
        check_documents("allgather", mesh_for(4, WORLD_SIZE), False, torch.float64)
    finally:
        for name, fn in taken.items():
            setattr(dist, name, fn)


@checks.add
def groups_run_a_collective_before_partial_p2p():
    """Every group the ring's batched P2P uses has had an all-reduce of all of its ranks first
    (Note [Warming up a group]): fresh meshes and hybrid groups, sparse rows where some ranks
    post no transfer at some steps."""
    warmed, unwarmed = set(), []
    all_reduce, batch_isend_irecv = dist.all_reduce, dist.batch_isend_irecv

    def recording_all_reduce(tensor, *args, group=None, **kwargs):
        warmed.add(dist.group.WORLD.group_name if group is None else group.group_name)
        return all_reduce(tensor, *args, group=group, **kwargs)

    def checking_batch(ops):
        unwarmed.extend(op.group.group_name for op in ops if op.group.group_name not in warmed)
        return batch_isend_irecv(ops)

    dist.all_reduce, dist.batch_isend_irecv = recording_all_reduce, checking_batch
    cached = dict(hybrid._HYBRID_GROUPS)
    hybrid._HYBRID_GROUPS.clear()  # made anew below, under the recording
    try:
        check_documents("ring", new_mesh(4, WORLD_SIZE), False, torch.float64, data=sparse_batch())
        check_documents("hybrid", new_mesh(4, WORLD_SIZE), False, torch.float64, data=sparse_batch(),
                        ulysses_degree=2)
    finally:
        dist.all_reduce, dist.batch_isend_irecv = all_reduce, batch_isend_irecv
        hybrid._HYBRID_GROUPS.update(cached)
    assert not unwarmed, f"batched P2P on groups with no collective before: {sorted(set(unwarmed))}"


results = checks.module_fixture(__name__, WORLD_SIZE)


@pytest.mark.parametrize("name", checks.names)
def test_check(results, name):
    checks.assert_passed(results, name)
