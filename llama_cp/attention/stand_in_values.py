"""The values the CPU stand-ins of ``llama_cp/attention/workspace.py`` compute on real CPU tensors,
written into the tensors the stand-ins allocate as the CUDA kernels do (Note [GPU attention
kernels' workspace] there); under fake tensors (the planner) nothing is computed. Layouts: q
(B, H, Sq, D), k/v (B, Hkv, Sk, D), lse (B, H, Sq); packed varlen rows (T, H, D), lse (H, Tq).
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import is_fake

from llama_cp.attention.dense import dense_backward, dense_forward

_aten = torch.ops.aten


# Torch's CPU flash kernel computes the values; under fake tensors it allocates only its
# outputs, on real tensors its internal buffers are not tensors the tracker sees. Its outputs
# are one query head (forward) or one key/value head group (backward) at a time, copied into
# the CUDA kernel's own tensors: the stand-in then holds at most that slice on top of what the
# CUDA kernel holds; under fake tensors nothing is computed (Note [GPU attention kernels' workspace]).
def fill_forward(q, k, v, causal, scale, out, lse, softcap=0.0, window=None) -> None:
    """out (B, H, Sq, D) and lse (B, H, Sq) of q (B, H, Sq, D), k/v (B, Hkv, Sk, D), any strides.
    Fake tensors (the planner) have no values to compute: nothing is done, nothing allocated.
    ``softcap``, ``window`` ((lag, lead) of ``workspace._flash_bounds``): the values of flash-attn's
    soft-capped or windowed scores, from the exact CPU kernel; a row that sees no key gets
    lse = +inf, as flash-attn writes it (csrc/flash_attn/src/softmax.h, ``normalize_softmax_lse``)."""
    if is_fake(q):
        return
    if softcap or window is not None:
        lag, lead = (None, None) if window is None else window
        o, l = dense_forward(q, k, v, causal and window is None, scale, softcap, lag, lead)
        out.copy_(o)
        lse.copy_(l.masked_fill(l == float("-inf"), float("inf")))
        return
    n_rep = q.shape[1] // k.shape[1]
    for h in range(q.shape[1]):
        g = h // n_rep
        o, l = _aten._scaled_dot_product_flash_attention_for_cpu(
            q[:, h : h + 1], k[:, g : g + 1], v[:, g : g + 1], 0.0, causal, scale=scale
        )
        out[:, h : h + 1].copy_(o)
        lse[:, h : h + 1].copy_(l)
        del o, l


def fill_backward(dout, q, k, v, out, lse, causal, scale, dq, dk, dv, softcap=0.0, window=None) -> None:
    """dq, dk, dv in the (B, H, S, D) views given, one key/value head group at a time (nothing
    for fake tensors, as in :func:`fill_forward`)."""
    if is_fake(q):
        return
    if softcap or window is not None:
        lag, lead = (None, None) if window is None else window
        grads = dense_backward(dout, q, k, v, out, lse, causal and window is None, scale, softcap, lag, lead)
        for grad, value in zip((dq, dk, dv), grads):
            grad.copy_(value)
        return
    n_rep = q.shape[1] // k.shape[1]
    for g in range(k.shape[1]):
        heads = slice(g * n_rep, (g + 1) * n_rep)
        gq, gk, gv = _aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout[:, heads], q[:, heads], k[:, g : g + 1], v[:, g : g + 1], out[:, heads],
            lse[:, heads], 0.0, causal, scale=scale,
        )
        dq[:, heads].copy_(gq)
        dk[:, g : g + 1].copy_(gk)
        dv[:, g : g + 1].copy_(gv)
        del gq, gk, gv


def segments(cu_seqlens_q, cu_seqlens_k, causal):
    """(query rows, key rows) slices of every segment; causal segments must be square (flash-attn
    aligns a causal mask bottom-right, which the stand-in does not model)."""
    bounds_q, bounds_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    result = []
    for q0, q1, k0, k1 in zip(bounds_q[:-1], bounds_q[1:], bounds_k[:-1], bounds_k[1:]):
        if causal and q1 - q0 != k1 - k0:
            raise ValueError(f"the varlen stand-in models square causal segments, not {q1 - q0} x {k1 - k0}")
        result.append((slice(q0, q1), slice(k0, k1)))
    return result


def as_batch(x: torch.Tensor) -> torch.Tensor:
    """(S, H, D) rows of one segment -> a (1, H, S, D) view, the layout of ``fill_*``."""
    return x.unsqueeze(0).transpose(1, 2)


def varlen_fill_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, out, lse, softcap=0.0,
                        window_of=None) -> None:
    """out (Tq, H, D) and lse (H, Tq) of every segment of a varlen call, one segment at a time;
    ``window_of(seqlen_q, seqlen_k)``: a segment's window ((lag, lead) or None), for a windowed call."""
    if is_fake(q):
        return
    for qs, ks in segments(cu_seqlens_q, cu_seqlens_k, causal):
        window = window_of(qs.stop - qs.start, ks.stop - ks.start) if window_of else None
        fill_forward(as_batch(q[qs]), as_batch(k[ks]), as_batch(v[ks]), causal, scale, as_batch(out[qs]),
                     lse[:, qs].unsqueeze(0), softcap, window)
