"""Learned attention sinks (gpt_oss's ``s_aux``): one step after a strategy's final merge, and
its gradient. Layouts as in ``kernels``: out (B, H, S, D), lse (B, H, S), sinks (H,).

Note [Attention sinks under CP]
===============================

gpt_oss gives every query head h a learned logit s_h (``GptOssAttention.sinks``) that
joins each query row's softmax as one extra column, with value zero and never masked
(transformers 5.24 models/gpt_oss/modeling_gpt_oss.py, ``eager_attention_forward``:
``torch.cat([attn_weights, sinks], dim=-1)``, softmax, the sink's column dropped):

    keys:    k_0   k_1  ...  k_j   | sink
    logit:   s_0   s_1  ...  s_j   | s_h       (s_h: the same for every row of head h)
    value:   v_0   v_1  ...  v_j   | 0

With ``lse`` and ``out`` the log-sum-exp and output of a row over all its real keys
(what the ring, all-gather, Ulysses and hybrid merges produce), the sink column gives

    lse' = logaddexp(lse, s_h)
    out' = out * exp(lse - lse')               (= out * sigmoid(lse - s_h))

It enters ONCE, after the final merge (``add_sinks``): merged into every block, or on
every rank, it would count once per block. The autograd functions that finish a merge call
it, and ``sink_gradient`` in their backward: ``_RingAttention`` (ring; hybrid's ring over
its heads), ``_AllGatherAttention``, ``_LocalAttention`` and ``_PiecesAttention`` (cp 1,
Ulysses' and hybrid's local heads; packed documents, windows and tiles). A row that sees no key (lse = -inf) gets
out' = 0, lse' = s_h. Sliding windows and documents only decide which real keys are in
``lse``, so they combine with the sink unchanged.

Backward. Every kernel's backward takes the final (out, lse) of a row and recomputes the
probabilities as exp(s - lse) (FlashAttention-2's trick, ``kernels.attention_backward``);
given (out', lse') those are the probabilities of the softmax with the sink column, and
its D = rowsum(dO * out') is the right one too, because the sink's value is zero: so the
q/k/v gradients are exact with no change to any kernel (flash-attn's, torch's CUDA and CPU
kernels and the math one all take out and lse and compute D themselves; checked on CPU,
tests/modules/test_gpt_oss.py). The sink's own gradient
(``sink_gradient``), P_sink = exp(s_h - lse'), dP_sink = dO . 0 = 0:

    d s_h = sum_rows P_sink * (dP_sink - D) = -sum_rows exp(s_h - lse'_row) * rowsum(dO_row * out'_row)

over the rows this rank computes. Like every parameter's, the sinks' gradient is a sum
over the cp group (FSDP's reduce-scatter over dp_shard x cp, ``shard_model``): the ring
and all-gather ranks hold all heads of their own rows, Ulysses' ranks all rows of their
slice of the heads after the all-to-all (``local_sinks``; hybrid: the slice of its
Ulysses group), and the gradient of a slice is zero on the other heads.

The step is applied to the merged output in the output's dtype: in bf16 one more
rounding (at most 2^-8 relative) than if it were applied to the float32 accumulators.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def add_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out', lse') of Note [Attention sinks under CP]: the sink column of each head merged into
    a row's final (out, lse); out' in out's dtype, lse' in lse's."""
    sink = sinks.detach().to(lse.dtype)[:, None]  # (H, 1): every row of a head
    merged = torch.logaddexp(lse, sink)
    weight = torch.exp(lse - merged).masked_fill(lse == float("-inf"), 0.0)  # no key seen: out' = 0
    return (out.to(lse.dtype) * weight[..., None]).to(out.dtype), merged


def sink_gradient(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """d sinks (H,) of this rank's rows, given the rows' (out', lse') (Note [Attention sinks under CP])."""
    acc = lse.dtype
    delta = (dout.to(acc) * out.to(acc)).sum(-1)  # (B, H, S): rowsum(dO * out')
    p_sink = torch.exp(sinks.detach().to(acc)[:, None] - lse).masked_fill(lse == float("-inf"), 0.0)
    return -(p_sink * delta).sum((0, 2)).to(sinks.dtype)


def local_sinks(sinks: torch.Tensor | None, group: dist.ProcessGroup) -> torch.Tensor | None:
    """The sinks of the heads this rank holds after Ulysses' all-to-all over ``group``
    (``ulysses._seq_to_heads``: rank j receives head group j); differentiable."""
    if sinks is None:
        return None
    heads = sinks.shape[0] // dist.get_world_size(group)
    return sinks.narrow(0, dist.get_rank(group) * heads, heads)
