"""CPU stand-ins for the CUDA attention kernels: how the memory planner sees their workspace.

The planner (``llama_cp.plan.simulate``) runs on CPU fake tensors, where the CUDA kernels cannot
run. A :class:`ModelledBackend` passed as ``backend`` to :mod:`llama_cp.attention.kernels` makes every
attention call of a model run the stand-in of that CUDA backend instead: a function with the
signature of the library call ``kernel_calls`` makes (flash-attn's ``_flash_attn_forward`` /
``_flash_attn_backward`` and their varlen forms, torch's
``_scaled_dot_product_{flash,efficient}_attention``, ``_flash_attention_forward`` (dense and varlen,
with or without a window) and their backward ops) that allocates the tensors the CUDA code
allocates, with their shapes, dtypes and layouts, and computes the values with torch's CPU
attention kernel, so it is exact on real CPU tensors as well (tests compare it with the math
backend).

Note [GPU attention kernels' workspace]
=======================================

The CUDA attention kernels allocate tensors of their own, which the CPU kernel does not: a
plan that ran torch's CPU attention would leave them out of every GPU figure, so the planner
runs each attention call through this module's stand-in of the planned backend. What
``kernels`` and ``kernel_calls`` do around the library call (layout copies, GQA expansion, lse
padding) is the trainer's own code and runs as is for the stand-in; the stand-in allocates
what the library allocates, listed below.
B batch, H query heads, Hkv key/value heads, Sq/Sk query/key rows, D head size, e the
input dtype's bytes, r(x, m) = x rounded up to a multiple of m.

flash_attn (flash-attn 2.8.3: flash_attn/flash_attn_interface.py, csrc/flash_attn/flash_api.cpp)
  forward   ours: contiguous (B, S, H, D) copies of q, k, v (a copy only where the input
            is not laid out so already);  mha_fwd: out (B, Sq, H, D) e,
            softmax_lse (B, H, Sq) fp32, rng_state 2 x int64.
  backward  ours: contiguous (B, S, H, D) copies of dout, q, k, v, out (same rule), dq, dk,
            dv like them;  mha_bwd: softmax_d (B, H, r(Sq, 128)) fp32,
            dq_accum (B, r(Sq, 128), H, r(D, 32 if D <= 128 else 64)) fp32 (the
            non-deterministic path), and with GQA (Hkv < H) dk_expanded and dv_expanded
            (B, Sk, H, D) e each, summed into dk/dv over each group (at::sum_out, no copy).
  Not modelled: the split-KV forward's out_accum/lse_accum, allocated only when
  B x H x ceil(Sq / 64) < 0.8 x 2 x SMs (fewer than ~6 query blocks per head on an H100):
  never at the context lengths this planner is for.

sdpa_flash (torch's CUDA flash: aten/src/ATen/native/transformers/cuda/attention.cu,
attention_backward.cu, flash_attn/flash_api.cpp, which is flash-attn 2.x's mha_fwd/mha_bwd;
torch/_meta_registrations.py of torch 2.13 for the outputs; the .cu/.cpp files read at
pytorch main: attention_backward.cu 00afd8f2, flash_api.cpp 03b7c19d)
  ours: K and V expanded to H heads (B, H, Sk, D) e each, in forward and again in
  backward; dK/dV summed back to Hkv heads.
  forward   out like q (empty_like of the (B, S, H, D) view), logsumexp (B, H, Sq) fp32,
            philox seed and offset.
  backward  _flash_attention_backward: dout and out made contiguous in (B, S, H, D) (a
            copy unless they are laid out so); mha_bwd: dq, dk, dv like q and the expanded
            k, v, softmax_d and dq_accum as flash_attn's (no dk_expanded: K/V arrive with
            H heads).
  windowed  ``_flash_attention_forward`` / ``_backward`` without cum_seq (Note [Windows on
            torch's flash kernel] in kernel_calls.py): the same, but K/V keep their Hkv heads
            (no expanded copies; with GQA, mha_bwd's dk_expanded and dv_expanded as flash_attn's).

sdpa_efficient (torch's CUDA memory-efficient kernel: attention.cu
_efficient_attention_forward, attention_backward.cu _efficient_attention_backward,
mem_eff_attention/kernel_backward.h and kernel_forward.h, kernels/cutlassF.h and cutlassB.h, read
at pytorch main through the code index (attention_backward.cu 00afd8f2, kernel_backward.h
00f993df); the kernel choice and its block sizes are read from those files, not measured)
  ours: K and V expanded as for sdpa_flash; the backward pads our lse back to r(Sq, 32)
  rows (a new (B, H, r(Sq, 32)) fp32 tensor).
  The sm80 bf16/fp16 kernels dispatch takes the first whose kMaxK covers m = max(D, Dv) (and
  whose shared memory fits, as these do on the A100/H100/H200 the planner is for):
  m <= 64: backward blocks 64 x 64; m <= 128: 128 x 128, dK/dV kept in registers
  (kOutputInRF: kMaxK <= block_i); m > 128: the kMaxK 65536 kernels that stream through
  global memory, forward 32 x 128 (queries x keys), backward 128 x 64 (block_i x block_j).
  forward   out (B, Sq, H, Dv) e, logsumexp (B, H, r(Sq, 32)) fp32; for m > 128 (kMaxK above
            the key block: no single value iteration) also the fp32 output accumulator
            output_accum (B, Sq, H, Dv), freed when the op returns.
  backward  dout made contiguous in (B, S, H, D); grad q, k, v (B, S, H, D) e; delta
            (B, H, Sq) fp32 (computed by the kernel in half precision); the workspace of
            AttentionBackwardKernel::Params::workspace_size, per (batch, head), rounded to 16
            bytes: for each of ceil(Sq / block_i) x ceil(D / block_j) tiles a 16-byte lock
            header and a block_i x block_j fp32 dq accumulator (GradQTempStorage); for m > 128
            (dK/dV not in registers: kNeedsAccumGradK/V) also s x block_j x r(D, block_i) and
            s x block_j x r(Dv, block_i) fp32 dK/dV accumulators, where s, the key splits, is
            ceil(Sk / block_j) capped at 200 // (B x H) and at least 1 (the split heuristic of
            _efficient_attention_backward, num_splits_key unset as SDPA leaves it). Half precision
            only: the planner refuses float32 for it.

On real CPU tensors the stand-ins compute the values (``llama_cp/attention/stand_in_values.py``)
one query head (forward) or one key/value head group (backward) at a time, into the kernel's
own tensors, so they hold at most that slice on top of the kernel's allocations. Under fake
tensors (the planner) there are no values and nothing is computed: the tracked peak is the
kernel's exactly (and the planner's many tile calls cost no per-head loop).
tests/attention/test_workspace.py checks each formula against the tracked peak.
"""

from __future__ import annotations

import types

import torch
from torch._subclasses.fake_tensor import is_fake

from llama_cp.attention.stand_in_values import (
    as_batch, fill_backward, fill_forward, segments, varlen_fill_forward,
)


#: The CUDA backends the planner can model.
MODELLED: tuple[str, ...] = ("flash_attn", "sdpa_flash", "sdpa_efficient")


class ModelledBackend(str):
    """The name of a CUDA backend (one of ``MODELLED``) whose calls run its CPU stand-in.

    A ``str`` so that it travels wherever a backend name does (it equals the name), and a
    type of its own so that :mod:`llama_cp.attention.kernels` tells it from the real backend.
    ``auto``: the backend "auto" picks on the planned GPU, where calls with heads over 256 run
    sdpa_efficient instead, as there (Note [Head sizes above 256] in kernels.py): see
    :meth:`for_heads`."""

    auto: bool

    def __new__(cls, name: str, *, auto: bool = False) -> "ModelledBackend":
        if name not in MODELLED:
            raise ValueError(f"the planner models the CUDA attention backends {MODELLED}, not {name!r}")
        modelled = super().__new__(cls, name)
        modelled.auto = auto
        return modelled

    def for_heads(self, head_dim: int) -> "ModelledBackend":
        """The backend that runs a call with heads of ``head_dim``."""
        return ModelledBackend("sdpa_efficient") if self.auto and head_dim > 256 else self

    def describe(self) -> str:
        """The name, and under ``auto`` what the calls of heads over 256 run."""
        return f"{self} (sdpa_efficient for heads over 256)" if self.auto else str(self)

    def __repr__(self) -> str:
        return f"ModelledBackend({str(self)!r}{', auto=True' if self.auto else ''})"


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def _t(x: torch.Tensor) -> torch.Tensor:
    """(B, S, H, D) <-> (B, H, S, D), a view."""
    return x.transpose(1, 2)


# ---------------------------------------------------------------- flash-attn 2.x
def _mha_fwd(q, k, v, causal, scale, softcap=0.0, window=None, lse_dtype=torch.float32):
    """flash-attn's ``mha_fwd`` (and torch's copy of it) on (B, S, H, D) tensors with the last
    dimension contiguous: ``(out, softmax_lse)``, out like q (``empty_like``), lse (B, H, Sq)."""
    batch, seqlen_q, heads, _ = q.shape
    out = torch.empty_like(q)
    softmax_lse = torch.empty((batch, heads, seqlen_q), dtype=lse_dtype, device=q.device)
    fill_forward(_t(q), _t(k), _t(v), causal, scale, _t(out), softmax_lse, softcap, window)
    return out, softmax_lse


def _mha_bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, causal, scale, softcap=0.0, window=None) -> torch.Tensor:
    """flash-attn's ``mha_bwd`` (and torch's copy of it) on (B, S, H, D) tensors with the last
    dimension contiguous, writing dq, dk, dv; returns ``softmax_d``."""
    batch, seqlen_q, heads, head_size = q.shape
    seqlen_k, heads_k = k.shape[1], k.shape[2]
    fill_backward(_t(dout), _t(q), _t(k), _t(v), _t(out), softmax_lse, causal, scale, _t(dq), _t(dk), _t(dv),
                  softcap, window)
    seqlen_q_rounded = _round_up(seqlen_q, 128)
    head_size_rounded = _round_up(head_size, 32 if head_size <= 128 else 64)
    f32 = dict(dtype=torch.float32, device=q.device)
    softmax_d = torch.empty((batch, heads, seqlen_q_rounded), **f32)
    dq_accum = torch.empty((batch, seqlen_q_rounded, heads, head_size_rounded), **f32)
    if heads_k != heads:  # GQA: dK/dV of every query head, summed over each group into dk/dv
        dk_expanded = torch.empty((batch, seqlen_k, heads, head_size), dtype=q.dtype, device=q.device)
        dv_expanded = torch.empty((batch, seqlen_k, heads, head_size), dtype=q.dtype, device=q.device)
        del dk_expanded, dv_expanded
    del dq_accum
    return softmax_d


def flash_attn_forward(
    q, k, v, dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap, alibi_slopes,
    return_softmax,
):
    """flash-attn 2.8's ``_flash_attn_forward`` on (B, S, H, D) tensors: ``(out, softmax_lse,
    S_dmask, rng_state)``."""
    _check_plain(dropout_p, softcap, alibi_slopes)
    window = _flash_bounds(causal, window_size_left, window_size_right, q.shape[1], k.shape[1])
    out, softmax_lse = _mha_fwd(q, k, v, causal, softmax_scale, softcap, window)
    p = torch.empty(0, dtype=q.dtype, device=q.device)
    rng_state = torch.empty(2, dtype=torch.int64, device=q.device)
    return out, softmax_lse, p, rng_state


def flash_attn_backward(
    dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal, window_size_left,
    window_size_right, softcap, alibi_slopes, deterministic, rng_state=None,
):
    """flash-attn 2.8's ``_flash_attn_backward``: writes dq, dk, dv; returns ``softmax_d``."""
    _check_plain(dropout_p, softcap, alibi_slopes)
    if deterministic:
        raise ValueError("the flash-attn stand-in models the default non-deterministic backward only")
    window = _flash_bounds(causal, window_size_left, window_size_right, q.shape[1], k.shape[1])
    dout, q, k, v, out = (x if x.stride(-1) == 1 else x.contiguous() for x in (dout, q, k, v, out))
    return _mha_bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, causal, softmax_scale, softcap, window)


def _check_plain(dropout_p, softcap, alibi_slopes) -> None:
    """Soft-capping changes only the kernels' scale parameters, not what they allocate (Note
    [Soft-capped attention] in ``llama_cp/attention/windows.py``): the stand-ins compute it, and
    windows (:func:`_flash_bounds`, :func:`_varlen_bounds`)."""
    if dropout_p or alibi_slopes is not None:
        raise ValueError("the flash-attn stand-in models plain, soft-capped or windowed attention: no dropout or "
                         "ALiBi")


def _flash_bounds(causal: bool, left: int | None, right: int | None, seqlen_q: int, seqlen_k: int,
                  limit: int | None = None) -> tuple[int, int] | None:
    """flash-attn's window of a plain call as (lag, lead) of ``llama_cp/attention/dense.py`` (key j hidden
    from query i when i - j > lag or j - i > lead), or None for no window, as flash-attn 2.8.3
    reads its arguments: mha_fwd / mha_bwd in csrc/flash_attn/flash_api.cpp (a side >= seqlen_k
    becomes -1; causal sets right to 0), set_params_fprop (one side -1 and the other not: it
    becomes seqlen_k) and the mask of csrc/flash_attn/src/mask.h (bottom-right aligned: seen iff
    i + Sk - Sq - left <= j <= i + Sk - Sq + right). The same in 2.6.3 and 2.7.4, and in torch's copy,
    whose ops take None for -1. ``limit``: what a side is compared with and a -1 becomes, seqlen_k,
    or max_seqlen_k for a segment of a varlen call (:func:`_varlen_bounds`)."""
    limit = seqlen_k if limit is None else limit
    left, right = (-1 if side is None or side >= limit else side for side in (left, right))
    if causal:
        right = 0
    if left < 0 and right < 0:
        return None
    left, right = (limit if left < 0 else left), (limit if right < 0 else right)
    return left + seqlen_q - seqlen_k, seqlen_k - seqlen_q + right


def _varlen_bounds(causal: bool, left: int | None, right: int | None, max_seqlen_k: int):
    """The window of each segment of a varlen call, as ``window_of(seqlen_q, seqlen_k)`` of
    :func:`stand_in_values.varlen_fill_forward`, or None for a call without one: mha_varlen_fwd /
    mha_varlen_bwd compare the sides with max_seqlen_k and set_params_fprop turns a -1 into it, and the
    mask aligns each segment's window to the segment's own bottom-right corner (its actual lengths)."""
    if {left, right} <= {None, -1}:
        return None
    return lambda seqlen_q, seqlen_k: _flash_bounds(causal, left, right, seqlen_q, seqlen_k, max_seqlen_k)


# ---------------------------------------------------------------- varlen (flash-attn 2.x and torch's copy)
# Packed layout: q (Tq, H, D), k/v (Tk, Hkv, D); segment i is rows cu_seqlens_q[i] : cu_seqlens_q[i + 1]
# of q against rows cu_seqlens_k[i] : cu_seqlens_k[i + 1] of k/v; lse (H, Tq). Note [Varlen document calls].
def _mha_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, softcap=0.0, window_of=None):
    """``mha_varlen_fwd`` of flash-attn 2.x (and torch's copy) on packed contiguous tensors: ``(out,
    softmax_lse)``, out like q, lse (H, Tq). ``window_of``: as :func:`stand_in_values.varlen_fill_forward`'s."""
    out = torch.empty_like(q)
    softmax_lse = torch.empty((q.shape[1], q.shape[0]), dtype=_lse_dtype(q), device=q.device)
    varlen_fill_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, out, softmax_lse, softcap, window_of)
    return out, softmax_lse


def _mha_varlen_bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, causal, scale,
                    softcap=0.0, window_of=None):
    """``mha_varlen_bwd`` of flash-attn 2.x (and torch's copy) on packed contiguous tensors,
    writing dq, dk, dv; returns ``softmax_d``. Its workspace: every segment's dQ accumulates in
    float32 with 128 spare rows after it, so that a segment's last 128-row tile may spill (a window
    changes none of it). ``window_of``: as :func:`stand_in_values.varlen_fill_forward`'s."""
    total_q, heads, head_size = q.shape
    total_k, heads_k = k.shape[:2]
    count = cu_seqlens_q.shape[0] - 1
    if not is_fake(q):
        for qs, ks in segments(cu_seqlens_q, cu_seqlens_k, causal):
            fill_backward(as_batch(dout[qs]), as_batch(q[qs]), as_batch(k[ks]), as_batch(v[ks]),
                          as_batch(out[qs]), softmax_lse[:, qs].unsqueeze(0), causal, scale, as_batch(dq[qs]),
                          as_batch(dk[ks]), as_batch(dv[ks]), softcap,
                          window_of(qs.stop - qs.start, ks.stop - ks.start) if window_of else None)
    head_size_rounded = _round_up(head_size, 32 if head_size <= 128 else 64)
    f32 = dict(dtype=torch.float32, device=q.device)
    softmax_d = torch.empty((heads, total_q + 128 * count), **f32)
    dq_accum = torch.empty((total_q + 128 * count, heads, head_size_rounded), **f32)
    if heads_k != heads:  # GQA: dK/dV of every query head, summed over each group into dk/dv
        dk_expanded = torch.empty((total_k, heads, head_size), dtype=q.dtype, device=q.device)
        dv_expanded = torch.empty((total_k, heads, head_size), dtype=q.dtype, device=q.device)
        del dk_expanded, dv_expanded
    del dq_accum
    return softmax_d


def _lse_dtype(q: torch.Tensor) -> torch.dtype:
    """float32, what the CUDA kernels return (and take); float64 only for the float64 inputs of
    exactness tests, which no CUDA kernel takes."""
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def flash_attn_varlen_forward(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
    window_size_left=-1, window_size_right=-1, softcap=0.0, alibi_slopes=None, return_softmax=False,
    block_table=None, leftpad_k=None, seqused_k=None, zero_tensors=False,
):
    """flash-attn 2.8's ``_flash_attn_varlen_forward`` (mha_varlen_fwd): ``(out, softmax_lse (H, Tq),
    S_dmask, rng_state)``."""
    _check_plain(dropout_p, softcap, alibi_slopes)
    if block_table is not None or leftpad_k is not None or seqused_k is not None or return_softmax:
        raise ValueError("the flash-attn varlen stand-in models packed q/k/v: no paged KV, padding or softmax")
    out, softmax_lse = _mha_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, softmax_scale, softcap,
                                       _varlen_bounds(causal, window_size_left, window_size_right, max_seqlen_k))
    p = torch.empty(0, dtype=q.dtype, device=q.device)
    rng_state = torch.empty(2, dtype=torch.int64, device=q.device)
    return out, softmax_lse, p, rng_state


def flash_attn_varlen_backward(
    dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
    dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap, alibi_slopes, deterministic,
    rng_state=None, zero_tensors=False,
):
    """flash-attn 2.8's ``_flash_attn_varlen_backward``: writes dq, dk, dv; returns ``softmax_d``."""
    _check_plain(dropout_p, softcap, alibi_slopes)
    if deterministic:
        raise ValueError("the flash-attn stand-in models the default non-deterministic backward only")
    dout, q, k, v, out = (x if x.stride(-1) == 1 else x.contiguous() for x in (dout, q, k, v, out))
    return _mha_varlen_bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, causal,
                           softmax_scale, softcap, _varlen_bounds(causal, window_size_left, window_size_right,
                                                                  max_seqlen_k))


#: Stands in for ``flash_attn.flash_attn_interface`` in ``kernel_calls.flash_attn_forward/backward``
#: and ``kernels.varlen_forward/backward``.
FLASH_ATTN = types.SimpleNamespace(
    _flash_attn_forward=flash_attn_forward, _flash_attn_backward=flash_attn_backward,
    _flash_attn_varlen_forward=flash_attn_varlen_forward, _flash_attn_varlen_backward=flash_attn_varlen_backward,
)


# ---------------------------------------------------------------- torch's CUDA SDPA ops
def sdpa_flash_forward(query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
    """``aten._scaled_dot_product_flash_attention`` on CUDA (attention.cu: the (B, S, H, D)
    views of (B, H, S, D) inputs into torch's ``mha_fwd``)."""
    out, logsumexp = _mha_fwd(_t(query), _t(key), _t(value), is_causal, scale)
    seed = torch.empty(2, dtype=torch.int64, device=query.device)  # rng_state: 2 x uint64
    offset = torch.empty((), dtype=torch.int64, device=query.device)
    debug_mask = torch.empty(0, dtype=query.dtype, device=query.device)
    return _t(out), logsumexp, None, None, query.shape[2], key.shape[2], seed, offset, debug_mask


def sdpa_flash_backward(
    grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
    philox_seed, philox_offset, *, scale=None,
):
    """``aten._scaled_dot_product_flash_attention_backward`` on CUDA (attention_backward.cu:
    ``_flash_attention_backward`` makes dout and out contiguous in (B, S, H, D), then torch's
    ``mha_bwd`` allocates dq, dk, dv like q, k, v and the same workspace as flash-attn's)."""
    grad_out_t, out_t = _t(grad_out).contiguous(), _t(out).contiguous()
    q_t, k_t, v_t = _t(query), _t(key), _t(value)
    dq, dk, dv = torch.empty_like(q_t), torch.empty_like(k_t), torch.empty_like(v_t)
    softmax_d = _mha_bwd(grad_out_t, q_t, k_t, v_t, out_t, logsumexp, dq, dk, dv, is_causal, scale)
    del softmax_d, grad_out_t, out_t
    return _t(dq), _t(dk), _t(dv)


def sdpa_efficient_forward(query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False, *,
                           scale=None):
    """``aten._scaled_dot_product_efficient_attention`` on CUDA (attention.cu
    ``_efficient_attention_forward``): out (B, S, H, D), lse rows padded to a multiple of 32, and
    for heads over 128 the float32 output accumulator the kernel frees on return."""
    batch, heads, seqlen_q, _ = query.shape
    _check_efficient(attn_bias, dropout_p)
    res = torch.empty((batch, seqlen_q, heads, value.shape[-1]), dtype=query.dtype, device=query.device)
    lse_rows = _round_up(seqlen_q, 32) if compute_log_sumexp else 0
    logsumexp = torch.empty((batch, heads, lse_rows), dtype=torch.float32, device=query.device)
    if _efficient_blocks(query.shape[-1], value.shape[-1]) == _WIDE_BLOCKS:
        output_accum = torch.empty(res.shape, dtype=torch.float32, device=query.device)
        del output_accum
    fill_forward(query, key, value, is_causal, scale, _t(res), logsumexp[..., :seqlen_q])
    logsumexp[..., seqlen_q:].fill_(float("inf"))
    seed = torch.empty((), dtype=torch.int64, device=query.device)
    offset = torch.empty((), dtype=torch.int64, device=query.device)
    return _t(res), logsumexp, seed, offset


def sdpa_efficient_backward(
    grad_out, query, key, value, attn_bias, out, logsumexp, philox_seed, philox_offset, dropout_p,
    grad_input_mask, is_causal=False, *, scale=None,
):
    """``aten._scaled_dot_product_efficient_attention_backward`` on CUDA (attention_backward.cu
    ``_efficient_attention_backward``): dout made contiguous in (B, S, H, D), dq/dk/dv in
    (B, S, H, D), delta float32 (B, H, Sq) and the kernel's workspace (the float32 dq
    accumulator tiles of mem_eff_attention/kernel_backward.h, and for heads over 128 its dK/dV
    accumulators)."""
    batch, heads, seqlen_q, head_dim = query.shape
    _check_efficient(attn_bias, dropout_p)
    grad_out_t = _t(grad_out).contiguous()
    grad_q = torch.empty(_t(query).shape, dtype=query.dtype, device=query.device)
    grad_k = torch.empty(_t(key).shape, dtype=key.dtype, device=key.device)
    grad_v = torch.empty(_t(value).shape, dtype=value.dtype, device=value.device)
    fill_backward(grad_out, query, key, value, out, logsumexp[..., :seqlen_q], is_causal, scale,
                  _t(grad_q), _t(grad_k), _t(grad_v))
    delta = torch.empty((batch, heads, seqlen_q), dtype=torch.float32, device=query.device)
    workspace = torch.empty(
        efficient_backward_workspace_bytes(batch, heads, seqlen_q, key.shape[2], head_dim, value.shape[-1]),
        dtype=torch.uint8, device=query.device,
    )
    del delta, workspace, grad_out_t
    return _t(grad_q), _t(grad_k), _t(grad_v), None


#: The backward's (block_i, block_j) of the sm80 bf16/fp16 kernels: heads up to 64, up to 128
#: (both with dK/dV in registers), and the global-memory kernels above (Note [GPU attention
#: kernels' workspace]).
_SMALL_BLOCKS, _MEDIUM_BLOCKS, _WIDE_BLOCKS = (64, 64), (128, 128), (128, 64)


def _efficient_blocks(head_dim: int, head_dim_value: int) -> tuple[int, int]:
    widest = max(head_dim, head_dim_value)
    return _SMALL_BLOCKS if widest <= 64 else _MEDIUM_BLOCKS if widest <= 128 else _WIDE_BLOCKS


def efficient_backward_workspace_bytes(
    batch: int, heads: int, seqlen_q: int, seqlen_k: int, head_dim: int, head_dim_value: int
) -> int:
    """Bytes of the memory-efficient backward's workspace on an sm80+ GPU in half precision, per
    (batch, head) rounded to 16 bytes: a 16-byte lock header and a block_i x block_j float32 dq
    accumulator tile for every (query block, head-dim block); for heads over 128 also float32 dK
    and dV accumulators of block_j rows per key split. Note [GPU attention kernels' workspace]."""
    block_i, block_j = _efficient_blocks(head_dim, head_dim_value)
    floats = -(-seqlen_q // block_i) * -(-head_dim // block_j) * (4 + block_i * block_j)
    if (block_i, block_j) == _WIDE_BLOCKS:  # dK/dV accumulate in global memory (kNeedsAccumGradK/V)
        splits = max(1, min(-(-seqlen_k // block_j), 200 // (batch * heads)))
        floats += splits * block_j * (_round_up(head_dim, block_i) + _round_up(head_dim_value, block_i))
    return batch * heads * _round_up(floats, 4) * 4


def _check_efficient(attn_bias, dropout_p) -> None:
    if attn_bias is not None or dropout_p:
        raise ValueError("the sdpa_efficient stand-in models plain attention: no bias or dropout")


def flash_attention_forward(
    query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, return_debug_mask, *, scale=None,
    window_size_left=None, window_size_right=None, seqused_k=None, alibi_slopes=None, block_table=None,
    num_splits=None,
):
    """``aten._flash_attention_forward`` on CUDA: torch's ``mha_varlen_fwd`` with ``cum_seq_q``/``cum_seq_k``
    (lse (H, Tq)), its ``mha_fwd`` on (B, S, H, D) tensors without (lse (B, H, Sq)); a window read as each
    does (:func:`_flash_bounds`, :func:`_varlen_bounds`): ``(output, logsumexp, rng_state, unused,
    debug_attn_mask)``, the shapes and dtypes of the op's meta registration (torch/_meta_registrations.py)."""
    if dropout_p or return_debug_mask or seqused_k is not None or alibi_slopes is not None or block_table is not None \
            or (cum_seq_q is None) != (cum_seq_k is None):
        raise ValueError("the _flash_attention_forward stand-in models plain or windowed attention: no dropout, "
                         "ALiBi, paged KV or debug mask")
    if cum_seq_q is None:
        window = _flash_bounds(is_causal, window_size_left, window_size_right, query.shape[1], key.shape[1])
        output, logsumexp = _mha_fwd(query, key, value, is_causal, scale, window=window, lse_dtype=_lse_dtype(query))
    else:
        output, logsumexp = _mha_varlen_fwd(query, key, value, cum_seq_q, cum_seq_k, is_causal, scale,
                                            window_of=_varlen_bounds(is_causal, window_size_left,
                                                                     window_size_right, max_k))
    rng_state = torch.empty(2, dtype=torch.uint64, device=query.device)
    unused = torch.empty((), dtype=torch.uint64, device=query.device)
    debug_mask = torch.empty(0, dtype=query.dtype, device=query.device)
    return output, logsumexp, rng_state, unused, debug_mask


def flash_attention_backward(
    grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
    rng_state, unused, *, scale=None, window_size_left=None, window_size_right=None,
):
    """``aten._flash_attention_backward`` on CUDA: torch's ``mha_varlen_bwd`` with
    ``cum_seq_q``/``cum_seq_k``, its ``mha_bwd`` without (a window as each reads it); dout and out
    made contiguous first, dq, dk, dv allocated like query, key, value, and flash-attn's workspace."""
    if dropout_p:
        raise ValueError("the _flash_attention_backward stand-in models plain or windowed attention: no dropout")
    grad_out, out = grad_out.contiguous(), out.contiguous()
    dq, dk, dv = torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)
    if cum_seq_q is None:
        softmax_d = _mha_bwd(grad_out, query, key, value, out, logsumexp, dq, dk, dv, is_causal, scale,
                             window=_flash_bounds(is_causal, window_size_left, window_size_right, query.shape[1],
                                                  key.shape[1]))
    else:
        softmax_d = _mha_varlen_bwd(grad_out, query, key, value, out, logsumexp, dq, dk, dv, cum_seq_q, cum_seq_k,
                                    is_causal, scale, window_of=_varlen_bounds(is_causal, window_size_left,
                                                                               window_size_right, max_k))
    del softmax_d
    return dq, dk, dv


#: Stands in for ``torch.ops.aten`` in ``kernel_calls.sdpa_cuda_forward/backward`` and
#: ``kernels.varlen_forward/backward``.
SDPA_OPS = types.SimpleNamespace(
    _flash_attention_forward=flash_attention_forward,
    _flash_attention_backward=flash_attention_backward,
    _scaled_dot_product_flash_attention=sdpa_flash_forward,
    _scaled_dot_product_flash_attention_backward=sdpa_flash_backward,
    _scaled_dot_product_efficient_attention=sdpa_efficient_forward,
    _scaled_dot_product_efficient_attention_backward=sdpa_efficient_backward,
)
