"""Preference losses, single process: the differentiable token losses of the chunked loss, each loss
kind against its formula, and DPO through the chunked loss against plain transformers (loss and every
parameter gradient). The multi-rank checks are in test_preference_loss_world2.py (one process group),
and use this module's batch and reference."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from fsdp_checks import tiny_model
from llama_cp.model.cross_entropy import linear_cross_entropy
from llama_cp.model.loss import enable_chunked_loss
from llama_cp.model.preference import preference_loss, sequence_logps
from llama_cp.modules.families import LogitTransform
from preference_checks import BETA, TOLERANCE, loss_of, pair_batch, reference_logps, reference_losses


def test_token_losses_have_gradients_gradcheck():
    """Both outputs of the chunked loss, the sum and each token's loss, against finite differences
    (float64, a soft-capped family's transform, chunks of 3 with a ragged last one, ignored labels)."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(7, 4, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(9, 4, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 9, (7,), generator=g)
    labels[[1, 5]] = -100
    transform = LogitTransform(scale=0.5, softcap=3.0)

    def both(h, w):
        return linear_cross_entropy(h, w, labels, chunk_size=3, transform=transform, return_token_losses=True)

    assert torch.autograd.gradcheck(lambda h, w: both(h, w)[1], (hidden, weight))  # the token losses alone
    assert torch.autograd.gradcheck(both, (hidden, weight))


def test_token_losses_alone_and_with_the_sum():
    """Gradients of a weighted sum of the token losses, alone and plus the summed loss, equal those
    of the full logits' per-token cross-entropy; without return_token_losses nothing is differentiable
    but the sum."""
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(2, 11, 8, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(30, 8, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 30, (2, 11), generator=g)
    labels[0, :3] = -100
    scale = torch.randn(2, 11, generator=g, dtype=torch.float64)
    for with_sum in (False, True):
        want_losses = F.cross_entropy((hidden @ weight.t()).transpose(1, 2), labels, reduction="none")
        want = (want_losses * scale).sum() + (3 * want_losses.sum() if with_sum else 0)
        want_grads = torch.autograd.grad(want, (hidden, weight))
        total, losses = linear_cross_entropy(hidden, weight, labels, chunk_size=4, return_token_losses=True)
        got = (losses * scale).sum() + (3 * total if with_sum else 0)
        for got_grad, want_grad in zip(torch.autograd.grad(got, (hidden, weight)), want_grads, strict=True):
            torch.testing.assert_close(got_grad, want_grad, atol=1e-12, rtol=1e-12)
    total, correct = linear_cross_entropy(hidden, weight, labels, chunk_size=4, return_correct=True)
    assert total.requires_grad and not correct.requires_grad


def test_sequence_logps_sums_each_sequence_and_skips_unscored_tokens():
    token_logps = torch.tensor([[-1.0, -2.0, -4.0, -8.0], [-16.0, -32.0, -64.0, -128.0]], requires_grad=True)
    ids = torch.tensor([[0, -1, 2, 0], [2, 2, -1, -1]])
    sums = sequence_logps(token_logps, ids, num_sequences=4)
    torch.testing.assert_close(sums, torch.tensor([-9.0, 0.0, -52.0, 0.0], dtype=torch.float64))  # summed in float64
    (grad,) = torch.autograd.grad(sums @ torch.tensor([1.0, 10.0, 100.0, 1000.0], dtype=torch.float64), token_logps)
    torch.testing.assert_close(grad, torch.tensor([[1.0, 0.0, 100.0, 1.0], [100.0, 100.0, 0.0, 0.0]]))
    with pytest.raises(IndexError, match="out of range"):  # never folded into another sequence
        sequence_logps(token_logps, ids, num_sequences=2)


@pytest.mark.parametrize("kind", ["sigmoid", "simpo", "orpo"])
def test_each_kind_matches_its_formula_and_trl_metrics(kind):
    """Losses, their gradients and TRL's metrics, float64, against the published formulas; log-probs
    from -0.05 (ORPO's log(1 - p) near p = 1) to -40."""
    g = torch.Generator().manual_seed(2)
    chosen = -torch.rand(5, generator=g, dtype=torch.float64) * 40 - 0.05
    rejected = -torch.rand(5, generator=g, dtype=torch.float64) * 40 - 0.05
    ref_chosen, ref_rejected = chosen + torch.randn(5, generator=g, dtype=torch.float64), rejected - 1
    lengths = torch.tensor([1, 3, 7, 20, 40]), torch.tensor([2, 1, 9, 40, 3])
    chosen.requires_grad_(), rejected.requires_grad_()
    losses, metrics = loss_of(kind, chosen, rejected, ref_chosen, ref_rejected, *lengths)
    want = reference_losses(kind, chosen, rejected, ref_chosen, ref_rejected, *lengths)
    torch.testing.assert_close(losses, want, atol=1e-12, rtol=1e-12)
    weights = torch.arange(1.0, 6.0, dtype=torch.float64)
    for got_grad, want_grad in zip(torch.autograd.grad(losses @ weights, (chosen, rejected)),
                                   torch.autograd.grad(want @ weights, (chosen, rejected)), strict=True):
        torch.testing.assert_close(got_grad, want_grad, atol=1e-12, rtol=1e-12)
    if kind == "sigmoid":
        logps = chosen, rejected
        rewards = BETA * (chosen - ref_chosen), BETA * (rejected - ref_rejected)
    else:
        logps = chosen / lengths[0], rejected / lengths[1]
        rewards = BETA * logps[0], BETA * logps[1]
    expected = {"rewards/chosen": rewards[0], "rewards/rejected": rewards[1],
                "rewards/margins": rewards[0] - rewards[1], "rewards/accuracies": (rewards[0] > rewards[1]).double(),
                "logps/chosen": logps[0], "logps/rejected": logps[1]}
    if kind == "orpo":
        log_odds = (logps[0] - torch.log(1 - logps[0].exp())) - (logps[1] - torch.log(1 - logps[1].exp()))
        expected.update({"nll_loss": -logps[0], "log_odds_chosen": log_odds,
                         "log_odds_ratio": torch.log(torch.sigmoid(log_odds))})
    assert sorted(metrics) == sorted(expected)
    for name, value in expected.items():
        assert not metrics[name].requires_grad, name
        torch.testing.assert_close(metrics[name], value.detach(), atol=1e-12, rtol=1e-12,
                                   msg=lambda m, name=name: f"{name}: {m}")
    assert 0 < metrics["rewards/accuracies"].sum() < 5  # both outcomes occur


def test_refusals_name_the_flag_and_the_fix():
    one = torch.zeros(1)
    with pytest.raises(ValueError, match=r"unknown --dpo_loss 'ipo'; choose one of sigmoid, simpo, orpo"):
        preference_loss(one, one, one, one, beta=0.1, kind="ipo")
    with pytest.raises(ValueError, match=r"--dpo_loss sigmoid needs the reference model's .*use --dpo_loss simpo"):
        preference_loss(one, one, beta=0.1)
    with pytest.raises(ValueError, match=r"--dpo_loss orpo needs chosen_lengths and rejected_lengths"):
        preference_loss(one, one, beta=0.1, kind="orpo")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_dpo_through_the_chunked_loss_matches_transformers(dtype):
    """model(..., return_token_losses=True) -> sequence_logps -> DPO, on rows of two packed pairs and
    padding: the mean loss over pairs and every parameter gradient equal plain transformers' log_softmax
    summed by hand; the reference model's sums taken the same way without gradients."""
    data = pair_batch()
    reference, ref_model = tiny_model().to(dtype), tiny_model(seed=1).to(dtype)
    model = enable_chunked_loss(copy.deepcopy(reference), chunk_size=7)
    with torch.no_grad():
        ref_chosen, ref_rejected, chosen_lengths, rejected_lengths = reference_logps(ref_model, data)
    chosen, rejected, *_ = reference_logps(reference, data)
    want = reference_losses("sigmoid", chosen, rejected, ref_chosen, ref_rejected, chosen_lengths,
                            rejected_lengths).mean()
    want.backward()

    def summed(m, grad):
        with torch.set_grad_enabled(grad):
            _, token_losses = m(input_ids=data["input_ids"], position_ids=data["position_ids"],
                                loss_labels=data["labels"], return_token_losses=True)
            sums = sequence_logps(-token_losses, data["sequence_ids"], num_sequences=len(chosen) * 2)
        return sums[0::2], sums[1::2]

    got_ref = summed(enable_chunked_loss(ref_model, chunk_size=5), grad=False)
    torch.testing.assert_close(got_ref, (ref_chosen.double(), ref_rejected.double()), **TOLERANCE[dtype])  # float64 sums
    losses, metrics = loss_of("sigmoid", *summed(model, grad=True), *got_ref, chosen_lengths, rejected_lengths)
    loss = losses.sum() / len(losses)
    loss.backward()
    torch.testing.assert_close(loss.to(dtype), want, **TOLERANCE[dtype])
    torch.testing.assert_close(metrics["logps/chosen"].to(dtype), chosen.detach(), **TOLERANCE[dtype])
    compared = 0
    for (name, param), ref_param in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(param.grad, ref_param.grad, **TOLERANCE[dtype],
                                   msg=lambda m, name=name: f"{name}: {m}")
        compared += 1
    assert compared == len(list(reference.parameters())) and math.isfinite(loss.item())
