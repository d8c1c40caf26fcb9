"""The preference losses' shared test material: rows of packed pairs (``pair_batch``), their
log-probabilities and losses computed by hand with plain transformers (``reference_logps``,
``reference_losses``), and ``check_pairs``, one multi-rank step of the loss on those rows against
them (tests/model/test_preference_loss*.py, and at cp 4 tests/modules/test_families.py)."""

from __future__ import annotations

import copy
import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from document_checks import mesh_for
from fsdp_checks import tiny_model
from llama_cp import apply_context_parallel, shard_batch
from llama_cp.fsdp_wrap import shard_model
from llama_cp.model.loss import enable_chunked_loss
from llama_cp.model.preference import preference_loss, sequence_logps
from llama_cp.parallel.sharding import SEQ_INDEX

SEQ_LEN = 48
#: per row: the (prompt, chosen, rejected) lengths of each pair, then an unscored padding
#: document; documents prompt + chosen and prompt + rejected, so 14, 11, 7, 13 (+ 3) and 9, 17, 14, 5 (+ 3):
#: at cp 2 the zigzag chunks are 12 tokens, and most documents cross one
PAIRS = [[(5, 9, 6), (3, 4, 10)], [(2, 7, 15), (4, 10, 1)]]
BETA, GAMMA = 0.7, 0.3
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float64: dict(atol=1e-10, rtol=1e-10)}


def pair_batch(rows=PAIRS, seed: int = 4) -> dict[str, torch.Tensor]:
    """Rows of packed pairs: input_ids, position_ids (restarting at every document), labels shifted
    within each document, and sequence_ids (per label position: 2 k for pair k's chosen completion,
    2 k + 1 for its rejected one, numbered along the rows; -1 elsewhere)."""
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, 96, (len(rows), SEQ_LEN), generator=g)
    labels = torch.full_like(input_ids, -100)
    position_ids = torch.empty_like(input_ids)
    sequence_ids = torch.full_like(input_ids, -1)
    pair = 0
    for row, pairs in enumerate(rows):
        start = 0
        documents = []
        for prompt, chosen, rejected in pairs:
            prompt_ids = input_ids[row, start : start + prompt].clone()
            documents += [(prompt, chosen, 2 * pair), (prompt, rejected, 2 * pair + 1)]
            input_ids[row, start + prompt + chosen : start + 2 * prompt + chosen] = prompt_ids  # same prompt
            start += 2 * prompt + chosen + rejected
            pair += 1
        documents.append((SEQ_LEN - start, 0, -1))  # padding: labelled, not scored
        start = 0
        for prompt, completion, sequence in documents:
            length = prompt + completion
            position_ids[row, start : start + length] = torch.arange(length)
            labels[row, start : start + length - 1] = input_ids[row, start + 1 : start + length]
            # label position t scores token t + 1: the completion's tokens are scored at prompt - 1 .. length - 2
            sequence_ids[row, start + prompt - 1 : start + length - 1] = sequence
            start += length
        assert start == SEQ_LEN
    return {"input_ids": input_ids, "position_ids": position_ids, "labels": labels, "sequence_ids": sequence_ids}


def reference_logps(model, data, rows=PAIRS) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(chosen, rejected, chosen lengths, rejected lengths), (P,) each: plain transformers on the whole
    rows, log_softmax, the labels' log-probabilities summed by hand over each completion."""
    logits = model(input_ids=data["input_ids"], position_ids=data["position_ids"], use_cache=False).logits
    logps = torch.log_softmax(logits, dim=-1)
    chosen, rejected = [], []
    for row, pairs in enumerate(rows):
        start = 0
        for prompt, *completions in pairs:
            for completion, out in zip(completions, (chosen, rejected), strict=True):
                tokens = data["input_ids"][row, start + prompt : start + prompt + completion]
                predicted_by = logps[row, start + prompt - 1 : start + prompt + completion - 1]
                out.append(predicted_by.gather(1, tokens[:, None]).sum())
                start += prompt + completion
    lengths = torch.tensor([[c, r] for pairs in rows for _, c, r in pairs], dtype=torch.float64)
    return torch.stack(chosen), torch.stack(rejected), lengths[:, 0], lengths[:, 1]


def reference_losses(kind, chosen, rejected, ref_chosen, ref_rejected, chosen_lengths, rejected_lengths):
    """(P,) the published formulas, written out: DPO (Rafailov et al. 2023, eq. 7), SimPO (Meng et al.
    2024, eq. 6), ORPO (Hong et al. 2024, eqs. 4-7) with the chosen completion's mean NLL as its SFT term."""
    if kind == "sigmoid":
        return -F.logsigmoid(BETA * ((chosen - ref_chosen) - (rejected - ref_rejected)))
    chosen_mean = chosen / chosen_lengths.to(chosen.dtype)
    rejected_mean = rejected / rejected_lengths.to(chosen.dtype)
    if kind == "simpo":
        return -F.logsigmoid(BETA * chosen_mean - BETA * rejected_mean - GAMMA)
    p_chosen, p_rejected = chosen_mean.exp(), rejected_mean.exp()
    odds_ratio = (p_chosen / (1 - p_chosen)) / (p_rejected / (1 - p_rejected))
    return -chosen_mean - BETA * torch.log(torch.sigmoid(torch.log(odds_ratio)))


def loss_of(kind, chosen, rejected, ref_chosen, ref_rejected, chosen_lengths, rejected_lengths):
    """preference_loss with the test's beta and gamma; the lengths only where the kind takes them."""
    lengths = {} if kind == "sigmoid" else dict(chosen_lengths=chosen_lengths, rejected_lengths=rejected_lengths)
    return preference_loss(chosen, rejected, ref_chosen, ref_rejected, beta=BETA, kind=kind, gamma=GAMMA, **lengths)


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
    mesh = mesh_for(cp, dist.get_world_size())  # also from test_families' world of 4 (cp 4)
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
    if cp > 1:  # the documents cross the shards: some sequence has tokens on several cp ranks
        held = torch.zeros(2 * pairs, dtype=torch.long)
        held[local["sequence_ids"][local["sequence_ids"] >= 0].unique() + 2 * first] = 1
        dist.all_reduce(held, group=cp_mesh.get_group())
        assert (held > 1).any(), held  # some sequence is cut by the shards
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
