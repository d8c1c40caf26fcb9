"""Local attention blocks that return the log-sum-exp, and their backward.

Context-parallel attention computes attention one block of keys at a time and
merges the partial results, so it needs every block's softmax normaliser
(``lse``, the log-sum-exp of the scaled scores of each query row) and a backward
that takes a given ``(out, lse)`` instead of recomputing them.

Layout everywhere in this module (the layout HF passes to attention functions):

    q:        (B, H,   Sq, D)
    k, v:     (B, Hkv, Sk, D)      H % Hkv == 0 (GQA when Hkv < H)
    out:      (B, H,   Sq, D)      in q's dtype
    lse:      (B, H,   Sq)         float32 (float64 for float64 inputs)

``causal=True`` is only used for square blocks (Sq == Sk), where the top-left
and bottom-right alignments of the mask agree.

Backends, chosen per call by :func:`select_backend`:

- ``flash_attn``: the flash-attn package (CUDA, fp16/bf16), imported lazily.
- ``sdpa_cudnn``: torch's cuDNN attention (fp16/bf16, sm80+, head sizes up to 128), through
  its aten op; "auto" takes it on sm90 GPUs (Hopper), elsewhere it runs when named (``AUTO_GPUS``,
  Note [cuDNN attention blocks] in kernel_calls.py). It has no varlen kernel: under "auto",
  blocks of packed documents that a varlen kernel computes in fewer calls take sdpa_flash.
- ``sdpa_flash``: torch's CUDA flash kernel (fp16/bf16, sm80+), through the aten
  op that returns the log-sum-exp.
- ``sdpa_efficient``: torch's CUDA memory-efficient kernel (fp16/fp32, and bf16
  on sm80+), likewise.
- ``sdpa_cpu``: ``aten._scaled_dot_product_flash_attention_for_cpu`` and its
  backward (tiled: never materialises the score matrix).
- ``math``: a float32 reference that materialises the (Sq, Sk) scores of the
  block; used on other devices and as the reference in tests.

A :class:`llama_cp.attention.workspace.ModelledBackend` (what the memory planner passes) runs a
CUDA backend's CPU stand-in in place of the library call, through the same code around it.

Soft-capped and windowed calls (``softcap`` > 0, ``lag``) are routed and cut into kernel calls by
``llama_cp/attention/windows.py`` (Note [Soft-capped attention] there).

The backends in ``VARLEN`` also compute many independent attention segments in one call
(:func:`varlen_forward` / :func:`varlen_backward`, packed layout ``(total, H, D)``): packed
documents use them, Note [Varlen document calls] in ``llama_cp/attention/varlen.py``.
"""

from __future__ import annotations

import functools
from typing import Literal

import torch

from llama_cp.attention.dense import dense_backward as _dense_backward
from llama_cp.attention.dense import dense_forward as _dense_forward
from llama_cp.attention.kernel_calls import (
    accumulation_dtype,
    call_by_keyword,
    flash_attn_backward,
    flash_attn_forward,
    math_backward,
    math_forward,
    sdpa_cuda_backward,
    sdpa_cuda_forward,
    sdpa_cudnn_backward,
    sdpa_cudnn_forward,
    sdpa_flash_window_backward,
    sdpa_flash_window_forward,
)
from llama_cp.attention.windows import NO_WINDOW, window_or_cap_backend, window_parts
from llama_cp.attention.workspace import FLASH_ATTN, SDPA_OPS, ModelledBackend

Backend = Literal["flash_attn", "sdpa_cudnn", "sdpa_flash", "sdpa_efficient", "sdpa_cpu", "math"]
#: Every backend, fastest first: :func:`select_backend` takes the first that can run, and a backend
#: of ``AUTO_GPUS`` only on those GPUs.
BACKENDS: tuple[str, ...] = ("flash_attn", "sdpa_cudnn", "sdpa_flash", "sdpa_efficient", "sdpa_cpu", "math")
#: Backends "auto" takes only on GPUs of these compute capabilities: those where a GPU run checked
#: them exact inside llama-cp and faster than the next (Note [cuDNN attention blocks] in
#: kernel_calls.py: sm90, an H200); elsewhere they run when named.
AUTO_GPUS: dict[str, tuple[tuple[int, int], ...]] = {"sdpa_cudnn": ((9, 0),)}
#: The backends with a varlen kernel: many segments of queries x keys in one call.
VARLEN: tuple[str, ...] = ("flash_attn", "sdpa_flash")

_aten = torch.ops.aten
_HALF_DTYPES = (torch.float16, torch.bfloat16)


@functools.cache
def _flash_attn_interface():
    """The flash-attn module, or None when it is not installed."""
    try:
        from flash_attn import flash_attn_interface
    except ImportError:
        return None
    return flash_attn_interface


def backend_problem(
    backend: str, device_type: str, dtype: torch.dtype, head_dim: int, *, capability: tuple[int, int] | None = None,
    flash_attn_installed: bool | None = None,
) -> str | None:
    """Why ``backend`` cannot compute attention of ``dtype`` with heads of ``head_dim`` on a
    ``device_type`` device of compute ``capability`` (default: the current CUDA device's), or
    None when it can. ``flash_attn_installed``: default, whether it is installed here."""
    if backend not in BACKENDS:
        return f"unknown attention backend {backend!r}; choose one of {BACKENDS}"
    if backend == "math":
        return None
    if backend == "sdpa_cpu":
        return None if device_type == "cpu" else f"sdpa_cpu runs on CPU tensors, not {device_type}"
    if device_type != "cuda":
        return f"{backend} needs CUDA tensors, not {device_type}"
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"{backend} takes float16/bfloat16/float32, not {dtype}"
    if backend == "sdpa_efficient" and head_dim % 8:  # Note [Head sizes above 256]
        return f"{backend} takes head sizes that are multiples of 8, not {head_dim}"
    if backend != "sdpa_efficient" and (head_dim % 8 or head_dim > 256):
        return f"{backend} takes head sizes 8, 16, ..., 256, not {head_dim}"
    # no CUDA device here (a CPU build asked about "cuda"): no capability, so no sm80 kernel
    sm80 = (capability or (torch.cuda.get_device_capability() if torch.cuda.is_available() else (0, 0))) >= (8, 0)
    if backend == "sdpa_efficient":
        return "sdpa_efficient takes bfloat16 only on sm80+ GPUs" if dtype == torch.bfloat16 and not sm80 else None
    if dtype not in _HALF_DTYPES:
        return f"{backend} takes float16/bfloat16 only, not {dtype}"
    if not sm80:
        return f"{backend} needs an sm80+ (Ampere or newer) GPU"
    if backend == "sdpa_cudnn":
        if head_dim > 128:
            return f"sdpa_cudnn takes head sizes up to 128, not {head_dim}"
        version = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
        return None if version and version >= 90000 else f"sdpa_cudnn needs cuDNN 9 (found {version})"
    if flash_attn_installed is None:
        flash_attn_installed = _flash_attn_interface() is not None
    if backend == "flash_attn" and not flash_attn_installed:
        return "flash-attn is not installed (pip install flash-attn --no-build-isolation)"
    return None


# Note [Head sizes above 256]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Gemma 4's full-attention layers have heads of 512 (global_head_dim). flash-attn, torch's flash
# kernel and cuDNN stop at 256 (cuDNN here at 128), so "auto" would fall to "math", which builds
# each block's scores in float32. torch's memory-efficient kernel has no largest head size: its
# selection (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp, check_head_dim_size_mem_efficient)
# asks only that the head size be a multiple of the GEMM alignment (8 for 16-bit inputs on sm80+),
# and its CUTLASS kernels include ones for any head size up to 65536, which stream K and V through
# global memory (mem_eff_attention/kernels/cutlassF.h: fmha_cutlassF_bf16_aligned_32x128_gmem_sm80,
# kMaxK 65536; backward likewise in cutlassB.h). Read in pytorch's source through the code index; the
# ops' meta registrations in torch 2.13 take (1, 4, 1000, 512) bfloat16 inputs and give the
# forward's out and 32-padded lse and the backward's three gradients. So a layer of heads over 256
# runs sdpa_efficient under "auto" and a layer of the same model with smaller heads the faster kernel
# (select_backend chooses per call). The GPU report's correctness part checks it against math. The
# planner does the same per call (workspace.ModelledBackend.for_heads) and models those kernels'
# global-memory workspace (Note [GPU attention kernels' workspace] in workspace.py).


def check_backend(
    backend: str, device_type: str, dtype: torch.dtype, head_dim: int, *, name: str | None = None, **kwargs
) -> None:
    """Refuse, in one line, a ``backend`` that cannot run (see :func:`backend_problem`),
    naming the backends that would. ``name``: how the message calls the choice (a flag)."""
    problem = backend_problem(backend, device_type, dtype, head_dim, **kwargs)
    if problem is not None:
        usable = [b for b in BACKENDS if backend_problem(b, device_type, dtype, head_dim, **kwargs) is None]
        raise ValueError(
            f"{name or f'attention backend {backend!r}'} cannot run here: {problem}; backends that would run "
            f"({device_type}, {str(dtype).removeprefix('torch.')}, head size {head_dim}): {', '.join(usable)}"
        )


def _capability(device: torch.device) -> tuple[int, int] | None:
    """The compute capability of an NVIDIA GPU; None elsewhere, ROCm included (torch reports an
    MI250 as (9, 0), and its build has no cuDNN attention: ``cudnn.version()`` is MIOpen's there)."""
    if device.type != "cuda" or torch.version.hip is not None:
        return None
    return tuple(torch.cuda.get_device_capability(device))


def select_backend(q: torch.Tensor, *, varlen: bool = False) -> Backend | None:
    """The fastest backend that supports ``q``'s device, dtype and head size ("auto"); with
    ``varlen``, the fastest of those with a varlen kernel, or None where none runs."""
    capability = _capability(q.device)
    for backend in BACKENDS:
        if backend in AUTO_GPUS and capability not in AUTO_GPUS[backend] or varlen and backend not in VARLEN:
            continue
        if backend_problem(backend, q.device.type, q.dtype, q.shape[-1]) is None:
            return backend
    if varlen:
        return None
    raise AssertionError("math runs everywhere")


def attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    scale: float | None = None,
    backend: Backend | None = None,
    softcap: float = 0.0,
    lag: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one block. Returns ``(out, lse)``; see the module docstring. ``softcap`` > 0:
    scores capped to softcap * tanh(s / softcap) (Note [Soft-capped attention]); ``lag``: key j
    hidden from query i when i - j > lag (a sliding window; rows that see no key get out = 0,
    lse = -inf)."""
    _check_shapes(q, k, v, causal)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    backend = resolve_backend(backend, q)
    parts = window_parts(q.shape[2], k.shape[2], causal, lag)
    if parts is None:
        return _forward(q, k, v, causal, scale, backend, softcap, None)
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:3], float("-inf"), dtype=accumulation_dtype(q), device=q.device)
    for rows, keys, part_lag in parts:
        out[:, :, rows], lse[:, :, rows] = _forward(
            q[:, :, rows], k[:, :, keys], v[:, :, keys], causal, scale, backend, softcap, part_lag
        )
    return out, lse


def _forward(q, k, v, causal, scale, backend, softcap, lag):
    if softcap or lag is not None:
        backend = window_or_cap_backend(backend, softcap)
        if backend == "flash_attn":
            return flash_attn_forward(q, k, v, causal, scale, fa=_flash_attn_module(backend), softcap=softcap,
                                       lag=lag)
        if backend == "sdpa_flash":
            return sdpa_flash_window_forward(q, k, v, causal, scale, lag, ops=_sdpa_ops(backend))
        return _dense_forward(q, k, v, causal, scale, softcap, lag)
    if backend == "sdpa_cpu":
        out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, scale=scale
        )
        return out, lse.to(accumulation_dtype(q))
    if backend in ("sdpa_flash", "sdpa_efficient"):
        return sdpa_cuda_forward(q, k, v, causal, scale, flash=backend == "sdpa_flash", ops=_sdpa_ops(backend))
    if backend == "sdpa_cudnn":
        return sdpa_cudnn_forward(q, k, v, causal, scale, ops=_sdpa_ops(backend))
    if backend == "flash_attn":
        return flash_attn_forward(q, k, v, causal, scale, fa=_flash_attn_module(backend))
    return math_forward(q, k, v, causal, scale)


def attention_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    causal: bool,
    scale: float | None = None,
    backend: Backend | None = None,
    softcap: float = 0.0,
    lag: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients ``(dq, dk, dv)`` of one block, given the softmax statistics.

    ``out`` and ``lse`` may be the *final* (merged) output and log-sum-exp of
    the full attention row rather than this block's own: the block's softmax
    probabilities are then ``exp(s - lse)`` of the whole row, which is exactly
    what the gradient of the merged output needs (the trick of
    FlashAttention-2's backward, Dao 2023, reused by ring attention). dk/dv
    have the key/value head count of ``k``/``v``.
    """
    _check_shapes(q, k, v, causal)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    backend = resolve_backend(backend, q)
    out = out.to(q.dtype)
    parts = window_parts(q.shape[2], k.shape[2], causal, lag)
    if parts is None:
        return _backward(dout, q, k, v, out, lse, causal, scale, backend, softcap, None)
    acc = accumulation_dtype(q)
    dq = torch.zeros_like(q)
    dk, dv = torch.zeros_like(k, dtype=acc), torch.zeros_like(v, dtype=acc)  # the parts may share keys
    for rows, keys, part_lag in parts:
        dq[:, :, rows], part_dk, part_dv = _backward(
            dout[:, :, rows], q[:, :, rows], k[:, :, keys], v[:, :, keys], out[:, :, rows], lse[:, :, rows],
            causal, scale, backend, softcap, part_lag,
        )
        dk[:, :, keys] += part_dk
        dv[:, :, keys] += part_dv
    return dq, dk.to(k.dtype), dv.to(v.dtype)


def _backward(dout, q, k, v, out, lse, causal, scale, backend, softcap, lag):
    if softcap or lag is not None:
        backend = window_or_cap_backend(backend, softcap)
        if backend == "flash_attn":
            return flash_attn_backward(dout, q, k, v, out, lse, causal, scale, fa=_flash_attn_module(backend),
                                        softcap=softcap, lag=lag)
        if backend == "sdpa_flash":
            return sdpa_flash_window_backward(dout, q, k, v, out, lse, causal, scale, lag, ops=_sdpa_ops(backend))
        return _dense_backward(dout, q, k, v, out, lse, causal, scale, softcap, lag)
    if backend == "sdpa_cpu":
        return _aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout.to(q.dtype).contiguous(), q, k, v, out, lse.to(accumulation_dtype(q)), 0.0, causal, scale=scale
        )
    if backend in ("sdpa_flash", "sdpa_efficient"):
        return sdpa_cuda_backward(
            dout, q, k, v, out, lse, causal, scale, flash=backend == "sdpa_flash", ops=_sdpa_ops(backend)
        )
    if backend == "sdpa_cudnn":
        return sdpa_cudnn_backward(dout, q, k, v, out, lse, causal, scale, ops=_sdpa_ops(backend))
    if backend == "flash_attn":
        return flash_attn_backward(dout, q, k, v, out, lse, causal, scale, fa=_flash_attn_module(backend))
    return math_backward(dout, q, k, v, out, lse, causal, scale)


def has_varlen(backend: Backend) -> bool:
    """Whether ``backend`` (a resolved one: a name or a modelled backend) has a varlen kernel."""
    return backend in VARLEN


def varlen_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int, max_seqlen_k: int, *, causal: bool, scale: float, backend: Backend, softcap: float = 0.0,
    window: tuple[int, int] = NO_WINDOW,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of n independent segments in one call of a ``VARLEN`` backend.

    q: (Tq, H, D), k/v: (Tk, Hkv, D), contiguous; segment i is queries ``cu_seqlens_q[i] :
    cu_seqlens_q[i + 1]`` x keys ``cu_seqlens_k[i] : cu_seqlens_k[i + 1]`` (int32, (n + 1,),
    on q's device), causal segments square. ``window``: flash's (window_size_left, window_size_right)
    of every segment, aligned to its bottom-right corner (``windows.flash_segments``). Returns out
    (Tq, H, D) in q's dtype and lse (H, Tq) in the accumulation dtype (Note [Varlen document calls]).
    """
    _check_varlen(backend, softcap, window)
    if backend == "sdpa_flash":
        ops = _sdpa_ops(backend)
        out, lse, *_ = ops._flash_attention_forward(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, 0.0, causal, False, scale=scale,
            **_sdpa_window(window),
        )
    elif backend == "flash_attn":
        result = call_by_keyword(
            _flash_attn_module(backend)._flash_attn_varlen_forward, q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q,
            cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, dropout_p=0.0,
            softmax_scale=scale, causal=causal, window_size_left=window[0], window_size_right=window[1],
            softcap=softcap, alibi_slopes=None, return_softmax=False,
        )
        out, lse = (result[0], result[1]) if len(result) == 4 else (result[0], result[5])
    else:
        raise ValueError(f"attention backend {backend!r} has no varlen kernel; varlen backends: {VARLEN}")
    return out, lse.to(accumulation_dtype(q))


def varlen_backward(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, *,
    causal: bool, scale: float, backend: Backend, softcap: float = 0.0, window: tuple[int, int] = NO_WINDOW,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq (Tq, H, D), dk, dv (Tk, Hkv, D)) of :func:`varlen_forward`'s segments, given
    each query row's final ``out`` (Tq, H, D) and ``lse`` (H, Tq), as :func:`attention_backward`."""
    dout, out = dout.to(q.dtype).contiguous(), out.to(q.dtype).contiguous()
    lse = lse.to(accumulation_dtype(q)).contiguous()
    _check_varlen(backend, softcap, window)
    if backend == "sdpa_flash":
        zero = torch.zeros((), dtype=torch.int64, device=q.device)  # philox seed/offset: unread without dropout
        return _sdpa_ops(backend)._flash_attention_backward(
            dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, 0.0, causal,
            zero, zero, scale=scale, **_sdpa_window(window),
        )
    if backend == "flash_attn":
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        call_by_keyword(
            _flash_attn_module(backend)._flash_attn_varlen_backward, dout=dout, q=q, k=k, v=v, out=out,
            softmax_lse=lse, dq=dq, dk=dk, dv=dv, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
            max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, dropout_p=0.0, softmax_scale=scale,
            causal=causal, window_size_left=window[0], window_size_right=window[1], softcap=softcap,
            alibi_slopes=None, deterministic=False, rng_state=None,
        )
        return dq, dk, dv
    raise ValueError(f"attention backend {backend!r} has no varlen kernel; varlen backends: {VARLEN}")


def _check_varlen(backend: Backend, softcap: float, window: tuple[int, int]) -> None:
    """Refuse a soft-cap that ``backend``'s varlen kernel has not, and a window where the per-piece
    path refuses one (``windows.window_or_cap_backend``: torch's flash kernel on ROCm)."""
    if softcap and backend != "flash_attn":
        raise ValueError(f"attention backend {backend!r} has no soft-capping (Note [Soft-capped attention])")
    if window != NO_WINDOW:
        window_or_cap_backend(backend, softcap)


def _sdpa_window(window: tuple[int, int]) -> dict[str, int]:
    """torch's op's window keywords: none for no window, so that such a call is the one torch's
    SDPA makes (Note [Windows on torch's flash kernel] in kernel_calls.py)."""
    if window == NO_WINDOW:
        return {}
    return dict(window_size_left=window[0], window_size_right=window[1])


def resolve_backend(backend: Backend | None, q: torch.Tensor) -> Backend:
    """``backend``, refused in one line if it cannot run on ``q``; None: :func:`select_backend`."""
    if backend is None:
        return select_backend(q)
    if isinstance(backend, ModelledBackend):  # a CPU stand-in: runs wherever the planner runs
        return backend.for_heads(q.shape[-1])
    check_backend(backend, q.device.type, q.dtype, q.shape[-1])
    return backend


def _sdpa_ops(backend: Backend):
    """torch's ops, or their CPU stand-ins for a modelled backend."""
    return SDPA_OPS if isinstance(backend, ModelledBackend) else _aten


def _flash_attn_module(backend: Backend):
    """flash-attn's interface module, or its CPU stand-in for a modelled backend."""
    return FLASH_ATTN if isinstance(backend, ModelledBackend) else _flash_attn_interface()


def _check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> None:
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4:
        raise ValueError(
            f"expected q (B, H, Sq, D) and k, v (B, Hkv, Sk, D); got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}"
        )
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of key/value heads ({k.shape[1]})")
    if causal and q.shape[2] != k.shape[2]:
        raise ValueError(f"causal blocks must be square; got Sq={q.shape[2]}, Sk={k.shape[2]}")


def merge_block(
    out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor
) -> None:
    """Merge one block's ``(block_out, block_lse)`` into the fp32 running ``(out, lse)`` in place.

    With l = lse and b = block_lse, the merged lse is log(e^l + e^b) and the
    merged output is the lse-weighted average of the two outputs. Written with
    sigmoid / logsigmoid so no exponential can overflow (the form used by
    ring-flash-attention's ``_update_out_and_lse``):

        out <- out - sigmoid(b - l) * (out - block_out)
        lse <- lse - logsigmoid(l - b)

    A row that has seen no key yet (l = -inf, out = 0, as document masks start)
    takes the block's values; a row that sees no key of the block (b = -inf) keeps
    its own; a row with neither stays (0, -inf). No NaN in any of the three.
    """
    empty = lse == float("-inf")
    weight = torch.sigmoid(block_lse - lse).masked_fill_(empty, 1.0)[..., None]  # (B, H, S, 1)
    out.sub_(weight * (out - block_out.to(out.dtype)))
    lse.sub_(torch.nn.functional.logsigmoid(lse - block_lse).masked_fill_(empty, 0.0))
    lse.copy_(torch.where(empty, block_lse.to(lse.dtype), lse))
