"""The exact CPU attention kernel for what torch's CPU kernels do not compute: soft-capped
scores (Note [Soft-capped attention] in ``llama_cp/attention/windows.py``) and sliding windows (Note
[Sliding windows under CP] in ``llama_cp/attention/documents.py``). It returns out and the lse of a
block, and takes the final (out, lse) in its backward, as every kernel of ``kernels`` does.
Layout as in ``kernels``: q (B, H, Sq, D), k/v (B, Hkv, Sk, D). Its own module so that
``kernels`` and the planner's stand-ins (``workspace``) both use it without importing
each other.

The mask, in the call's own indices (query i, key j): ``causal`` hides j > i; ``lag``
(a window) hides i - j > lag; ``lead`` hides j - i > lead (the planner's flash-attn stand-in,
whose windows have a right side too). A row that sees no key gets out = 0 and lse = -inf,
and no gradient.
"""

from __future__ import annotations

import torch

#: query rows per step: the float32 scores held at once are (B, H, DENSE_ROWS, Sk)
DENSE_ROWS = 512


def _accumulation_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _per_kv_head(dx: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(B, Hkv * n_rep, S, D) gradients of repeated K/V heads -> (B, Hkv, S, D), summed per group."""
    b, h, s, d = dx.shape
    return dx.view(b, h // n_rep, n_rep, s, d).sum(2)


def _hidden(rows: slice, num_q: int, num_k: int, lag: int | None, lead: int | None, device) -> torch.Tensor | None:
    """(rows, Sk) True where query i of ``rows`` does not see key j; None when every pair is seen."""
    if lag is None and lead is None:
        return None
    i = torch.arange(num_q, device=device)[rows, None]
    j = torch.arange(num_k, device=device)[None, :]
    hidden = torch.zeros(i.shape[0], num_k, dtype=torch.bool, device=device)
    if lead is not None:
        hidden |= j - i > lead
    if lag is not None:
        hidden |= i - j > lag
    return hidden


def _scores(q, k, scale, softcap, lag, lead, rows: slice):
    """(scores, tanh, hidden) of query rows ``rows`` (float32 or float64): scale q k^T, capped to
    softcap * tanh(. / softcap) when ``softcap`` (tanh kept for the backward, else None), the
    hidden pairs at -inf (``hidden`` None when none is)."""
    scores = q[:, :, rows] @ k.transpose(-1, -2) * scale
    tanh = None
    if softcap:
        tanh = torch.tanh(scores / softcap)
        scores = softcap * tanh
    hidden = _hidden(rows, q.shape[2], k.shape[2], lag, lead, q.device)
    if hidden is not None:
        scores = scores.masked_fill(hidden, float("-inf"))
    return scores, tanh, hidden


def dense_forward(q, k, v, causal, scale, softcap=0.0, lag=None, lead=None):
    lead = 0 if causal else lead
    n_rep, acc = q.shape[1] // k.shape[1], _accumulation_dtype(q)
    qa, ka, va = q.to(acc), k.repeat_interleave(n_rep, 1).to(acc), v.repeat_interleave(n_rep, 1).to(acc)
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:3], dtype=acc, device=q.device)
    for start in range(0, q.shape[2], DENSE_ROWS):
        rows = slice(start, start + DENSE_ROWS)
        scores, _, hidden = _scores(qa, ka, scale, softcap, lag, lead, rows)
        row_lse = torch.logsumexp(scores, dim=-1)
        probs = torch.exp(scores - row_lse[..., None])
        if hidden is not None:  # a row that sees nothing: -inf - -inf; its probabilities are 0
            probs = probs.masked_fill(hidden, 0.0)
        lse[:, :, rows] = row_lse
        out[:, :, rows] = (probs @ va).to(q.dtype)
    return out, lse


def dense_backward(dout, q, k, v, out, lse, causal, scale, softcap=0.0, lag=None, lead=None):
    lead = 0 if causal else lead
    n_rep, acc = q.shape[1] // k.shape[1], _accumulation_dtype(q)
    qa, ka, va = q.to(acc), k.repeat_interleave(n_rep, 1).to(acc), v.repeat_interleave(n_rep, 1).to(acc)
    dq, dk, dv = torch.empty_like(qa), torch.zeros_like(ka), torch.zeros_like(va)
    for start in range(0, q.shape[2], DENSE_ROWS):
        rows = slice(start, start + DENSE_ROWS)
        scores, tanh, hidden = _scores(qa, ka, scale, softcap, lag, lead, rows)
        probs = torch.exp(scores - lse[:, :, rows].to(acc)[..., None])
        if hidden is not None:
            probs = probs.masked_fill(hidden, 0.0)
        da = dout[:, :, rows].to(acc)
        dv += probs.transpose(-1, -2) @ da
        delta = (da * out[:, :, rows].to(acc)).sum(-1, keepdim=True)
        dscores = probs * (da @ va.transpose(-1, -2) - delta) * scale
        if softcap:  # d(capped)/d(s) = 1 - tanh^2; s = scale q k^T
            dscores = dscores * (1 - tanh * tanh)
        dq[:, :, rows] = dscores @ ka
        dk += dscores.transpose(-1, -2) @ qa[:, :, rows]
    return dq.to(q.dtype), _per_kv_head(dk, n_rep).to(k.dtype), _per_kv_head(dv, n_rep).to(v.dtype)
