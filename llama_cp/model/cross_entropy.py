"""The chunked linear cross-entropy: the ``lm_head`` GEMM fused with the cross-entropy,
walking the tokens in chunks so that a sequence's [tokens, vocab] logits never exist (Llama
3's vocabulary is 128256: 131072 tokens of fp32 logits take 64 GiB). The gradients are taken
while each chunk's logits exist (Note [The hidden states' gradient in the forward]), or, for
the token losses of preference objectives, in a backward that recomputes them. The model's
loss path around it is :mod:`llama_cp.model.loss`."""

from __future__ import annotations

import functools

import torch
from torch._subclasses.fake_tensor import is_fake

from llama_cp.attention.kernels import accumulation_dtype
from llama_cp.data.packing import IGNORE_INDEX
from llama_cp.modules.families import LogitTransform
from llama_cp.modules.tiling import tile_starts


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
def _logit_grad_(logits, tanh, lse, labels, row_scale) -> torch.Tensor:
    """d(lse - logit[label]) / d logits = softmax - onehot(label), through the soft-cap's 1 - tanh^2,
    times ``row_scale`` (chunk,): computed in place in ``logits`` (chunk, V), which it returns."""
    return _grad_from_exps_(logits.sub_(lse[:, None]).exp_(), None, tanh, labels, row_scale)


def _grad_from_exps_(exps, sums, tanh, labels, row_scale) -> torch.Tensor:
    """The same from ``exps`` = exp(logits - c) per row and their row sums (None: the softmax
    itself), in place: exps x row_scale / sums, less row_scale at each label, through 1 - tanh^2."""
    row_scale = row_scale.to(exps.dtype)
    exps.mul_((row_scale if sums is None else row_scale / sums)[:, None])
    exps.scatter_add_(1, labels.clamp(min=0)[:, None], -row_scale[:, None])
    if tanh is not None:  # d softcap * tanh(x / softcap) / dx = 1 - tanh^2
        exps *= tanh.square_().neg_().add_(1)
    return exps


def _lse_and_exps_(logits) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logsumexp, exp(logits - rowmax) in place in ``logits``, their row sums): the log-sum-exp
    torch.logsumexp computes, without its (chunk, V) temporary, and the exponentials kept for the
    gradient (Note [One softmax a chunk])."""
    top = logits.amax(dim=-1)
    top.masked_fill_(top.abs() == float("inf"), 0)  # as torch.logsumexp does
    exps = logits.sub_(top[:, None]).exp_()
    sums = exps.sum(dim=-1)
    return top + sums.log(), exps, sums


# Note [One softmax a chunk]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~
# A forward that takes the gradients (Note [The hidden states' gradient in the forward]) passed
# over each chunk's (chunk, V) fp32 logits with torch.logsumexp (aten/src/ATen/native/ReduceOps.cpp,
# logsumexp_out_impl: amax, then (self - maxes).exp_() into a new tensor, then its sum), and then
# again with exp(logits - lse) for the softmax and a multiply by the row scale. _lse_and_exps_ and
# _grad_from_exps_ subtract the row max and exponentiate in place once, take one row sum for both
# the log-sum-exp and the softmax, and scale each row by row_scale / sum in one multiply: two
# read-write passes of the chunk fewer and no logsumexp temporary (one chunk of fp32 logits). At
# 64K tokens of Llama 3 that is about 135 GB less memory traffic, some 30 ms of the 2.2 s LoRA step
# by arithmetic (run 4's profile: 256 calls each of the fp32 add and exp kernels, 84 ms; not yet
# measured). The same formulas as torch's, the rounding different in the last fp32 bit.


def _gradient_chunk_(logits, tanh, labels, ignore_index: int, scale: float, acc: torch.dtype, return_correct: bool,
                     low: torch.Tensor | None, weight_dtype: torch.dtype):
    """One chunk of a forward that takes the gradients (Note [The hidden states' gradient in the forward]):
    its (chunk, V) ``logits`` (and soft-cap ``tanh``) from :func:`_chunk_logits` turned in place into
    their gradient; returns (lse, summed loss, argmax == label or ignored (None without
    ``return_correct``), the gradient as the GEMMs' operand: written into ``low`` (the weight gradient's
    stacked rows) when given, else in ``weight_dtype``). The same function eager and compiled (Note [A
    compiled loss chunk])."""
    valid = labels != ignore_index
    target = logits.gather(1, labels.clamp(min=0)[:, None]).squeeze(1)
    correct = (logits.argmax(-1) == labels) | ~valid if return_correct else None
    row_scale = valid.to(acc) * scale
    if torch.compiler.is_compiling():  # expressions inductor fuses without a chunk-sized buffer of its own
        top = logits.amax(dim=-1)
        top = top.masked_fill(top.abs() == float("inf"), 0)
        lse = top + (logits - top[:, None]).exp().sum(dim=-1).log()
        label = torch.arange(logits.shape[1], device=logits.device) == labels.clamp(min=0)[:, None]
        grad = ((logits - lse[:, None]).exp() - label) * row_scale[:, None]
        grad_logits = grad if tanh is None else grad * (1 - tanh.square())
        if low is None and weight_dtype == logits.dtype:
            grad_logits = logits.copy_(grad_logits)  # in place, as eager
    else:
        lse, exps, sums = _lse_and_exps_(logits)  # Note [One softmax a chunk]
        grad_logits = _grad_from_exps_(exps, sums, tanh, labels, row_scale)
    loss = ((lse - target) * valid).sum()
    return lse, loss, correct, grad_logits.to(weight_dtype) if low is None else low.copy_(grad_logits)


# Note [A compiled loss chunk]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Under --compile the chunks of a forward that takes the gradients run _gradient_chunk_ through
# torch.compile, so that its elementwise passes over the (chunk, V) fp32 logits fuse: eager, each
# of max, subtract, exp, row sum, scale, the label's subtraction and the cast to the GEMMs' dtype
# is a kernel that reads (and most write) the whole chunk, about nine fp32 passes; compiled, the
# row max and the row sum read the chunk once each and one kernel reads it again and writes the
# gradient as the GEMMs' operand (compute dtype, or the weight gradient's stacked rows). Run 4's
# profile of the 64K LoRA step (4 layers, docs/gpu_report/h200_2026-11-28_run4_profile.json) had
# some 180 ms of such kernels, 256 calls each of the fp32 add and exp; not yet measured compiled.
# The GEMMs stay outside, eager (cuBLAS; torch.mm's out_dtype on CUDA: Note [The lm_head
# gradient's GEMM]).
# - Code: the function's compiled branch (torch.compiler.is_compiling) writes the same formulas
#   so that inductor needs no chunk-sized buffer: the softmax as exp(logits - lse), recomputed
#   where the gradient is written, instead of the row sum's exponentials kept in place (inductor
#   would store them), and the label's subtraction as a comparison in the same expression instead
#   of scatter_add_ (a chunk-sized buffer of its own). Equal to eager up to rounding (tests: the
#   loss, the argmax check and both gradients in float32 on CPU, soft-capped and scaled logits, a
#   shorter last chunk; bf16 through the half-precision GEMM's CPU stand-in).
# - Memory: it allocates nothing of (chunk, V) but the compute-dtype operand, which eager's cast
#   makes too; fp32 without stacked rows, it writes the gradient into the logits' own buffer, as
#   eager does (read in inductor's generated code at torch 2.13, with and without a soft-cap). So
#   the planner, which plans the eager chunk (fake tensors take it), plans the compiled one too.
# The backward's recomputing chunks (token losses of preference objectives) and the forward
# without gradients (evaluation) stay eager.
@functools.cache
def _compiled_gradient_chunk():
    return torch.compile(_gradient_chunk_)


#: When the forward takes the head's weight gradient (Note [The hidden states' gradient in the
#: forward]), one GEMM sums the logit gradients of as many chunks as fill this many chunks of fp32
#: logits: 4 chunks in bf16/fp16 (one GEMM of 2048 tokens for Llama 3's 512-token chunks, so the fp32
#: V x d product is written and added a quarter as often), 2 in fp32, 1 in fp64.
WEIGHT_GRAD_FP32_CHUNKS = 2


def weight_grad_chunks(operand: torch.dtype) -> int:
    """Chunks a GEMM of the head's weight gradient sums over, its operand in ``operand``."""
    return max(1, WEIGHT_GRAD_FP32_CHUNKS * 4 // operand.itemsize)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk_size, ignore_index, transform, return_correct, return_losses=False,
                eager=False, compiled=False):
        # hidden: (N, d), weight: (V, d), labels: (N,) -> summed loss, float32 scalar;
        # correct: (N,) bool, argmax == label or ignored (empty unless return_correct);
        # losses: (N,) each token's loss, 0 where ignored (empty unless return_losses);
        # eager: the gradients now (Note [The hidden states' gradient in the forward]), through
        # torch.compile when compiled (Note [A compiled loss chunk])
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
        gradient_chunk = _compiled_gradient_chunk() if compiled and not is_fake(hidden) else _gradient_chunk_
        for first in tile_starts(hidden.shape[0], group, hidden):  # Note [Planning tiles], for both loops
            group_rows = slice(first, first + group)
            size = hidden[group_rows].shape[0]
            stacked = hidden.new_empty((size, weight.shape[0]), dtype=operand) if grad_weight is not None else None
            for offset in tile_starts(size, chunk_size, hidden):
                rows = slice(first + offset, first + offset + chunk_size)
                logits, tanh = _chunk_logits(hidden[rows], weight, transform, acc)  # (chunk, V)
                if eager:
                    lse[rows], chunk_loss, chunk_correct, low = gradient_chunk(
                        logits, tanh, labels[rows], ignore_index, transform.scale, acc, return_correct,
                        None if stacked is None else stacked[offset : offset + chunk_size], weight.dtype)
                    del logits, tanh  # (low may be them: fp32 without a stacked buffer)
                    total += chunk_loss
                    if return_correct:
                        correct[rows] = chunk_correct
                    if grad_hidden is not None:
                        grad_hidden[rows] = (low.to(weight.dtype) @ weight).to(hidden.dtype)
                    del low
                    continue
                valid = labels[rows] != ignore_index
                target = logits.gather(1, labels[rows].clamp(min=0)[:, None]).squeeze(1)
                if return_correct:
                    correct[rows] = (logits.argmax(-1) == labels[rows]) | ~valid
                lse[rows] = torch.logsumexp(logits, dim=-1)
                chunk_losses = (lse[rows] - target) * valid  # (chunk,)
                total += chunk_losses.sum()
                if return_losses:
                    losses[rows] = chunk_losses
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
        nothing = (None,) * 10
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
            grad_logits = _logit_grad_(grad_logits, tanh, lse[rows], labels[rows], valid * upstream * transform.scale)
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
    compiled: bool = False,
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
    sum's in the same chunked backward (Note [Differentiable token losses]). ``compiled``: a forward
    that takes the gradients runs its chunks through torch.compile (Note [A compiled loss chunk]).
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    # Note [The hidden states' gradient in the forward]
    eager = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad) and not return_token_losses
    total, correct, losses = _LinearCrossEntropy.apply(
        hidden.reshape(-1, hidden.shape[-1]), weight, labels.reshape(-1), chunk_size, ignore_index, transform,
        return_correct, return_token_losses, eager, compiled,
    )
    extras = ((correct.reshape(labels.shape),) if return_correct else ()) + \
        ((losses.view(labels.shape).clone(),) if return_token_losses else ())  # not a view: FSDP2 hooks outputs
    return (total, *extras) if extras else total
