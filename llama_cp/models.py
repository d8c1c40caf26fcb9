"""The embedded default model: a small Llama config, random init, no download."""

from __future__ import annotations

import os

import torch
from torch import nn
from transformers import LlamaConfig

#: Small enough to train on a 2-core CPU, shaped like Llama 3 (GQA, RoPE theta 500k).
EMBEDDED_LLAMA = dict(
    vocab_size=1024,
    hidden_size=256,
    intermediate_size=688,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=1 << 20,
    rope_theta=500000.0,
    tie_word_embeddings=False,
)


def embedded_llama_config(**overrides) -> LlamaConfig:
    """The embedded Llama config; keyword arguments override its fields."""
    return LlamaConfig(**{**EMBEDDED_LLAMA, **overrides})


def compute_dtype(choice: str | torch.dtype | None, device_type: str) -> torch.dtype | None:
    """The one rule for the compute dtype of the gathered parameters (``--dtype``): "auto" is
    bfloat16 on CUDA and the stored float32 elsewhere; "bfloat16" is bfloat16; "float32" or
    None keep the stored float32; a torch dtype is taken as it is. The planner asks for
    ``device_type="cuda"`` (it plans GPU runs)."""
    if choice == "auto":
        return torch.bfloat16 if device_type == "cuda" else None
    if isinstance(choice, str):
        return {"bfloat16": torch.bfloat16, "float32": None}[choice]
    return choice


def base_causal_lm(model: nn.Module) -> nn.Module:
    """The HF causal LM itself: ``model``, or the model a peft wrapper holds."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of an HF model (the classes in its ``_no_split_modules``), also under peft."""
    base = base_causal_lm(model)
    names = set(getattr(base, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(f"found no decoder layers ({sorted(names)}) in {type(model).__name__}")
    return layers


def build_causal_lm(config, device: torch.device | str = "cpu") -> nn.Module:
    """The HF causal LM of ``config`` with float32 parameters on ``device`` (``"meta"``: no
    memory, to load sharded weights into or to plan with), whatever dtype the checkpoint's
    config names. The trainer and the memory planner both build here, so what FSDP shards,
    and the optimizer state made from it, is float32; bf16 is only FSDP's compute dtype
    (``shard_model``'s ``param_dtype``)."""
    from transformers import AutoModelForCausalLM

    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


#: Files that hold a tokenizer in an HF model directory (any one is enough).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")


def check_model_name(name: str) -> None:
    """Fail before anything is built when ``--model_name`` names a local directory (a path:
    it starts with /, ./, ../ or ~, or exists) that is missing or is no HF model directory.
    Other names are hub ids ("meta-llama/Llama-3.1-8B") or "embedded"."""
    if name == "embedded":
        return
    path = os.path.expanduser(name)
    looks_local = name.startswith(("/", "./", "../", "~")) or os.path.exists(path)
    if not looks_local:
        return
    if not os.path.isdir(path):
        raise FileNotFoundError(
            f"--model_name {name!r}: no such directory ({os.path.abspath(path)}); pass a local HF model "
            "directory (with config.json, *.safetensors and the tokenizer), a hub id, or embedded"
        )
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(
            f"--model_name {name!r} has no config.json: it is not an HF model directory "
            "(write one with save_pretrained)"
        )


def check_tokenizer_files(path: str) -> None:
    """FileNotFoundError naming the fix when the model directory ``path`` holds no tokenizer."""
    if not any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES):
        raise FileNotFoundError(
            f"--model_name {path!r} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}); copy the "
            "tokenizer files of the original model into it (tokenizer.save_pretrained)"
        )
