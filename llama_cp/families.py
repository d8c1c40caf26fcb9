"""The HF model families llama-cp trains exactly, and what it refuses.

llama-cp swaps two pieces of an HF causal LM: the attention function (causal,
full window, no mask, soft-capped scores where the family caps them) and the loss path (the chunked
cross-entropy of ``llama_cp.loss``, which must repeat what the family's
``*ForCausalLM.forward`` does to the ``lm_head`` output). A family is supported
only where both were checked against the plain single-process transformers
model (``tests/test_families.py``: logits, loss and every gradient, ring and
Ulysses, cp 2 and 4, with and without FSDP). Any other model, or a supported
one configured with a feature the kernel does not compute, is refused when CP
is applied, with the reason and the fix, rather than trained differently.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from llama_cp.models import base_causal_lm


@dataclass(frozen=True)
class LogitTransform:
    """What a family's forward does to the ``lm_head`` output before the loss:
    ``logits = softcap * tanh(scale * raw / softcap)``, or ``scale * raw`` without a softcap."""

    scale: float = 1.0
    softcap: float | None = None


def _plain(config) -> LogitTransform:
    return LogitTransform()


def _granite(config) -> LogitTransform:  # GraniteForCausalLM: logits / config.logits_scaling
    return LogitTransform(scale=1.0 / config.logits_scaling)


def _cohere(config) -> LogitTransform:  # CohereForCausalLM: logits * config.logit_scale
    return LogitTransform(scale=config.logit_scale)


def _final_softcap(config) -> LogitTransform:  # Gemma2ForCausalLM: tanh soft-capping
    return LogitTransform(softcap=config.final_logit_softcapping)


#: ``config.model_type`` -> its logit transform; the families tested exact.
SUPPORTED_FAMILIES: dict[str, Callable[..., LogitTransform]] = {
    "llama": _plain,
    "mistral": _plain,
    "qwen2": _plain,
    "qwen3": _plain,
    "gemma": _plain,
    "olmo2": _plain,
    "granite": _granite,
    "cohere": _cohere,
    "gemma2": _final_softcap,
    "phi3": _plain,  # fused qkv_proj / gate_up_proj: attention still receives q, k, v
}

#: Families whose attention reads ``config.sliding_window`` itself (others set it per layer).
_WINDOW_IN_CONFIG = {"mistral", "phi3"}

#: Why some well-known families are refused.
_REFUSAL_REASONS = {
    "phi": "its attention has no o_proj and a partial rotary embedding",
}


def model_family(model: nn.Module) -> str:
    return base_causal_lm(model).config.model_type


def check_supported(model: nn.Module, *, max_seq_len: int | None = None) -> LogitTransform:
    """Raise a ValueError naming the cause and the fix unless llama-cp computes ``model``
    exactly; returns the family's :class:`LogitTransform`.

    ``max_seq_len``: the longest (global) sequence the model will see; sliding windows
    at least that long never cut anything and are accepted. Without it, a sliding
    window is checked against each call's sequence in the attention function.
    """
    causal_lm = base_causal_lm(model)
    config, family = causal_lm.config, causal_lm.config.model_type
    if family not in SUPPORTED_FAMILIES:
        reason = _REFUSAL_REASONS.get(family, "it has not been checked exact against single-process transformers")
        raise ValueError(
            f"model family {family!r} ({type(causal_lm).__name__}) is not supported by llama-cp: {reason}. "
            f"Supported families: {', '.join(sorted(SUPPORTED_FAMILIES))}"
        )
    if getattr(config, "attention_dropout", 0.0):
        raise ValueError(
            f"{family}: config.attention_dropout={config.attention_dropout}; context-parallel attention has no "
            "attention dropout: set it to 0.0"
        )
    windows = {w for m in causal_lm.modules() if (w := getattr(m, "sliding_window", None)) is not None}
    if family in _WINDOW_IN_CONFIG and config.sliding_window is not None:
        windows.add(config.sliding_window)
    if windows and max_seq_len is not None and min(windows) < max_seq_len:
        raise ValueError(
            f"{family}: sliding-window attention of {min(windows)} tokens is shorter than the sequence "
            f"({max_seq_len} tokens) and context-parallel attention has no sliding window; use "
            f"--context_length <= {min(windows)}, or a model without sliding window"
        )
    return SUPPORTED_FAMILIES[family](config)
