"""The exact CPU kernel of soft-capped attention scores (Note [Soft-capped attention] in
``llama_cp/kernels.py``): out and lse of softcap * tanh(scale q k^T / softcap), and the
backward given the final (out, lse). Layout as in ``kernels``: q (B, H, Sq, D), k/v (B, Hkv,
Sk, D). Its own module so that ``kernels`` and the planner's stand-ins
(``kernel_workspace``) both use it without importing each other.
"""

from __future__ import annotations

import torch

#: query rows per step: the float32 scores held at once are (B, H, SOFTCAP_ROWS, Sk)
SOFTCAP_ROWS = 512


def _accumulation_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _per_kv_head(dx: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(B, Hkv * n_rep, S, D) gradients of repeated K/V heads -> (B, Hkv, S, D), summed per group."""
    b, h, s, d = dx.shape
    return dx.view(b, h // n_rep, n_rep, s, d).sum(2)


def _capped_scores(q, k, causal, scale, softcap, rows: slice):
    """(scores, tanh) of query rows ``rows`` (float32 or float64): softcap * tanh(scale q k^T / softcap),
    the causal square masked; tanh is kept for the backward."""
    scores = q[:, :, rows] @ k.transpose(-1, -2) * scale
    tanh = torch.tanh(scores / softcap)
    scores = softcap * tanh
    if causal:
        index = torch.arange(k.shape[2], device=q.device)
        above = index[None, :] > index[rows, None]  # key after the query
        scores = scores.masked_fill(above, float("-inf"))
    return scores, tanh


def softcap_forward(q, k, v, causal, scale, softcap):
    n_rep, acc = q.shape[1] // k.shape[1], _accumulation_dtype(q)
    qa, ka, va = q.to(acc), k.repeat_interleave(n_rep, 1).to(acc), v.repeat_interleave(n_rep, 1).to(acc)
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:3], dtype=acc, device=q.device)
    for start in range(0, q.shape[2], SOFTCAP_ROWS):
        rows = slice(start, start + SOFTCAP_ROWS)
        scores, _ = _capped_scores(qa, ka, causal, scale, softcap, rows)
        lse[:, :, rows] = torch.logsumexp(scores, dim=-1)
        out[:, :, rows] = (torch.exp(scores - lse[:, :, rows, None]) @ va).to(q.dtype)
    return out, lse


def softcap_backward(dout, q, k, v, out, lse, causal, scale, softcap):
    n_rep, acc = q.shape[1] // k.shape[1], _accumulation_dtype(q)
    qa, ka, va = q.to(acc), k.repeat_interleave(n_rep, 1).to(acc), v.repeat_interleave(n_rep, 1).to(acc)
    dq, dk, dv = torch.empty_like(qa), torch.zeros_like(ka), torch.zeros_like(va)
    for start in range(0, q.shape[2], SOFTCAP_ROWS):
        rows = slice(start, start + SOFTCAP_ROWS)
        scores, tanh = _capped_scores(qa, ka, causal, scale, softcap, rows)
        probs = torch.exp(scores - lse[:, :, rows].to(acc)[..., None])
        da = dout[:, :, rows].to(acc)
        dv += probs.transpose(-1, -2) @ da
        delta = (da * out[:, :, rows].to(acc)).sum(-1, keepdim=True)
        # d(capped)/d(s) = 1 - tanh^2; s = scale q k^T
        dscores = probs * (da @ va.transpose(-1, -2) - delta) * (1 - tanh * tanh) * scale
        dq[:, :, rows] = dscores @ ka
        dk += dscores.transpose(-1, -2) @ qa[:, :, rows]
    return dq.to(q.dtype), _per_kv_head(dk, n_rep).to(k.dtype), _per_kv_head(dv, n_rep).to(v.dtype)
