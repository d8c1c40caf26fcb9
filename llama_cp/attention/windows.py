"""Soft-capped and windowed attention calls: which backend computes them, and how a windowed call
is cut into kernel calls in which every query row sees a key. ``llama_cp/attention/kernels.py``
makes the calls; ``llama_cp/attention/varlen.py`` groups the windowed pieces of packed documents
into varlen calls.

Note [Soft-capped attention]
----------------------------

Gemma 2 caps every score s = scale q.k at softcap * tanh(s / softcap) before
the softmax (``attn_logit_softcapping``, 50). ``softcap`` > 0 in the functions of
``kernels.py`` computes exactly that, and returns the lse of the capped scores, so blocks merge
and the backward takes the merged (out, lse) as without a cap; the backward
multiplies P (dP - delta) by the cap's derivative 1 - tanh^2(s / softcap).
flash_attn takes it as its ``softcap`` argument, forward and backward, plain and
varlen: in csrc/flash_attn/flash_api.cpp (``set_params_fprop``, which the
backward's ``set_params_dgrad`` calls too) a positive softcap only turns the
scales into softmax_scale / softcap (inside the tanh) and softcap (outside), so
the kernels allocate what they allocate without it, and the planner's stand-ins
(``workspace.py``) compute the values with the exact CPU kernel. On CPU,
sdpa_cpu and math have no cap: the exact kernel of ``llama_cp/attention/dense.py``
materialises the float32 scores of DENSE_ROWS queries at
a time. torch's CUDA kernels (sdpa_flash, sdpa_efficient) have no cap and are
refused in one line.

``lag`` (a sliding window, Note [Sliding windows under CP] in ``llama_cp/attention/documents.py``)
hides key j from query i, in the call's own indices, when i - j > lag. A windowed call
becomes at most two kernel calls in which every row sees a key (:func:`window_parts`); rows
that see nothing get out = 0, lse = -inf and no gradient. flash_attn takes the window as
``window_size_left`` / ``window_size_right`` (``kernel_calls.flash_window``), and so does torch's flash kernel,
which also takes sdpa_cudnn's windowed calls (Note [Windows on torch's flash kernel] in
kernel_calls.py); the CPU backends use the exact kernel of ``llama_cp/attention/dense.py``;
sdpa_efficient is refused in one line.
"""

from __future__ import annotations

import torch

from llama_cp.attention.kernel_calls import flash_window
from llama_cp.attention.workspace import ModelledBackend


def window_parts(num_q: int, num_k: int, causal: bool, lag: int | None) -> list[tuple[slice, slice, int | None]] | None:
    """A call of ``num_q`` queries x ``num_k`` keys with window ``lag`` as kernel calls on
    (query rows, keys, lag) in which every row sees a key; None when the window hides nothing.

    A causal call is square: every row sees its own key, one call. A full call (keys before
    the queries) is at most two: the rows that see every key (i <= lag), without a window;
    the rows that see a suffix of the keys (i - lag < num_k), against the keys the first of
    them sees, with lag 0 there (row i' sees keys j' >= i'), so no call has more queries than
    keys, as flash-attn's windows need (Note [Sliding windows under CP]). The rows after see
    nothing (out 0, lse -inf).
    """
    if lag is None or lag >= num_q - 1:  # query num_q - 1 sees key 0: nothing hidden
        return None
    if causal:
        return [(slice(0, num_q), slice(0, num_k), lag)]
    whole = min(num_q, max(0, lag + 1))  # rows 0 .. whole - 1 see every key
    seeing = min(num_q, max(0, lag + num_k))  # rows whole .. seeing - 1 see keys j >= i - lag
    parts = [(slice(0, whole), slice(0, num_k), None)] if whole else []
    if seeing > whole:
        parts.append((slice(whole, seeing), slice(whole - lag, num_k), 0))
    return parts


def window_or_cap_backend(backend: str, softcap: float) -> str:
    """The backend that computes a soft-capped or windowed call in place of ``backend``:
    flash_attn itself; for a window without a cap, sdpa_flash on CUDA (Note [Windows on torch's
    flash kernel] in kernel_calls.py), in place of sdpa_cudnn too, whose op takes no window (both
    run float16/bfloat16 on sm80+, sdpa_flash head sizes up to 256 against cuDNN's 128); the exact
    CPU kernel (``llama_cp/attention/dense.py``) for sdpa_cpu and math; the rest (sdpa_efficient,
    torch's flash kernel on ROCm, whose window rules are unchecked) is refused in one line."""
    if backend == "flash_attn":
        return backend
    if backend in ("sdpa_cpu", "math"):
        return "math"
    if softcap:
        raise ValueError(
            f"attention soft-capping (Gemma 2's attn_logit_softcapping) needs --attention_backend flash_attn on CUDA "
            f"(flash-attn >= 2.6), and {backend!r} has none: install flash-attn (pip install flash-attn "
            "--no-build-isolation) or set attn_logit_softcapping to null in the model's config.json (a change of the "
            "model)"
        )
    if isinstance(backend, ModelledBackend) and backend == "sdpa_flash":
        return backend  # the planner's stand-in takes the window
    if backend in ("sdpa_flash", "sdpa_cudnn"):
        if torch.version.hip is not None:
            raise ValueError(
                f"sliding-window attention on ROCm needs --attention_backend flash_attn: torch's ROCm flash kernel "
                f"reads a window by rules of its own, which llama-cp has not checked, so {backend!r} is not given one"
            )
        return "sdpa_flash"
    raise ValueError(
        f"sliding-window attention on CUDA needs float16/bfloat16 (--dtype bfloat16) on an sm80+ GPU, where "
        f"sdpa_flash or flash_attn takes it; {str(backend)!r} (chosen for float32, or for a GPU older than sm80) takes "
        "none"
    )


#: The flash window of a call without one: flash-attn's (window_size_left, window_size_right).
NO_WINDOW = (-1, -1)


def flash_segments(num_q: int, num_k: int, causal: bool, lag: int | None) -> list[tuple[slice, slice, tuple[int, int]]]:
    """:func:`window_parts` of a call as (query rows, keys, flash window (left, right)): what a varlen call
    takes for each part (Note [Varlen document calls] in ``llama_cp/attention/varlen.py``); the whole
    call with :data:`NO_WINDOW` when the window hides nothing."""
    parts = window_parts(num_q, num_k, causal, lag)
    if parts is None:
        return [(slice(0, num_q), slice(0, num_k), NO_WINDOW)]
    result = []
    for rows, keys, part_lag in parts:
        sides = flash_window(part_lag, rows.stop - rows.start, keys.stop - keys.start, causal)
        result.append((rows, keys, (sides["window_size_left"], sides["window_size_right"])))
    return result
