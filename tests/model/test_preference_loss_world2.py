"""Preference losses on 2 gloo ranks: DPO (and SimPO, ORPO) on rows of packed pairs whose documents
cross the cp shards, under ring, Ulysses and all-gather at cp 2, with and without FSDP over the
ranks, and over dp_shard 2: the step's loss and every parameter gradient equal single-process
transformers (test_preference_loss.py's batch and reference), float64 tight and float32 to noise."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from dist_harness import Checks
from document_checks import mesh_for
from fsdp_checks import tiny_model
from llama_cp import apply_context_parallel, shard_batch
from llama_cp.fsdp_wrap import shard_model
from llama_cp.model.loss import enable_chunked_loss
from llama_cp.model.preference import sequence_logps
from llama_cp.parallel.sharding import SEQ_INDEX
from test_preference_loss import SEQ_LEN, TOLERANCE, loss_of, pair_batch, reference_logps, reference_losses

WORLD_SIZE = 2
checks = Checks()


@functools.cache
def reference_for(kind: str, dtype: torch.dtype):
    """(pristine model, reference after backward, mean loss, reference model's sums and lengths),
    once per rank for each (kind, dtype): plain transformers on the whole global batch."""
    data = pair_batch()
    reference, ref_model = tiny_model().to(dtype), tiny_model(seed=1).to(dtype)
    pristine = copy.deepcopy(reference)
    with torch.no_grad():
        ref_sums = reference_logps(ref_model, data)
    chosen, rejected, _, _ = reference_logps(reference, data)
    loss = reference_losses(kind, chosen, rejected, *ref_sums).mean()
    loss.backward()
    return pristine, reference, loss.detach(), ref_sums


def check_pairs(strategy: str, cp: int, sharded: bool, dtype: torch.dtype, kinds=("sigmoid",)):
    """One step of each loss kind on this dp rank's rows, sharded over cp (zigzag; all-gather:
    documents), loss = sum of per-pair losses / the step's pairs; its dp total and every gradient
    (FSDP: each rank's shard; plain CP: the cp ranks' shares summed) equal the reference's."""
    tol = TOLERANCE[dtype]
    mesh = mesh_for(cp, WORLD_SIZE)
    cp_mesh, dp_mesh = mesh["cp"], mesh["dp"]
    data = pair_batch()
    pairs = int(data["sequence_ids"].max()) // 2 + 1  # the step's pairs, every dp rank's
    dp, dp_rank = dp_mesh.size(), dp_mesh.get_local_rank()
    rows = {key: value.chunk(dp)[dp_rank] for key, value in data.items()}
    scored = rows["sequence_ids"][rows["sequence_ids"] >= 0]
    first, local_pairs = int(scored.min()) // 2, (int(scored.max()) - int(scored.min()) + 1) // 2
    rows["sequence_ids"] = torch.where(rows["sequence_ids"] >= 0, rows["sequence_ids"] - 2 * first, -1)
    local = shard_batch(rows, cp_mesh, layout="documents" if strategy == "allgather" else "zigzag")
    extra = {SEQ_INDEX: local[SEQ_INDEX]} if SEQ_INDEX in local else {}
    if cp > 1:  # the documents cross the shards: some sequence has tokens on both cp ranks
        held = torch.zeros(2 * pairs, dtype=torch.long)
        held[local["sequence_ids"][local["sequence_ids"] >= 0].unique() + 2 * first] = 1
        dist.all_reduce(held, group=cp_mesh.get_group())
        assert (held == cp).any(), held
    for kind in kinds:
        pristine, reference, ref_loss, ref_sums = reference_for(kind, dtype)
        model = apply_context_parallel(copy.deepcopy(pristine), cp_mesh, strategy=strategy, max_seq_len=SEQ_LEN)
        enable_chunked_loss(model, chunk_size=7)
        if sharded:
            shard_model(model, mesh, param_dtype=None, reduce_dtype=None)
        _, token_losses = model(input_ids=local["input_ids"], position_ids=local["position_ids"],
                                loss_labels=local["labels"], return_token_losses=True, **extra)
        sums = sequence_logps(-token_losses, local["sequence_ids"], 2 * local_pairs, cp_mesh)
        mine = slice(first, first + local_pairs)
        losses, _ = loss_of(kind, sums[0::2], sums[1::2], *(s[mine] for s in ref_sums))
        loss = losses.sum() / pairs
        loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total, group=dp_mesh.get_group())  # the same on every cp rank: summed over dp only
        torch.testing.assert_close(total.to(dtype), ref_loss, **tol)
        grads = [param.grad for param in model.parameters()]
        if not sharded:  # each cp rank holds its tokens' share of every gradient
            flat = torch.cat([grad.reshape(-1) for grad in grads])
            dist.all_reduce(flat, group=cp_mesh.get_group())
            pieces = flat.split([grad.numel() for grad in grads])
            grads = [piece.view(grad.shape) for piece, grad in zip(pieces, grads, strict=True)]
        compared = 0
        for (name, _), grad, ref_param in zip(model.named_parameters(), grads, reference.parameters(), strict=True):
            grad = grad.full_tensor() if isinstance(grad, DTensor) else grad
            torch.testing.assert_close(grad, ref_param.grad, **tol,
                                       msg=lambda m, name=name, kind=kind: f"{kind} {name}: {m}")
            compared += 1
        assert compared == len(list(reference.parameters())) > 0


@checks.add
def ring_cp2_dpo_simpo_orpo_float64():
    check_pairs("ring", 2, False, torch.float64, kinds=("sigmoid", "simpo", "orpo"))


@checks.add
def ulysses_cp2_fsdp_dpo_float32():
    check_pairs("ulysses", 2, True, torch.float32)


@checks.add
def allgather_cp2_dpo_float64():
    check_pairs("allgather", 2, False, torch.float64)


@checks.add
def dp_shard2_fsdp_dpo_float32():
    """Pairs of two dp ranks: each rank's loss divided by the step's pairs, FSDP sums the gradients."""
    check_pairs("ring", 1, True, torch.float32)


results = checks.module_fixture(__name__, WORLD_SIZE)


@pytest.mark.parametrize("name", checks.names)
def test_check(results, name):
    checks.assert_passed(results, name)
