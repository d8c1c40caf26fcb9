"""Chunked linear cross-entropy and the global-token normalisation of the loss.

The logits of a long sequence do not fit: Llama 3's vocabulary is 128256, so
131072 tokens of fp32 logits take 64 GiB. :func:`linear_cross_entropy` fuses the
``lm_head`` matmul with the cross-entropy and walks the tokens in chunks, taking
the gradients while each chunk's logits exist (or, for preference objectives,
recomputing them in the backward), so peak memory is a few chunks of logits, not
the sequence's.

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
from llama_cp.modules.causal_lm import base_causal_lm
from llama_cp.modules.families import LogitTransform, RouterLoss, check_supported, router_loss
from llama_cp.modules.tiling import tile_starts
from llama_cp.parallel.sharding import SEQ_INDEX


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, transform: LogitTransform, acc: torch.dtype):
    """(logits, tanh) of one chunk in ``acc``: the family's logits of ``hidden @ weight.T``
    (:class:`LogitTransform`), and the tanh term for the backward (None without a softcap). On
    CUDA a half-precision GEMM writes them in float32 itself (Note [The lm_head gradient's GEMM]):
    no half-precision logits and no copy (on an H200 the copies were 74 ms of a 2.3 s LoRA step at
    64K, docs/benchmarks.md), and the logits are not rounded to bf16 first."""
    if acc == torch.float32 and mm_to_accumulation_dtype(weight):
        logits = mm_out_dtype(hidden, weight.t(), acc)
    else:
        logits = (hidden @ weight.t()).to(acc)
    if transform.scale != 1.0:
        logits *= transform.scale
    if transform.softcap is None:
        return logits, None
    tanh = logits.div_(transform.softcap).tanh_()
    return tanh * transform.softcap, tanh


# Note [The lm_head gradient's GEMM]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The weight gradient of the head, sum over chunks of grad_logits^T (V, n) @ hidden (n, d), is
# 2 x V x d FLOPs per token: for Llama 3 8B (V 128256, d 4096) 1.05 GFLOP per token, a fifth of
# a full fine-tuning step at 8K tokens. Its operands are the chunk's fp32 logit gradient and
# the bf16 hidden states. As an fp32 GEMM (SGEMM, no TF32: nothing here enables it) an H100
# does it at ~50-60 TFLOP/s, against ~990 for bf16 tensor cores. So in bf16/fp16 the GEMM takes
# the operands in the compute dtype (the logit gradient rounded to it once, as it already is
# for the hidden states' gradient) and writes fp32: ``torch.mm(a, b, out_dtype=torch.float32)``,
# the tensor cores accumulating in fp32 (aten/src/ATen/native/cuda/Blas.cpp, _mm_dtype_out_cuda:
# fp16/bf16 inputs, fp32 out; in torch since 2.8, and its meta registration in 2.10 and 2.13, so
# the planner's fake tensors run it). The sum over chunks stays in the fp32 gradient buffer.
# torch.mm with out_dtype writes a new tensor; an in-place form (addmm/baddbmm with out_dtype and
# out=) is not usable on every admitted torch (addmm.dtype_out wants `self` in the inputs' dtype
# in the Blas.cpp read, pytorch 960a6846; baddbmm.dtype and, on 2.10, addmm.dtype fail in their
# meta registrations), so the vocabulary is walked in slices whose fp32 product is at most one
# chunk of fp32 logits (n x V x 4 bytes), made after the chunk's fp32 logit gradient is freed,
# so the backward's peak does not grow
# (the planner's baselines, tests/plan/baselines.json, are unchanged by it). Only CUDA has the
# out_dtype kernel (torch's CPU build has none: "Could not run 'aten::mm.dtype' with arguments
# from the 'CPU' backend"), so on CPU the fp32 GEMM stays, and fp32/fp64 models are one in-place
# fp32/fp64 addmm as before.


def mm_to_accumulation_dtype(weight: torch.Tensor) -> bool:
    """Whether the head's weight gradient is a compute-dtype GEMM with an fp32 result (Note [The
    lm_head gradient's GEMM]): half-precision weights on CUDA, and the planner's fake tensors,
    which plan the GPU's run."""
    return weight.dtype in (torch.bfloat16, torch.float16) and (weight.device.type == "cuda" or is_fake(weight))


def accumulate_weight_grad(grad_weight: torch.Tensor, grad_logits: torch.Tensor, hidden: torch.Tensor,
                           chunk_size: int) -> None:
    """grad_weight (V, d) += grad_logits.T (V, n) @ hidden (n, d). Operands of grad_weight's dtype:
    one in-place GEMM; half-precision operands: compute-dtype GEMMs written in grad_weight's dtype,
    one vocabulary slice at a time, each product at most one ``chunk_size`` chunk of fp32 logits
    (Note [The lm_head gradient's GEMM]), whatever the n tokens the GEMM sums over."""
    if grad_logits.dtype == grad_weight.dtype:
        grad_weight.addmm_(grad_logits.t(), hidden.to(grad_weight.dtype))
        return
    vocab, dim = grad_weight.shape
    step = max(1, chunk_size * vocab // dim)  # slice's (step, d) product <= a chunk's (chunk_size, V) logits
    for start in range(0, vocab, step):
        grad_weight[start : start + step] += mm_out_dtype(grad_logits[:, start : start + step].t(), hidden,
                                                          grad_weight.dtype)


def mm_out_dtype(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """a @ b from half-precision operands, accumulated and written in ``dtype`` (CUDA; meta and
    fake tensors): torch.mm's out_dtype."""
    return torch.mm(a, b, out_dtype=dtype)


# Note [Differentiable token losses]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A preference loss (DPO, SimPO, ORPO: llama_cp.model.preference) is a function of per-sequence
# sums of token log-probabilities, so it needs the gradient of each token's loss, not only of
# the sum. Token t's loss is lse_t - logit_t[label_t]; its gradient with respect to the logits
# is the same softmax - onehot(label) row as the sum's. So with upstream gradients g (the sum's,
# a scalar) and h (N,) (the token losses'), row t of the logits' gradient is
#
#     (g + h[t]) * (softmax(logits_t) - onehot(label_t))      (0 on ignored tokens)
#
# one scale per row in the backward's existing chunk loop: no extra logits, nothing more saved.
# ctx.set_materialize_grads(False) makes autograd pass None, not a zero tensor, for an output
# whose gradient nobody asked for, so a caller that only uses the sum (training's
# cross-entropy) pays nothing for it, and one that only uses the token losses gets g = 0.
# Without return_token_losses the (empty) token losses stay non-differentiable, as before.


# Note [The hidden states' gradient in the forward]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# When only the sum is differentiated (SFT), the gradient of the sum with respect to row t of the
# hidden states is g * r_t @ W, and with respect to the head's weight g * sum_t r_t^T h_t, with
# r_t = scale * (softmax(logits_t) - onehot(label_t)) on valid rows and g the sum's upstream
# gradient, a scalar the forward does not know yet. So the forward computes r @ W, and where the
# head trains r^T h, chunk by chunk while the chunk's logits are still there; it keeps them (N x d
# in the hidden states' dtype, the size of the hidden states the backward would otherwise keep; the
# head's V x d in fp32, the buffer the backward allocated first anyway) and the backward multiplies
# them by g. The backward recomputed every chunk's logits (a third GEMM of N x d x V, which at 64K
# tokens of Llama 3 is 69 TFLOP) and their softmax: on one H200 the loss's lm_head GEMMs took 299
# ms of a 2.3 s LoRA step (docs/benchmarks.md, "Where the rest of the LoRA step goes"); taking the
# hidden states' gradient in the forward made that step 2.345 -> 2.211 s (run 4). The same products
# as the backward's, except that g is applied to the results instead of the (chunk, V) logit
# gradient: in bf16 one rounding more (a bf16 step's error against float64 measured 0.00346
# against 0.00335), in fp32 one fp32 rounding of the head's gradient. The forward takes them
# whenever autograd records the call, so a forward whose backward never comes pays the GEMMs once.
# The head's gradient is kept on ctx, not saved: the backward scales it in place (a second backward
# is refused) and --activation_offload does not move it. Its GEMMs sum several chunks each
# (weight_grad_chunks): each writes a V x d fp32 product and adds it into the sum, 8.4 GB of memory
# traffic for Llama 3, so one a 512-token chunk is 1 TB at 64K tokens (about 0.2 s of an H200's 2.9 s
# full step, by arithmetic). Four chunks a GEMM cut that to a quarter for three chunks' bf16 logit
# gradients more; the 8B's planned full fine-tuning peaks (32K-128K) did not move. Differentiable token
# losses (preference objectives: per-token upstream gradients) keep the backward's recomputation.
def _logit_grad_(logits, tanh, lse, labels, row_scale, transform) -> torch.Tensor:
    """d(lse - logit[label]) / d logits = softmax - onehot(label), through the soft-cap's 1 - tanh^2,
    times ``row_scale`` (chunk,): computed in place in ``logits`` (chunk, V), which it returns."""
    logits.sub_(lse[:, None]).exp_()
    logits.scatter_add_(1, labels.clamp(min=0)[:, None], -torch.ones_like(lse[:, None]))
    if tanh is not None:  # d softcap * tanh(x / softcap) / dx = 1 - tanh^2
        logits *= tanh.square_().neg_().add_(1)
    logits *= row_scale[:, None]
    return logits


#: When the forward takes the head's weight gradient (Note [The hidden states' gradient in the
#: forward]), one GEMM sums the logit gradients of as many chunks as fill this many chunks of fp32
#: logits: 4 chunks in bf16/fp16 (one GEMM of 2048 tokens for Llama 3's 512-token chunks, so the fp32
#: V x d product is written and added a quarter as often), 2 in fp32, 1 in fp64.
WEIGHT_GRAD_FP32_CHUNKS = 2


def weight_grad_chunks(operand: torch.dtype) -> int:
    """Chunks a GEMM of the head's weight gradient sums over, its operand in ``operand``."""
    return max(1, WEIGHT_GRAD_FP32_CHUNKS * 4 // torch.empty((), dtype=operand).element_size())


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk_size, ignore_index, transform, return_correct, return_losses=False,
                eager=False):
        # hidden: (N, d), weight: (V, d), labels: (N,) -> summed loss, float32 scalar;
        # correct: (N,) bool, argmax == label or ignored (empty unless return_correct);
        # losses: (N,) each token's loss, 0 where ignored (empty unless return_losses);
        # eager: the gradients now (Note [The hidden states' gradient in the forward])
        acc = accumulation_dtype(hidden)
        total = torch.zeros((), dtype=acc, device=hidden.device)
        lse = torch.empty(hidden.shape[0], dtype=acc, device=hidden.device)
        correct = torch.ones(hidden.shape[0] if return_correct else 0, dtype=torch.bool, device=hidden.device)
        losses = torch.zeros(hidden.shape[0] if return_losses else 0, dtype=acc, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if eager and hidden.requires_grad else None
        grad_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device) if eager and weight.requires_grad \
            else None
        # the weight gradient's GEMM operand: the compute dtype where it is written in fp32 (Note [The lm_head
        # gradient's GEMM]), else the fp32 logit gradient; several chunks' rows per GEMM
        operand = weight.dtype if mm_to_accumulation_dtype(weight) else acc
        group = chunk_size * (weight_grad_chunks(operand) if grad_weight is not None else 1)
        for first in tile_starts(hidden.shape[0], group, hidden):  # Note [Planning tiles], for both loops
            group_rows = slice(first, first + group)
            size = hidden[group_rows].shape[0]
            stacked = hidden.new_empty((size, weight.shape[0]), dtype=operand) if grad_weight is not None else None
            for offset in tile_starts(size, chunk_size, hidden):
                rows = slice(first + offset, first + offset + chunk_size)
                logits, tanh = _chunk_logits(hidden[rows], weight, transform, acc)  # (chunk, V)
                lse[rows] = torch.logsumexp(logits, dim=-1)
                valid = labels[rows] != ignore_index
                target = logits.gather(1, labels[rows].clamp(min=0)[:, None]).squeeze(1)
                chunk_losses = (lse[rows] - target) * valid  # (chunk,)
                total += chunk_losses.sum()
                if return_correct:
                    correct[rows] = (logits.argmax(-1) == labels[rows]) | ~valid
                if return_losses:
                    losses[rows] = chunk_losses
                if eager:
                    grad_logits = _logit_grad_(logits, tanh, lse[rows], labels[rows], valid.to(acc) * transform.scale,
                                               transform)
                    low = grad_logits.to(weight.dtype) if stacked is None else \
                        stacked[offset : offset + chunk_size].copy_(grad_logits)
                    if grad_hidden is not None:
                        grad_hidden[rows] = (low.to(weight.dtype) @ weight).to(hidden.dtype)
                    del grad_logits, low
                del logits, tanh  # before the next chunk's logits are made
            if stacked is not None:
                accumulate_weight_grad(grad_weight, stacked, hidden[group_rows], chunk_size)
                del stacked
        ctx.eager = eager
        ctx.save_for_backward(*((grad_hidden,) if eager else (hidden, weight, labels, lse)))
        ctx.grad_weight = grad_weight  # not a saved tensor: the backward scales it in place, and no hook moves it
        ctx.weight_dtype = weight.dtype
        ctx.chunk_size, ctx.ignore_index, ctx.transform = chunk_size, ignore_index, transform
        # unused outputs' gradients come as None, not zeros (Note [Differentiable token losses])
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(*((correct,) if return_losses else (correct, losses)))
        return total, correct, losses

    @staticmethod
    def backward(ctx, grad_total, _grad_correct, grad_losses):
        nothing = (None,) * 9
        if grad_total is None and grad_losses is None:
            return nothing
        if ctx.eager:
            (grad_hidden,) = ctx.saved_tensors
            grad_weight, ctx.grad_weight = ctx.grad_weight, None
            if grad_weight is None and ctx.needs_input_grad[1]:
                raise RuntimeError("the lm_head's weight gradient was taken in the forward and handed out by the "
                                   "first backward; a second backward through the same loss has none")
            if grad_hidden is not None:
                grad_hidden = (grad_hidden * grad_total).to(grad_hidden.dtype)
            if grad_weight is not None:
                grad_weight = grad_weight.mul_(grad_total).to(ctx.weight_dtype)
            return grad_hidden, grad_weight, *nothing[2:]
        hidden, weight, labels, lse = ctx.saved_tensors
        transform = ctx.transform
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        acc = lse.dtype
        grad_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device) if ctx.needs_input_grad[1] else None
        for start in tile_starts(hidden.shape[0], ctx.chunk_size, hidden):
            rows = slice(start, start + ctx.chunk_size)
            valid = labels[rows] != ctx.ignore_index
            # d(lse - logit[label]) / d logits = softmax - onehot(label), zero on ignored rows;
            # computed in place in the recomputed logits, so one (chunk, V) buffer at a time
            # (two with a softcap, whose tanh the chain rule needs)
            # each token's upstream gradient: the sum's, plus its own loss's (Note [Differentiable token losses])
            upstream = 0.0 if grad_total is None else grad_total
            if grad_losses is not None:
                upstream = upstream + grad_losses[rows]
            grad_logits, tanh = _chunk_logits(hidden[rows], weight, transform, acc)
            grad_logits = _logit_grad_(grad_logits, tanh, lse[rows], labels[rows], valid * upstream * transform.scale,
                                       transform)
            low = grad_logits.to(weight.dtype)  # the GEMMs' operand: grad_logits itself for fp32/fp64
            if grad_hidden is not None:
                grad_hidden[rows] = (low @ weight).to(hidden.dtype)
            if grad_weight is not None and mm_to_accumulation_dtype(weight):
                del grad_logits, tanh  # done with: the slices' fp32 products take its place
                accumulate_weight_grad(grad_weight, low, hidden[rows], ctx.chunk_size)
            elif grad_weight is not None:
                accumulate_weight_grad(grad_weight, grad_logits, hidden[rows], ctx.chunk_size)
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, *nothing[2:]


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    chunk_size: int = 4096,
    ignore_index: int = IGNORE_INDEX,
    transform: LogitTransform = LogitTransform(),
    return_correct: bool = False,
    return_token_losses: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """Sum over valid tokens of cross_entropy(logits, labels), a float32 scalar (float64 for
    float64 inputs), where logits are ``hidden @ weight.T`` through the model family's
    ``transform`` (scale, soft-cap; see ``llama_cp.modules.families``).

    hidden: (..., d), weight: (V, d), labels: (...) already shifted. Never holds
    more than ``chunk_size`` x V logits. With ``return_correct`` also a bool tensor like
    ``labels``: True where the argmax of the logits is the label, or the label is ignored
    (taken from the same chunks, so it costs no extra logits). With ``return_token_losses``
    also (after it) each token's loss, like ``labels`` in the sum's dtype, 0 where ignored:
    the terms of the sum (perplexity by position, ``llama_cp.eval.perplexity``; per-sequence
    log-probabilities, ``llama_cp.model.preference``), differentiable: its gradient joins the
    sum's in the same chunked backward (Note [Differentiable token losses]).
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    # Note [The hidden states' gradient in the forward]
    eager = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad) and not return_token_losses
    total, correct, losses = _LinearCrossEntropy.apply(
        hidden.reshape(-1, hidden.shape[-1]), weight, labels.reshape(-1), chunk_size, ignore_index, transform,
        return_correct, return_token_losses, eager,
    )
    extras = ((correct.reshape(labels.shape),) if return_correct else ()) + \
        ((losses.view(labels.shape).clone(),) if return_token_losses else ())  # not a view: FSDP2 hooks outputs
    return (total, *extras) if extras else total


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
    )


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
