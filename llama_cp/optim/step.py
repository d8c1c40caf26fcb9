"""One optimizer step, as the trainer runs it and the memory planner simulates it.

    total = forward_backward(model, micro_batches, num_tokens)   # gradients accumulated
    grad_norm = apply_gradients(model, optimizer, max_grad_norm=1.0)
    # or both: total, grad_norm = optimizer_step(model, optimizer, micro_batches, num_tokens, max_grad_norm=1.0)

``num_tokens`` is the number of valid labels of the whole step (every rank, every
micro-batch: :func:`llama_cp.model.loss.count_valid_tokens`), so that FSDP's gradient sum is
the single-process gradient of the mean loss (``llama_cp.model.loss``).
"""

from __future__ import annotations

import torch

from llama_cp.fsdp_wrap import activation_offload
from llama_cp.model.loss import causal_lm_loss_sum, router_loss_share
from llama_cp.model.preference import preference_losses


def forward_backward(
    model: torch.nn.Module, micro_batches: list[dict[str, torch.Tensor]], num_tokens: int, *, offload: bool = False
) -> torch.Tensor:
    """Forward+backward of each (cp-sharded) micro-batch, its summed loss divided by
    ``num_tokens`` (the valid tokens of the whole step, all ranks), plus, for an MoE model, this
    rank's share of the router loss averaged over the micro-batches (Note [Router loss under CP]).
    Returns this rank's share of the mean loss; gradients are accumulated (and reduce-scattered
    by FSDP)."""
    total = torch.zeros((), device=micro_batches[0]["input_ids"].device)
    for batch in micro_batches:
        with activation_offload(offload):
            loss = causal_lm_loss_sum(model, batch) / max(num_tokens, 1)
            router = router_loss_share(model)
            if router is not None:
                loss = loss + router / len(micro_batches)
            loss.backward()
        total += loss.detach()
    return total


def preference_forward_backward(
    model: torch.nn.Module, micro_batches: list[dict[str, torch.Tensor]], num_pairs: int, *, kind: str, beta: float,
    gamma: float = 0.5, cp_group=None, offload: bool = False,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Forward+backward of a preference step (``--objective dpo``): each (cp-sharded) micro-batch
    of pairs (``llama_cp.data.preference.batch_sequences``) gives per-pair losses
    (``llama_cp.model.preference.preference_losses``: with kind "sigmoid" against the batch's
    ``reference_logps``, else the adapters-off pass), and their sum divided by ``num_pairs``,
    the pairs of the whole step (every dp rank and micro-batch, each pair once), is
    backpropagated; an MoE model's router loss is added as in :func:`forward_backward`.

    Returns (this dp rank's share of the mean pair loss, the same on every rank of its cp
    group; the sums over its pairs of the pair losses, "loss", and of every metric). The router
    loss is in the gradient, not in the returned loss."""
    total = torch.zeros((), dtype=torch.float64, device=micro_batches[0]["input_ids"].device)
    sums: dict[str, torch.Tensor] = {}
    for batch in micro_batches:
        with activation_offload(offload):
            losses, metrics = preference_losses(model, batch, kind=kind, beta=beta, gamma=gamma, cp_group=cp_group,
                                                reference=batch.get("reference_logps"))
            loss = losses.sum() / max(num_pairs, 1)
            router = router_loss_share(model)
            (loss if router is None else loss + router / len(micro_batches)).backward()
        total += loss.detach().double()
        for name, values in {"loss": losses.detach(), **metrics}.items():
            sums[name] = sums.get(name, 0) + values.double().sum()
    return total, sums


def clip_gradients(model: torch.nn.Module, *, max_grad_norm: float) -> torch.Tensor:
    """Clip the gradients to ``max_grad_norm`` (when > 0). Returns the global gradient norm
    before clipping (the same on every rank)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if max_grad_norm > 0:
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    else:
        grad_norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    return grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm


def apply_gradients(model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, max_grad_norm: float) -> torch.Tensor:
    """Clip (when ``max_grad_norm`` > 0), step, zero the gradients. Returns the global gradient
    norm before clipping."""
    grad_norm = clip_gradients(model, max_grad_norm=max_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm


def optimizer_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: list[dict[str, torch.Tensor]],
    num_tokens: int,
    *,
    max_grad_norm: float,
    offload: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step of this rank: :func:`forward_backward` then :func:`apply_gradients`.
    Returns (this rank's share of the mean loss, the gradient norm). The memory planner
    simulates exactly these two functions."""
    total = forward_backward(model, micro_batches, num_tokens, offload=offload)
    return total, apply_gradients(model, optimizer, max_grad_norm=max_grad_norm)
