"""A sequence's log-probability summed over the cp ranks (Note [Gradients of a sum over cp ranks] in
llama_cp/model/preference.py), in one process: each cp rank of a simulated group is run in turn on its
zigzag shard, the group's all-reduce adding the other ranks' local sums (computed first, without a
group). Every rank must get the whole sequences' sums, and a gradient that reaches its own tokens
only. The same over real gloo ranks, through the model and FSDP: test_preference_loss_world2.py
(slow)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from fsdp_checks import tiny_model
from llama_cp.model.loss import enable_chunked_loss
from llama_cp.model.preference import policy_logps, preference_loss, preference_losses, sequence_logps
from llama_cp.parallel.sharding import shard_sequence
from preference_checks import BETA, PAIRS, pair_batch


class SimulatedCp:
    """Rank ``rank`` of a cp group of ``size``; its all-reduce (a sum) adds ``others``, the local
    sums of the other ranks. ``reductions`` counts the all-reduces."""

    def __init__(self, rank: int, size: int, others: torch.Tensor):
        self.rank, self.size, self.others, self.reductions = rank, size, others, 0


@pytest.fixture
def simulated_collectives(monkeypatch):
    """torch.distributed's rank, size and all-reduce answer for a SimulatedCp group (no process group)."""
    get_rank, get_world_size, all_reduce = dist.get_rank, dist.get_world_size, dist.all_reduce

    def reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if not isinstance(group, SimulatedCp):
            return all_reduce(tensor, op=op, group=group, async_op=async_op)
        assert op == dist.ReduceOp.SUM and not async_op
        group.reductions += 1
        tensor += group.others.to(tensor.dtype)

    monkeypatch.setattr(dist, "get_rank",
                        lambda group=None: group.rank if isinstance(group, SimulatedCp) else get_rank(group))
    monkeypatch.setattr(dist, "get_world_size",
                        lambda group=None: group.size if isinstance(group, SimulatedCp) else get_world_size(group))
    monkeypatch.setattr(dist, "all_reduce", reduce)


def _sequences() -> int:
    return 2 * sum(len(pairs) for pairs in PAIRS)


@pytest.mark.parametrize("cp", [2, 3])
def test_every_cp_rank_gets_the_whole_sums_and_its_own_tokens_gradient(simulated_collectives, cp):
    ids = pair_batch()["sequence_ids"]  # (2, 48): 8 completions, most cut by the zigzag chunks at cp 2 and 3
    count = _sequences()
    token_logps = -torch.rand(ids.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    weights = torch.linspace(1, 2, count, dtype=torch.float64)  # dL/dS of each sequence
    want = sequence_logps(token_logps, ids, count)
    shards = [(shard_sequence(token_logps, cp, r).requires_grad_(), shard_sequence(ids, cp, r)) for r in range(cp)]
    locals_ = [sequence_logps(logps.detach(), shard_ids, count) for logps, shard_ids in shards]
    assert sum((local != 0).long() for local in locals_).max() > 1  # some sequence is held by several ranks
    for rank, (logps, shard_ids) in enumerate(shards):
        group = SimulatedCp(rank, cp, sum(locals_) - locals_[rank])
        got = sequence_logps(logps, shard_ids, count, group)
        assert group.reductions == 1
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        (grad,) = torch.autograd.grad(got @ weights, logps)
        # dL/dS into this rank's own scored tokens, nothing more (the other ranks' backward does theirs)
        scored = shard_ids >= 0
        torch.testing.assert_close(grad[scored], weights[shard_ids[scored]])
        assert (grad[~scored] == 0).all()


def test_a_preference_step_on_each_cp_rank_scores_the_whole_pairs(simulated_collectives):
    """``preference_losses`` with a cp group: every rank's losses are those of the whole sequences' sums
    (the ranks' local sums added), not of its own part of them."""
    data = pair_batch()
    data["sequence_lengths"] = torch.tensor([n for pairs in PAIRS for _, *completion in pairs for n in completion])
    model = enable_chunked_loss(tiny_model()).double()
    reference = -torch.linspace(20, 40, _sequences(), dtype=torch.float64)
    cp = 2
    shards = [{key: (shard_sequence(value, cp, r) if value.dim() == 2 else value) for key, value in data.items()}
              for r in range(cp)]
    with torch.no_grad():
        locals_ = [policy_logps(model, shard) for shard in shards]
    whole = sum(locals_)
    want, _ = preference_loss(whole[0::2], whole[1::2], reference[0::2], reference[1::2], beta=BETA, kind="sigmoid")
    for rank, shard in enumerate(shards):
        group = SimulatedCp(rank, cp, whole - locals_[rank])
        with torch.no_grad():
            losses, metrics = preference_losses(model, shard, kind="sigmoid", beta=BETA, cp_group=group,
                                                reference=reference)
        torch.testing.assert_close(losses, want, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(metrics["logps/chosen"], whole[0::2], rtol=1e-10, atol=1e-10)
