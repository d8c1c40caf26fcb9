"""How each local attention backend's kernel is called (:mod:`llama_cp.attention.kernels` chooses the
backend and handles windows and soft-caps): the float32 math reference, torch's CUDA SDPA aten ops
that return the log-sum-exp, and flash-attn's private forward/backward, in the layouts, argument
lists and GQA handling each one takes. Layouts as in ``kernels``: q (B, H, Sq, D), k and v
(B, Hkv, Sk, D), lse (B, H, Sq).
"""

from __future__ import annotations

import inspect

import torch

_aten = torch.ops.aten


def accumulation_dtype(x: torch.Tensor) -> torch.dtype:
    """float64 for float64 tensors, else float32: the dtype of lse and of every accumulator."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def expand_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(B, Hkv, S, D) -> (B, Hkv * n_rep, S, D), each KV head repeated for its query group."""
    if n_rep == 1:
        return x
    b, h, s, d = x.shape
    return x[:, :, None].expand(b, h, n_rep, s, d).reshape(b, h * n_rep, s, d)


def reduce_kv_grad(dx: torch.Tensor, n_rep: int) -> torch.Tensor:
    """Inverse of :func:`expand_kv` for gradients: sum each query group."""
    if n_rep == 1:
        return dx
    b, h, s, d = dx.shape
    return dx.view(b, h // n_rep, n_rep, s, d).sum(2)


# ---------------------------------------------------------------- the math reference
def math_forward(q, k, v, causal, scale):
    n_rep = q.shape[1] // k.shape[1]
    acc = accumulation_dtype(q)
    scores = q.to(acc) @ expand_kv(k, n_rep).to(acc).transpose(-1, -2) * scale  # (B, H, Sq, Sk)
    if causal:
        scores = scores.masked_fill(causal_block_mask(q.shape[2], q.device), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse[..., None])
    out = probs @ expand_kv(v, n_rep).to(acc)
    return out.to(q.dtype), lse


def math_backward(dout, q, k, v, out, lse, causal, scale):
    n_rep = q.shape[1] // k.shape[1]
    acc = accumulation_dtype(q)
    qa, ka, va = q.to(acc), expand_kv(k, n_rep).to(acc), expand_kv(v, n_rep).to(acc)
    da, oa = dout.to(acc), out.to(acc)
    scores = qa @ ka.transpose(-1, -2) * scale
    if causal:
        scores = scores.masked_fill(causal_block_mask(q.shape[2], q.device), float("-inf"))
    probs = torch.exp(scores - lse.to(acc)[..., None])  # (B, H, Sq, Sk)
    dv = probs.transpose(-1, -2) @ da
    dprobs = da @ va.transpose(-1, -2)
    delta = (da * oa).sum(-1, keepdim=True)  # rowsum(dO * O) = sum_j P_ij dP_ij
    dscores = probs * (dprobs - delta) * scale
    dq = dscores @ ka
    dk = dscores.transpose(-1, -2) @ qa
    return (
        dq.to(q.dtype),
        reduce_kv_grad(dk, n_rep).to(k.dtype),
        reduce_kv_grad(dv, n_rep).to(v.dtype),
    )


def causal_block_mask(s: int, device: torch.device) -> torch.Tensor:
    """(s, s) boolean, True above the diagonal (masked). Only for the math block."""
    return torch.ones(s, s, dtype=torch.bool, device=device).triu(1)


# ---------------------------------------------------------------- torch CUDA ops
def sdpa_cuda_forward(q, k, v, causal, scale, *, flash: bool, ops=_aten):
    n_rep = q.shape[1] // k.shape[1]
    k, v = expand_kv(k, n_rep), expand_kv(v, n_rep)
    if flash:
        out, lse, *_ = ops._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
    else:
        out, lse, *_ = ops._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal, scale=scale)
        lse = lse[..., : q.shape[2]]  # the efficient kernel pads the lse rows to a multiple of 32
    return out, lse.float()


def sdpa_cuda_backward(dout, q, k, v, out, lse, causal, scale, *, flash: bool, ops=_aten):
    n_rep = q.shape[1] // k.shape[1]
    ke, ve = expand_kv(k, n_rep), expand_kv(v, n_rep)
    dout = dout.to(q.dtype).contiguous()
    zero = torch.zeros((), dtype=torch.int64, device=q.device)
    if flash:
        sq, sk = q.shape[2], k.shape[2]
        dq, dk, dv = ops._scaled_dot_product_flash_attention_backward(
            dout, q, ke, ve, out, lse.float().contiguous(), None, None, sq, sk, 0.0, causal,
            zero, zero, scale=scale,
        )
    else:
        # The efficient backward reads lse rows up to a multiple of 32, padded with +inf by its
        # forward (pytorch mem_eff_attention kernel_backward.h); ROCm's kernel takes them unpadded.
        pad = 0 if torch.version.hip else -q.shape[2] % 32
        lse = torch.nn.functional.pad(lse.float(), (0, pad), value=float("inf")).contiguous()
        dq, dk, dv, _ = ops._scaled_dot_product_efficient_attention_backward(
            dout, q, ke, ve, None, out, lse, zero, zero, 0.0, [True, True, True, False], causal, scale=scale,
        )
    return dq, reduce_kv_grad(dk, n_rep), reduce_kv_grad(dv, n_rep)


# Note [cuDNN attention blocks]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# sdpa_cudnn calls torch's cuDNN attention ops (aten::_scaled_dot_product_cudnn_attention and its
# backward; their schemas and meta kernels read on torch 2.11 and 2.13): the log-sum-exp comes
# back float32 as (B, H, Sq, 1), which we squeeze to (B, H, Sq) and unsqueeze for the backward;
# the backward takes the (out, lse) it is given, so a block's gradient from the merged (out, lse)
# is the block's share, as with the flash kernels (torch's own ring attention,
# torch/distributed/tensor/experimental/_context_parallel/_attention.py in 2.13, merges cuDNN
# blocks' lse with the flash blocks' and calls this backward with the merged pair). KV heads are
# expanded as for sdpa_flash. On an H200 (torch 2.11, cuDNN 9.19) its 64K causal forward and
# backward ran at 590 TFLOP/s against the flash op's 327 (docs/benchmarks.md, One GPU,
# measured). The second run of benchmarks/gpu_report.py there checked it exact inside llama-cp
# against transformers (one document, packed documents, ring blocks of 2048, all-gather blocks),
# and a Llama-3-8B-shaped step at 64K ran 1.34x (LoRA) and 1.28x (full) faster than with
# sdpa_flash, at the same peak memory: so "auto" takes it on sm90 GPUs (kernels.AUTO_GPUS), and
# only there until another GPU has run those checks.
def sdpa_cudnn_forward(q, k, v, causal, scale, *, ops=_aten):
    n_rep = q.shape[1] // k.shape[1]
    k, v = expand_kv(k, n_rep), expand_kv(v, n_rep)
    out, lse, *_ = ops._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)
    return out, lse.reshape(q.shape[:3]).float()


def sdpa_cudnn_backward(dout, q, k, v, out, lse, causal, scale, *, ops=_aten):
    n_rep = q.shape[1] // k.shape[1]
    ke, ve = expand_kv(k, n_rep), expand_kv(v, n_rep)
    dout, out = dout.to(q.dtype).contiguous(), out.to(q.dtype).contiguous()  # the same strides, as cuDNN wants
    zero = torch.zeros((), dtype=torch.int64, device=q.device)  # philox seed/offset: unread without dropout
    dq, dk, dv = ops._scaled_dot_product_cudnn_attention_backward(
        dout, q, ke, ve, out, lse.float().unsqueeze(-1).contiguous(), zero, zero, None, None, None,
        q.shape[2], k.shape[2], 0.0, causal, scale=scale,
    )
    return dq, reduce_kv_grad(dk, n_rep), reduce_kv_grad(dv, n_rep)


# ---------------------------------------------------------------- flash-attn
# flash-attn works in (B, S, H, D) and supports GQA natively. Its private
# forward/backward changed their argument lists across 2.x releases, so they
# are called by keyword, with only the arguments the installed version takes.
# From 2.7 they are torch custom ops whose own signature is (*args, **kwargs):
# the Python function they wrap is ``_init_fn``.
def call_by_keyword(fn, **kwargs):
    params = inspect.signature(getattr(fn, "_init_fn", fn)).parameters
    if "window_size" in params:  # flash-attn < 2.7 takes a (left, right) tuple
        kwargs["window_size"] = (kwargs["window_size_left"], kwargs["window_size_right"])
    return fn(**{name: value for name, value in kwargs.items() if name in params})


def flash_window(lag: int | None, num_q: int, num_k: int, causal: bool) -> dict[str, int]:
    """flash-attn's window arguments for ``lag`` (Note [Sliding windows under CP]): its windows
    are aligned bottom-right, key j seen by query i iff i + Sk - Sq - left <= j <= i + Sk - Sq
    + right (csrc/flash_attn/src/mask.h), and a right of -1 becomes Sk (flash_api.cpp), which
    hides no key only when Sq <= Sk + 1: ``windows.window_parts`` makes such calls; causal ones are square."""
    if lag is None:
        return dict(window_size_left=-1, window_size_right=-1)
    return dict(window_size_left=lag + num_k - num_q, window_size_right=0 if causal else -1)


def flash_attn_forward(q, k, v, causal, scale, *, fa, softcap: float = 0.0, lag: int | None = None):
    q_, k_, v_ = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    result = call_by_keyword(
        fa._flash_attn_forward, q=q_, k=k_, v=v_, dropout_p=0.0, softmax_scale=scale,
        causal=causal, **flash_window(lag, q.shape[2], k.shape[2], causal), softcap=softcap,
        alibi_slopes=None, return_softmax=False,
    )
    out, lse = (result[0], result[1]) if len(result) == 4 else (result[0], result[5])
    return out.transpose(1, 2), lse.float()


def flash_attn_backward(dout, q, k, v, out, lse, causal, scale, *, fa, softcap: float = 0.0,
                         lag: int | None = None):
    dout_, q_, k_, v_, out_ = (t.transpose(1, 2).contiguous() for t in (dout.to(q.dtype), q, k, v, out))
    dq, dk, dv = torch.empty_like(q_), torch.empty_like(k_), torch.empty_like(v_)
    call_by_keyword(
        fa._flash_attn_backward, dout=dout_, q=q_, k=k_, v=v_, out=out_,
        softmax_lse=lse.float().contiguous(), dq=dq, dk=dk, dv=dv, dropout_p=0.0,
        softmax_scale=scale, causal=causal, **flash_window(lag, q.shape[2], k.shape[2], causal),
        softcap=softcap, alibi_slopes=None, deterministic=False, rng_state=None,
    )
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


# ---------------------------------------------------------------- torch's flash kernel with a window
# Note [Windows on torch's flash kernel]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# sdpa_flash takes a window through aten::_flash_attention_forward / _flash_attention_backward
# called without cum_seq (their dense path), which take window_size_left/right: the schemas of
# torch 2.10 and 2.13 (read here) and torch 2.13's own windowed attention,
# torch/nn/attention/varlen.py, which passes its window to the same two ops. On CUDA they call
# torch's copy of flash-attn 2 (aten/src/ATen/native/transformers/cuda/attention.cu and
# attention_backward.cu, flash_attn/flash_api.cpp ``mha_fwd`` / ``mha_bwd`` at pytorch main:
# attention_backward.cu 00afd8f2, flash_api.cpp 03b7c19d), which reads the window as flash-attn
# does (``flash_window`` above; set_params_fprop: one side -1 and the other not, it becomes
# seqlen_k; mha_fwd/mha_bwd: a side >= seqlen_k becomes -1, causal sets the right side to 0), and
# launches the local kernels (flash_fwd_launch_template.h: Is_local when a side is >= 0). The
# ops take (B, S, H, D) tensors with the last dimension contiguous (the transposed views of ours,
# as torch's own SDPA wrapper passes them), K/V with their own Hkv heads (GQA inside mha_fwd and
# mha_bwd: no expanded copies), and return out (B, Sq, H, D), lse (B, H, Sq) float32; the backward
# makes dout and out contiguous itself, reads the lse as (B, H, Sq) contiguous, and its philox
# seed and offset only with dropout. They have no soft-cap (flash_api.cpp has one, the ops pass
# 0): soft-capped scores stay flash-attn's. The planner's stand-in is
# workspace.flash_attention_forward / _backward, which reads the window as mha_fwd does.
def sdpa_flash_window_forward(q, k, v, causal, scale, lag, *, ops=_aten):
    """sdpa_flash with ``lag`` (a sliding window, as in :func:`flash_window`): (out, lse) as the
    other forwards (Note [Windows on torch's flash kernel])."""
    num_q, num_k = q.shape[2], k.shape[2]
    out, lse, *_ = ops._flash_attention_forward(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, None, num_q, num_k, 0.0, causal, False,
        scale=scale, **flash_window(lag, num_q, num_k, causal),
    )
    return out.transpose(1, 2), lse.float()


def sdpa_flash_window_backward(dout, q, k, v, out, lse, causal, scale, lag, *, ops=_aten):
    """The gradients of :func:`sdpa_flash_window_forward`'s call, given the final (out, lse)."""
    num_q, num_k = q.shape[2], k.shape[2]
    zero = torch.zeros((), dtype=torch.int64, device=q.device)  # philox seed/offset: unread without dropout
    dq, dk, dv = ops._flash_attention_backward(
        dout.to(q.dtype).transpose(1, 2), q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        out.to(q.dtype).transpose(1, 2), lse.float().contiguous(), None, None, num_q, num_k, 0.0, causal, zero, zero,
        scale=scale, **flash_window(lag, num_q, num_k, causal),
    )
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
