"""The model's loss path and the global-token normalisation of the loss.

:func:`enable_chunked_loss` sends a causal LM's loss through the ``lm_head`` module
into the chunked cross-entropy (:func:`llama_cp.model.cross_entropy.linear_cross_entropy`),
which never builds the [tokens, vocab] logits.

Normalisation. Every rank returns the *sum* of the cross-entropy of its valid
local tokens; dividing it by the number of valid tokens of the whole optimizer
step (all ranks of dp x cp, all accumulation micro-steps) and letting FSDP
*sum* the gradients over ``dp_shard_cp`` (``shard_model`` sets that up) gives
exactly the gradient of the mean loss a single process would compute.

Note [Router loss under CP]
===========================

An MoE family (Mixtral, Qwen3-MoE, OLMoE) adds coef x aux to its loss, with
transformers' ``load_balancing_loss_func`` over every token of the batch and every
layer (N rows in all, E experts, top-k routing):

    aux = E * sum_e (count_e / N) * (prob_e / N)

count_e: how many of the N rows picked expert e among their top k (no gradient);
prob_e: the sum of the rows' softmax router probabilities for e. Under dp x cp a
rank holds some of the rows. Its share is

    aux_r = E * sum_e (count_e / N) * (prob_e,r / N)

with count_e and N summed over every rank (an all-reduce, no gradient) and prob_e,r
its own rows' sum: the shares add up to aux, and so do their gradients, which reach
the router only through prob (``router_loss_share``). FSDP's gradient sum then
gives the single-process gradient, as for the cross-entropy. With gradient
accumulation the loss is computed per micro-batch (its rows on every rank) and
averaged over the micro-batches (``llama_cp.optim.step``).
"""

from __future__ import annotations

import types
from collections.abc import Iterable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from llama_cp.attention.kernels import accumulation_dtype
from llama_cp.data.packing import IGNORE_INDEX  # the rows' label convention (also read as model.loss.IGNORE_INDEX)
from llama_cp.model.cross_entropy import linear_cross_entropy
from llama_cp.modules.causal_lm import base_causal_lm
from llama_cp.modules.families import RouterLoss, check_supported, router_loss
from llama_cp.parallel.sharding import SEQ_INDEX


def _head_forward(self: nn.Linear, hidden: torch.Tensor, labels: torch.Tensor | None = None, return_correct=False,
                  return_token_losses=False):
    if labels is None:
        return F.linear(hidden, self.weight, self.bias)
    if self.bias is not None:
        raise ValueError("chunked cross-entropy supports an lm_head without bias only")
    if return_correct and not return_token_losses and not torch.is_grad_enabled() and not is_fake(labels):
        # evaluation: logits only for the labelled tokens (a passkey row has a handful of them); the
        # planner's fake labels have no values, so it plans the chunked path over all tokens (a bound)
        flat = labels.reshape(-1)
        kept = (flat != IGNORE_INDEX).nonzero().squeeze(1)
        total, kept_correct = linear_cross_entropy(
            hidden.reshape(-1, hidden.shape[-1])[kept], self.weight, flat[kept], chunk_size=self.loss_chunk_size,
            transform=self.logit_transform, return_correct=True,
        )
        correct = torch.ones_like(flat, dtype=torch.bool).index_copy_(0, kept, kept_correct)
        return total, correct.reshape(labels.shape)
    return linear_cross_entropy(
        hidden, self.weight, labels, chunk_size=self.loss_chunk_size, transform=self.logit_transform,
        return_correct=return_correct, return_token_losses=return_token_losses,
        compiled=getattr(self, "loss_compiled", False),  # --compile: llama_cp.modules.compiled
    )


def token_rows(model: nn.Module) -> tuple[int, int]:
    """(rows of ``model``'s input embedding, rows of its output layer): the token ids a batch may
    hold and the labels the loss may score (Apertus 1.5's output layer keeps only the text tokens)."""
    base = base_causal_lm(model)
    head = base.get_output_embeddings()
    head = getattr(head, "original_module", head)  # peft's modules_to_save wrapper
    return base.get_input_embeddings().weight.shape[0], head.weight.shape[0]


def check_token_ids(batch: dict[str, torch.Tensor], embedding_rows: int, head_rows: int) -> None:
    """ValueError naming the token and the fix where a host batch holds a token id beyond the model's
    ``embedding_rows``, or a label beyond its output layer's ``head_rows`` (:func:`token_rows`); on CUDA
    either would stop the run with a device-side assert that names neither."""
    for key, tensor in batch.items():
        if not key.endswith(("input_ids", "labels")) or not tensor.numel():
            continue
        top = int(tensor.max())
        if key.endswith("labels") and top >= head_rows:
            raise ValueError(f"a label is token {top}, but the model's output layer has {head_rows} rows: it cannot "
                             f"be scored (an output layer cut to the text tokens, as Apertus 1.5's output_vocab_size, "
                             f"or a tokenizer larger than the model); leave such tokens out of the data or set their "
                             f"labels to {IGNORE_INDEX}")
        if key.endswith("input_ids") and top >= embedding_rows:
            raise ValueError(f"the batch holds token {top}, but the model's embedding has {embedding_rows} rows: the "
                             f"tokenizer has tokens the model does not (added tokens?); resize the model's embeddings "
                             f"(resize_token_embeddings, then save it) or use the model's own tokenizer")


#: Bounds of the automatic loss chunk (``--loss_chunk_size 0``): one chunk's fp32 logits take at
#: most AUTO_CHUNK_LOGITS_BYTES, and a chunk has at most AUTO_CHUNK_MAX_TOKENS tokens.
AUTO_CHUNK_LOGITS_BYTES = 256 << 20
AUTO_CHUNK_MAX_TOKENS = 4096


def auto_loss_chunk_size(vocab_size: int) -> int:
    """Tokens per loss chunk for a vocabulary of ``vocab_size``: the largest power of two whose
    fp32 logits (tokens x vocab x 4 bytes) fit AUTO_CHUNK_LOGITS_BYTES, at most
    AUTO_CHUNK_MAX_TOKENS (Llama 3, vocab 128256: 512 tokens, 250 MiB; Llama 2, 32000: 2048).
    The backward holds about 1.5 chunks of logits (the fp32 gradient and its matmul-dtype copy)."""
    fitting = max(1, AUTO_CHUNK_LOGITS_BYTES // (4 * vocab_size))
    return min(AUTO_CHUNK_MAX_TOKENS, 1 << (fitting.bit_length() - 1))


def enable_chunked_loss(model: nn.Module, chunk_size: int = 0) -> nn.Module:
    """Give ``model`` a loss path that never builds the logits:

        model(input_ids=..., position_ids=..., loss_labels=labels)  ->  summed CE (float32 scalar)

    ``loss_labels`` are already shifted (labels[t] is the target of input t,
    -100 ignored). Without ``loss_labels`` the model behaves as before (logits).
    ``chunk_size`` tokens per chunk; 0 = :func:`auto_loss_chunk_size` of the vocabulary.

    The loss goes through the top-level call (so FSDP's root hooks run) and
    through a call of the ``lm_head`` module (so FSDP gathers its weight for the
    call and reduce-scatters its gradient after), which is what makes it work on
    a sharded model. Every Linear inside the head is switched, so peft's
    ``modules_to_save`` copy of ``lm_head`` works too. Works on a peft model.
    What the family's forward does to the logits (Granite's scaling, Gemma2's
    soft-cap, ...) is done inside each chunk; unsupported families are refused
    (``llama_cp.modules.families``).
    """
    causal_lm = base_causal_lm(model)
    transform = check_supported(model)
    linears = [m for m in causal_lm.get_output_embeddings().modules() if isinstance(m, nn.Linear)]
    if not linears:
        raise ValueError(f"{type(causal_lm).__name__}'s output embeddings contain no nn.Linear")
    if chunk_size < 0:
        raise ValueError(f"--loss_chunk_size must be >= 0 (0 = auto), got {chunk_size}")
    for linear in linears:
        linear.loss_chunk_size = chunk_size or auto_loss_chunk_size(linear.out_features)
        linear.logit_transform = transform
        linear.forward = types.MethodType(_head_forward, linear)
    causal_lm.forward = types.MethodType(_loss_forward(type(causal_lm).forward), causal_lm)
    return model


def _loss_forward(original_forward):
    def forward(self, input_ids=None, position_ids=None, loss_labels=None, return_correct=False,
                return_token_losses=False, **kwargs):
        """With ``loss_labels``: the summed loss, and with ``return_correct`` also a bool tensor
        like the labels, True where the argmax prediction equals the label (or it is ignored);
        with ``return_token_losses`` also (last) each token's loss (``linear_cross_entropy``)."""
        if loss_labels is None:
            return original_forward(self, input_ids=input_ids, position_ids=position_ids, **kwargs)
        router = router_loss(self)
        outputs = self.get_decoder()(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=kwargs.get("attention_mask"),
            inputs_embeds=kwargs.get("inputs_embeds"),
            use_cache=False,
            **{SEQ_INDEX: kwargs[SEQ_INDEX]} if SEQ_INDEX in kwargs else {},
            **{"output_router_logits": True} if router is not None else {},
        )
        # this call's router statistics, for router_loss_share (Note [Router loss under CP])
        self.router_statistics = None if router is None else router_statistics(outputs.router_logits, router)
        return self.get_output_embeddings()(outputs.last_hidden_state, labels=loss_labels,
                                            return_correct=return_correct, return_token_losses=return_token_losses)

    return forward


def router_statistics(router_logits: tuple[torch.Tensor, ...], router: RouterLoss):
    """(count (E,) float64, no gradient; prob (E,) in the accumulation dtype; rows) of this rank's
    rows of every layer: how many picked each expert in their top k, the sum of their softmax
    probabilities, and how many rows there are (Note [Router loss under CP]). transformers sums
    the probabilities in float32 whatever the model's dtype."""
    acc = accumulation_dtype(router_logits[0])
    count = torch.zeros(router.num_experts, dtype=torch.float64, device=router_logits[0].device)
    prob = torch.zeros(router.num_experts, dtype=acc, device=router_logits[0].device)
    rows = 0
    for logits in router_logits:
        probs = torch.softmax(logits.to(acc), dim=-1)
        picked = torch.topk(probs.detach(), router.top_k, dim=-1).indices
        # index_add_, not bincount: its output's shape is known without reading the indices, so the
        # planner's fake tensors run it (bincount's is data-dependent: they refuse it)
        count.index_add_(0, picked.reshape(-1), torch.ones(picked.numel(), dtype=count.dtype, device=count.device))
        prob = prob + probs.sum(0)
        rows += logits.shape[0]
    return count, prob, rows


def router_loss_share(model: nn.Module, group: dist.ProcessGroup | None = None) -> torch.Tensor | None:
    """This rank's share of coef x the router's load-balancing loss of the model's last loss call
    (``loss_labels``); summed over ``group`` (default: every rank, dp x cp), it is the loss and the
    gradient transformers computes on all of their rows (Note [Router loss under CP]). None for a
    model without one (``families.router_loss``). A collective over ``group``."""
    causal_lm = base_causal_lm(model)
    router = router_loss(causal_lm)
    statistics = causal_lm.__dict__.pop("router_statistics", None)
    if router is None:
        return None
    if statistics is None:
        raise RuntimeError("router_loss_share needs a loss call first (model(..., loss_labels=...))")
    count, prob, rows = statistics
    totals = torch.cat([count, count.new_tensor([rows])])
    if dist.is_initialized():
        dist.all_reduce(totals, group=group)
    count, rows = totals[:-1], totals[-1]
    share = router.num_experts * (count / rows).to(prob.dtype).dot(prob / rows.to(prob.dtype))
    return router.coef * share


def causal_lm_loss_sum(
    model: nn.Module, batch: dict[str, torch.Tensor], *, return_correct: bool = False, return_token_losses: bool = False
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """Summed cross-entropy of the local tokens of ``batch`` (input_ids, position_ids, shifted labels);
    with ``return_correct`` also the per-token "argmax is the label (or ignored)" mask, as eval uses;
    with ``return_token_losses`` also (last) each local token's loss, 0 where ignored, like the labels.

    ``enable_chunked_loss(model)`` must have been called. A batch of ``shard_batch(layout="documents")``
    hands the model its ``seq_index`` too (which rows the rank holds).
    """
    extra = {SEQ_INDEX: batch[SEQ_INDEX]} if SEQ_INDEX in batch else {}
    return model(input_ids=batch["input_ids"], position_ids=batch.get("position_ids"), loss_labels=batch["labels"],
                 return_correct=return_correct, return_token_losses=return_token_losses, **extra)


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
