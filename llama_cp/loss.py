"""Chunked linear cross-entropy and the global-token normalisation of the loss.

The logits of a long sequence do not fit: Llama 3's vocabulary is 128256, so
131072 tokens of fp32 logits take 64 GiB. :func:`linear_cross_entropy` fuses the
``lm_head`` matmul with the cross-entropy and walks the tokens in chunks; the
backward recomputes each chunk's logits instead of keeping them, so peak
memory is one chunk of logits, not the sequence's.

Normalisation. Every rank returns the *sum* of the cross-entropy of its valid
local tokens; dividing it by the number of valid tokens of the whole optimizer
step (all ranks of dp x cp, all accumulation micro-steps) and letting FSDP
*sum* the gradients over ``dp_shard_cp`` (``shard_model`` sets that up) gives
exactly the gradient of the mean loss a single process would compute.
"""

from __future__ import annotations

import types
from collections.abc import Iterable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from llama_cp.kernels import accumulation_dtype
from llama_cp.models import base_causal_lm

IGNORE_INDEX = -100


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk_size, ignore_index):
        # hidden: (N, d), weight: (V, d), labels: (N,) -> summed loss, float32 scalar
        acc = accumulation_dtype(hidden)
        total = torch.zeros((), dtype=acc, device=hidden.device)
        lse = torch.empty(hidden.shape[0], dtype=acc, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk_size):
            rows = slice(start, start + chunk_size)
            logits = (hidden[rows] @ weight.t()).to(acc)  # (chunk, V)
            lse[rows] = torch.logsumexp(logits, dim=-1)
            valid = labels[rows] != ignore_index
            target = logits.gather(1, labels[rows].clamp(min=0)[:, None]).squeeze(1)
            total += ((lse[rows] - target) * valid).sum()
        ctx.save_for_backward(hidden, weight, labels, lse)
        ctx.chunk_size, ctx.ignore_index = chunk_size, ignore_index
        return total

    @staticmethod
    def backward(ctx, grad_total):
        hidden, weight, labels, lse = ctx.saved_tensors
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        acc = lse.dtype
        grad_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device) if ctx.needs_input_grad[1] else None
        for start in range(0, hidden.shape[0], ctx.chunk_size):
            rows = slice(start, start + ctx.chunk_size)
            valid = labels[rows] != ctx.ignore_index
            # d(lse - logit[label]) / d logits = softmax - onehot(label), zero on ignored rows;
            # computed in place in the recomputed logits, so one (chunk, V) buffer at a time
            grad_logits = (hidden[rows] @ weight.t()).to(acc).sub_(lse[rows, None]).exp_()
            grad_logits.scatter_add_(
                1, labels[rows].clamp(min=0)[:, None], -torch.ones_like(lse[rows, None])
            )
            grad_logits *= (valid * grad_total)[:, None]
            if grad_hidden is not None:
                grad_hidden[rows] = (grad_logits.to(weight.dtype) @ weight).to(hidden.dtype)
            if grad_weight is not None:
                grad_weight.addmm_(grad_logits.t(), hidden[rows].to(acc))
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    chunk_size: int = 4096,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """Sum over valid tokens of cross_entropy(hidden @ weight.T, labels), a float32 scalar
    (float64 for float64 inputs).

    hidden: (..., d), weight: (V, d), labels: (...) already shifted. Never holds
    more than ``chunk_size`` x V logits.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    return _LinearCrossEntropy.apply(
        hidden.reshape(-1, hidden.shape[-1]), weight, labels.reshape(-1), chunk_size, ignore_index
    )


def _head_forward(self: nn.Linear, hidden: torch.Tensor, labels: torch.Tensor | None = None, **_):
    if labels is None:
        return F.linear(hidden, self.weight, self.bias)
    if self.bias is not None:
        raise ValueError("chunked cross-entropy supports an lm_head without bias only")
    return linear_cross_entropy(hidden, self.weight, labels, chunk_size=self.loss_chunk_size)


def enable_chunked_loss(model: nn.Module, chunk_size: int = 4096) -> nn.Module:
    """Give ``model`` a loss path that never builds the logits:

        model(input_ids=..., position_ids=..., loss_labels=labels)  ->  summed CE (float32 scalar)

    ``loss_labels`` are already shifted (labels[t] is the target of input t,
    -100 ignored). Without ``loss_labels`` the model behaves as before (logits).

    The loss goes through the top-level call (so FSDP's root hooks run) and
    through a call of the ``lm_head`` module (so FSDP gathers its weight for the
    call and reduce-scatters its gradient after), which is what makes it work on
    a sharded model. Every Linear inside the head is switched, so peft's
    ``modules_to_save`` copy of ``lm_head`` works too. Works on a peft model.
    """
    causal_lm = base_causal_lm(model)
    linears = [m for m in causal_lm.get_output_embeddings().modules() if isinstance(m, nn.Linear)]
    if not linears:
        raise ValueError(f"{type(causal_lm).__name__}'s output embeddings contain no nn.Linear")
    for linear in linears:
        linear.loss_chunk_size = chunk_size
        linear.forward = types.MethodType(_head_forward, linear)
    causal_lm.forward = types.MethodType(_loss_forward(type(causal_lm).forward), causal_lm)
    return model


def _loss_forward(original_forward):
    def forward(self, input_ids=None, position_ids=None, loss_labels=None, return_correct=False, **kwargs):
        """With ``loss_labels``: the summed loss, and with ``return_correct`` also a bool tensor
        like the labels, True where the argmax prediction equals the label (or it is ignored)."""
        if loss_labels is None:
            return original_forward(self, input_ids=input_ids, position_ids=position_ids, **kwargs)
        hidden = self.get_decoder()(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=kwargs.get("attention_mask"),
            inputs_embeds=kwargs.get("inputs_embeds"),
            use_cache=False,
        ).last_hidden_state
        head = self.get_output_embeddings()
        loss = head(hidden, labels=loss_labels)
        if not return_correct:
            return loss
        labeled = loss_labels != IGNORE_INDEX
        correct = torch.ones_like(loss_labels, dtype=torch.bool)
        correct[labeled] = head(hidden[labeled]).argmax(-1) == loss_labels[labeled]  # logits of labeled tokens only
        return loss, correct

    return forward


def causal_lm_loss_sum(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Summed cross-entropy of the local tokens of ``batch`` (input_ids, position_ids, shifted labels).

    ``enable_chunked_loss(model)`` must have been called.
    """
    return model(input_ids=batch["input_ids"], position_ids=batch.get("position_ids"), loss_labels=batch["labels"])


def count_valid_tokens(
    labels: Iterable[torch.Tensor], group: dist.ProcessGroup | None = None, ignore_index: int = IGNORE_INDEX
) -> int:
    """Valid (non-ignored) labels over all given micro-batches, summed over ``group``
    (default: the whole world, i.e. every dp and cp rank). The loss divisor of one step."""
    labels = list(labels)
    local = sum(int((l != ignore_index).sum()) for l in labels)
    count = torch.tensor([local], dtype=torch.float64, device=labels[0].device if labels else "cpu")
    if dist.is_initialized():
        dist.all_reduce(count, group=group)
    return int(count.item())
