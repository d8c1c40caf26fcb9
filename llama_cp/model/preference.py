"""Preference losses (DPO, SimPO, ORPO) on per-sequence log-probabilities under context parallelism.

A preference row packs pairs as documents: prompt + chosen, prompt + rejected, ... (position_ids
restart at each document, so they never attend to each other). The chunked loss gives each local
token's cross-entropy (``model(..., loss_labels=labels, return_token_losses=True)``, Note
[Differentiable token losses] in ``llama_cp.model.cross_entropy``); its negation is the token's
log-probability. :func:`sequence_logps` sums those of each scored sequence (the completion
tokens) over the cp ranks, and :func:`preference_loss` turns the sums into per-pair losses.
(The pairs' data, tokenizing and packing, is ``llama_cp.data.preference``.)

One step's loss on every rank is ``preference_loss(...)[0].sum() / pairs``, with ``pairs`` the
pairs of the whole optimizer step: every dp rank and accumulation micro-step, counted once per
pair (not once per cp rank that holds a part of it). FSDP's gradient sum over ``dp_shard_cp``
then gives the gradient of the mean over pairs that one process computes (Note [Gradients of a
sum over cp ranks]). The loss's value is the same on every cp rank of a dp rank: a logged
total sums over dp only (or divides by cp).

Note [Gradients of a sum over cp ranks]
=======================================

A sequence's log-probability is a sum of token terms held by several cp ranks (zigzag puts a
long completion on every rank):

    S = sum_r s_r        s_r: rank r's local terms (a function of its local tokens' logits)

Every cp rank computes the same loss L(S) from the all-reduced S and runs its own backward; the
parameter gradient is the FSDP sum over ranks of each rank's backward. The right gradient is

    dL/dtheta = dL/dS * sum_r ds_r/dtheta

so rank r must send dL/dS into its own s_r and nothing into the other ranks' terms (their ranks
do that). Here S is built as

    S = s_r + stopgrad(allreduce(s_r) - s_r)

whose value is the sum and whose gradient with respect to s_r is 1: rank r's backward gives
dL/dS * ds_r/dtheta, and FSDP's sum over the cp ranks adds the terms up. A differentiable
all-reduce (``torch.distributed.nn.functional.all_reduce``) would be wrong here: its backward
all-reduces the upstream gradients too, and since every cp rank holds the same L it hands each
rank cp x dL/dS (it would be right only if L were counted once over the cp group, e.g. divided
by cp). It would also cost a collective in the backward; the form above costs one all-reduce of
(num_sequences,) floats in the forward and none in the backward.

    rank 0 tokens  [s_0 ......]  \\                        / dL/dS -> rank 0's tokens
                                  allreduce -> S -> L(S) -
    rank 1 tokens  [...... s_1]  /  (no grad)              \\ dL/dS -> rank 1's tokens

Note [Preference losses as TRL computes them]
=============================================

Read in huggingface/trl at f2cd577 (1.10.0.dev0, July 2026):

* trl/trainer/dpo_trainer.py, ``DPOTrainer._compute_loss``: logps are the sums of the
  completion tokens' log-probs; ``chosen_logratios = chosen_logps - ref_chosen_logps`` (and
  rejected); loss_type "sigmoid": ``-logsigmoid(beta * (chosen_logratios - rejected_logratios))``
  (label_smoothing 0); metrics ``rewards/chosen = beta * chosen_logratios`` (detached),
  ``rewards/rejected``, ``rewards/accuracies = (chosen > rejected)``, ``rewards/margins =
  chosen - rejected``, ``logps/chosen``, ``logps/rejected`` (the policy's sums).
* trl/experimental/cpo/cpo_trainer.py, ``CPOTrainer.cpo_loss`` with loss_type "simpo": the logps
  are per-token means (``average_log_prob=True``); ``logits = (chosen - rejected) - gamma / beta``,
  loss ``-logsigmoid(beta * logits)`` = ``-logsigmoid(beta * (mean_c - mean_r) - gamma)``;
  rewards ``beta * mean logps``. CPOTrainer adds ``cpo_alpha`` x an NLL term (CPOConfig default
  1.0, set to 0 for "AlphaPO"/SimPO proper); "simpo" here is the SimPO paper's loss, no NLL.
* trl/experimental/orpo/orpo_trainer.py, ``ORPOTrainer.odds_ratio_loss``: per-token mean logps;
  ``log_odds = (mean_c - mean_r) - (log1mexp(mean_c) - log1mexp(mean_r))`` with log1mexp(x) =
  log(1 - exp(x)) branched at -ln 2; loss ``nll - beta * logsigmoid(log_odds)`` (beta is the
  paper's lambda); rewards ``beta * mean logps``; also ``log_odds_ratio`` (logsigmoid(log_odds))
  and ``log_odds_chosen`` (log_odds). Its NLL is the token mean over *all* chosen tokens of the
  batch, prompt included ("orpo chosen nll loss is computed over the full prompt and response").
  Here the default NLL is each pair's chosen completion mean (-mean_c), the ORPO paper's SFT term
  on the response, so a pair's loss does not depend on what else the step holds; a caller that
  wants TRL's form passes ``chosen_nll``.

Differences from TRL, all deliberate: per-pair losses are returned (the caller divides their sum
by the step's pairs, which TRL's per-device ``mean`` equals only for equal micro-batches), and
the metrics are per-pair detached tensors, to be averaged over the step's pairs by the caller.
"""

from __future__ import annotations

import contextlib
import math
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

from llama_cp.model.loss import causal_lm_loss_sum
from llama_cp.parallel.sharding import CpGroup, cp_rank_and_size

#: The preference losses of ``--dpo_loss``: "sigmoid" (DPO), "simpo", "orpo" (Note [Preference
#: losses as TRL computes them]).
PreferenceLossKind = Literal["sigmoid", "simpo", "orpo"]
PREFERENCE_LOSSES: tuple[str, ...] = ("sigmoid", "simpo", "orpo")


def sequence_logps(token_logps: torch.Tensor, sequence_ids: torch.Tensor, num_sequences: int,
                   cp_group: CpGroup = None) -> torch.Tensor:
    """(num_sequences,) the sum of ``token_logps`` of each sequence over every cp rank, on every cp rank.

    token_logps: this rank's per-token log-probabilities, any shape (``-token_losses`` of the
    chunked loss); sequence_ids: like it, the sequence (0 .. num_sequences - 1) each label
    position is scored for, -1 for positions of no scored sequence (prompts, document ends,
    padding); an id >= num_sequences raises (``batch_sequences`` numbers a batch and counts its
    sequences together). The sums are float64, whatever token_logps' dtype (their gradient comes
    back in it). ``cp_group``: the cp mesh or process group
    (None or size 1: no reduction); a collective over it, which every cp rank must call with the
    same num_sequences. Differentiable: each rank's backward reaches only its own tokens, with
    dL/dsum (Note [Gradients of a sum over cp ranks]).
    """
    if token_logps.shape != sequence_ids.shape:
        raise ValueError(f"token_logps {tuple(token_logps.shape)} and sequence_ids {tuple(sequence_ids.shape)} "
                         "must have the same shape: one sequence id per label position")
    ids = sequence_ids.reshape(-1).to(token_logps.device)
    # unscored positions (-1) go to bucket 0, dropped: no boolean indexing, so no shape that depends on
    # the values (nothing waits for the GPU, and the memory planner's fake tensors run it); an id past
    # the last sequence is out of index_add's range (an IndexError, a device assert on CUDA)
    buckets = ids.clamp(min=-1) + 1
    # float64: a 128K-token sum in float32 is off by ~0.01 (and on CUDA index_add's atomics add in any order)
    terms = token_logps.reshape(-1).double()
    local = terms.new_zeros(num_sequences + 1).index_add(0, buckets, terms)[1:]
    if cp_rank_and_size(cp_group)[1] == 1:
        return local
    total = local.detach().clone()
    dist.all_reduce(total, group=cp_group.get_group() if isinstance(cp_group, DeviceMesh) else cp_group)
    return local + (total - local.detach())  # Note [Gradients of a sum over cp ranks]


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x <= 0, without cancellation: log(-expm1(x)) near 0, log1p(-exp(x)) below
    -ln 2 (Maechler, "Accurately Computing log(1 - exp(-|a|))", 2012; TRL's ORPO does the same)."""
    return torch.where(x < -math.log(2), torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def preference_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor | None = None,
    ref_rejected: torch.Tensor | None = None,
    *,
    beta: float,
    kind: PreferenceLossKind = "sigmoid",
    chosen_lengths: torch.Tensor | None = None,
    rejected_lengths: torch.Tensor | None = None,
    gamma: float = 0.5,
    chosen_nll: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(losses (P,), metrics) of P pairs from their summed completion log-probabilities.

    policy_chosen, policy_rejected: (P,) the policy's sums (:func:`sequence_logps`); ref_chosen,
    ref_rejected: (P,) the reference model's (no gradient needed), for kind "sigmoid" only.
    chosen_lengths, rejected_lengths: (P,) completion tokens per sequence (the whole sequence's,
    over every cp rank), for "simpo" and "orpo", whose log-probabilities are per-token means.

    kind "sigmoid" (DPO):  -logsigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r)))
    kind "simpo":          -logsigmoid(beta * (pi_c / len_c - pi_r / len_r) - gamma)
    kind "orpo":           nll_c - beta * logsigmoid(log_odds),   log_odds = log(p_c / (1 - p_c)) -
                           log(p_r / (1 - p_r)) with log p = pi / len; ``beta`` is the paper's lambda;
                           nll_c: ``chosen_nll`` (P,) if given, else -pi_c / len_c (each chosen
                           completion's mean token NLL)

    Computed in float32 at least (float64 inputs stay float64). metrics: TRL's names (Note
    [Preference losses as TRL computes them]), each a detached (P,) tensor: rewards/chosen,
    rewards/rejected (beta * (pi - ref) for DPO, beta * pi / len for SimPO and ORPO),
    rewards/margins, rewards/accuracies (1.0 where chosen > rejected), logps/chosen, logps/rejected
    (the log-probabilities the loss uses: sums for DPO, per-token means otherwise); ORPO adds
    nll_loss, log_odds_ratio and log_odds_chosen.
    """
    if kind not in PREFERENCE_LOSSES:
        raise ValueError(f"unknown --dpo_loss {kind!r}; choose one of {', '.join(PREFERENCE_LOSSES)}")
    if beta <= 0:
        raise ValueError(f"beta must be > 0 for --dpo_loss {kind}, got {beta}")
    dtype = torch.promote_types(policy_chosen.dtype, torch.float32)
    chosen, rejected = policy_chosen.to(dtype), policy_rejected.to(dtype)
    if chosen.shape != rejected.shape:
        raise ValueError(f"policy_chosen {tuple(chosen.shape)} and policy_rejected {tuple(rejected.shape)} "
                         "must hold one value per pair each")
    metrics: dict[str, torch.Tensor] = {}
    if kind == "sigmoid":
        if ref_chosen is None or ref_rejected is None:
            raise ValueError("--dpo_loss sigmoid needs the reference model's ref_chosen and ref_rejected "
                             "log-probabilities; use --dpo_loss simpo or orpo to train without a reference")
        chosen_rewards = beta * (chosen - ref_chosen.to(dtype))
        rejected_rewards = beta * (rejected - ref_rejected.to(dtype))
        losses = -F.logsigmoid(chosen_rewards - rejected_rewards)
    else:
        if chosen_lengths is None or rejected_lengths is None:
            raise ValueError(f"--dpo_loss {kind} needs chosen_lengths and rejected_lengths (completion tokens "
                             "per sequence) for its per-token mean log-probabilities")
        # a sequence of no completion tokens would divide by 0: count it as 1, as TRL does
        chosen = chosen / chosen_lengths.to(device=chosen.device, dtype=dtype).clamp(min=1)
        rejected = rejected / rejected_lengths.to(device=chosen.device, dtype=dtype).clamp(min=1)
        chosen_rewards, rejected_rewards = beta * chosen, beta * rejected
        if kind == "simpo":
            losses = -F.logsigmoid(chosen_rewards - rejected_rewards - gamma)
        else:
            # a mean log-probability of 0 (p = 1 to rounding) would make log(1 - p) -inf and its gradient NaN
            ceiling = -torch.finfo(dtype).eps
            chosen_mean, rejected_mean = chosen.clamp(max=ceiling), rejected.clamp(max=ceiling)
            log_odds = (chosen_mean - rejected_mean) - (log1mexp(chosen_mean) - log1mexp(rejected_mean))
            log_odds_ratio = F.logsigmoid(log_odds)
            nll = -chosen if chosen_nll is None else chosen_nll.to(dtype)
            losses = nll - beta * log_odds_ratio
            metrics.update({"nll_loss": nll.detach(), "log_odds_ratio": log_odds_ratio.detach(),
                            "log_odds_chosen": log_odds.detach()})
    chosen_rewards, rejected_rewards = chosen_rewards.detach(), rejected_rewards.detach()
    metrics.update({
        "rewards/chosen": chosen_rewards,
        "rewards/rejected": rejected_rewards,
        "rewards/margins": chosen_rewards - rejected_rewards,
        "rewards/accuracies": (chosen_rewards > rejected_rewards).to(dtype),
        "logps/chosen": chosen.detach(),
        "logps/rejected": rejected.detach(),
    })
    return losses, metrics


def policy_logps(model: torch.nn.Module, batch: dict[str, torch.Tensor], cp_group: CpGroup = None) -> torch.Tensor:
    """(2P,) each sequence's summed completion log-probability under ``model`` (chunked loss,
    ``enable_chunked_loss``), over every cp rank; ``batch``: this rank's shard of a batch of
    ``llama_cp.data.preference.batch_sequences`` (sequence_ids, sequence_lengths)."""
    _, token_losses = causal_lm_loss_sum(model, batch, return_token_losses=True)
    return sequence_logps(-token_losses, batch["sequence_ids"], batch["sequence_lengths"].numel(), cp_group)


# Note [Switching adapters off under FSDP2]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# peft's ``PeftModel.disable_adapter()`` calls ``enable_adapters(False)`` on every tuner layer,
# which also sets requires_grad=False on the adapter weights, and on exit ``set_adapter`` sets
# it back (peft 0.21.2 and 0.15.1, peft/tuners/tuners_utils.py ``BaseTunerLayer.enable_adapters``;
# ``ModulesToSaveWrapper.enable_adapters`` does the same to its copies). Under FSDP2 those are
# the sharded parameters, whose unsharded bf16 copies FSDP made at its lazy init: after the
# toggle, the next backward hands FSDP a bf16 gradient for a float32 parameter, and torch 2.11+
# refuses it ("attempting to assign a gradient with dtype BFloat16 to a tensor with grad_dtype
# Float"; found on an H200 with --dtype auto, reproduced on CPU with --dtype bfloat16). The
# adapters' forward reads only the ``_disable_adapters`` flag (``disable_adapters``), so the
# reference pass sets that flag on every tuner layer and copy wrapper, and touches nothing else.


@contextlib.contextmanager
def adapters_switched_off(model: torch.nn.Module):
    """Within the block every peft layer of ``model`` (LoRA, DoRA, modules_to_save copies) computes
    its base module alone; no parameter's requires_grad changes (Note [Switching adapters off
    under FSDP2])."""
    layers = [module for module in model.modules() if hasattr(module, "_disable_adapters")]
    if not layers:
        raise ValueError("the model has no peft adapter layers to switch off: DPO's reference model is the base "
                         "of a --use_peft model, and a full fine-tune's is computed once (llama_cp.train.reference)")
    before = [module._disable_adapters for module in layers]
    for module in layers:
        module._disable_adapters = True
    try:
        yield
    finally:
        for module, state in zip(layers, before):
            module._disable_adapters = state


@torch.no_grad()
def adapters_off_logps(model: torch.nn.Module, batch: dict[str, torch.Tensor], cp_group: CpGroup = None) -> torch.Tensor:
    """:func:`policy_logps` of a peft model with its adapters switched off: the base model is DPO's
    reference, with no second copy of the weights (``adapters_switched_off``). No gradient."""
    with adapters_switched_off(model):
        return policy_logps(model, batch, cp_group)


def preference_losses(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], *, kind: PreferenceLossKind, beta: float,
    gamma: float = 0.5, cp_group: CpGroup = None, reference: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(losses (P,), metrics) of the P pairs of ``batch`` (:func:`preference_loss` on the sums of
    :func:`policy_logps`); the same on every cp rank. ``reference``: (2P,) the reference model's
    sums, for kind "sigmoid"; None there means the adapters-off pass of a peft model."""
    if kind == "sigmoid" and reference is None:
        reference = adapters_off_logps(model, batch, cp_group)  # before the policy's forward: its peak is lower
    logps = policy_logps(model, batch, cp_group)
    lengths = batch["sequence_lengths"]
    refs = (reference[0::2], reference[1::2]) if kind == "sigmoid" else (None, None)
    return preference_loss(logps[0::2], logps[1::2], *refs, beta=beta, kind=kind, gamma=gamma,
                           chosen_lengths=lengths[0::2], rejected_lengths=lengths[1::2])
