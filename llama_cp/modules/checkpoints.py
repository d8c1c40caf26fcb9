"""A checkpoint directory read as the causal LM llama-cp trains: its config (the text model's, for a
vision-language checkpoint) and its tensors by the names of that model.

    config = checkpoint_config(path)         # AutoConfig's; a vision-language one's text config
    state = text_model_tensors(state)        # the text model's tensors, by its names

Note [The text model of a vision-language checkpoint] says what is kept and why.
"""

from __future__ import annotations

import json
import os

import torch

# Note [The text model of a vision-language checkpoint]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Gemma 3 from 4B up, every Gemma 3n and Gemma 4, Mistral Small 3.1/3.2, Ministral 3, every Llama 4 and
# Apertus 1.5 are released as vision-language checkpoints: config model_type gemma3 / gemma3n / gemma4
# (gemma4_unified: 12B) / mistral3 / llama4 / apertus1p5 (Gemma3-, Gemma3n-, Gemma4-, Gemma4Unified-, Mistral3-,
# Llama4- and Apertus1p5ForConditionalGeneration; Gemma 3n and Gemma 4's small ones hold an audio tower too,
# Apertus 1.5 image and audio tokenizers whose codes are tokens of its vocabulary), the language model's
# settings in config.text_config. Gemma 3n's released files also hold k/v projections for the layers that
# reuse keys and values, which its text model has not (transformers drops them on load too); what the model
# has no parameter for is not read.
# transformers' AutoModelForCausalLM builds the whole vision-language model for gemma3, refuses
# mistral3 and builds Llama4ForCausalLM from the whole llama4 config; its text classes
# (Gemma3ForCausalLM, Ministral3ForCausalLM, MistralForCausalLM) given such a directory load none of
# its weights: they stay random, with a warning (transformers 5.24: every tensor MISSING). llama-cp
# trains the text model: it is built from text_config, and its tensors are the checkpoint's language
# model and lm_head, renamed:
#
#     language_model.model.X, model.language_model.X  ->  model.X
#     language_model.lm_head.X, lm_head.X              ->  lm_head.X
#
# (the first of each pair as the released checkpoints and transformers' save_pretrained write
# them, the second as transformers 5 names them in memory). Neither config says reliably whether
# the head is tied: Mistral Small's names no top-level tie_word_embeddings (Mistral3Config's
# default is True) and stores its own head, which transformers keeps untied; a Ministral 3 text
# config says False where the model ties and stores none. So the head is tied exactly when the
# checkpoint stores none. The vision (and audio) towers and the projectors are not loaded. On text rows the
# vision-language model computes what its text model does (no image token, so nothing is merged
# into the embeddings): tests/modules/test_checkpoints.py checks the logits equal. What the run
# writes (checkpoints, final/, exports) is the text model; a LoRA adapter's names are the text
# model's, so the vision-language model does not take it: merge it (--merge_lora, recipes.export).
# Only the types of VISION_LANGUAGE_TYPES are read so; other vision-language models are refused as
# families.


def _text_causal_lm_name(config) -> str | None:
    """The class AutoModelForCausalLM builds from ``config``'s type, or None."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)


#: Vision-language model types whose checkpoints store the language model under the names
#: text_model_tensors renames (tests/modules/test_checkpoints.py builds each). Others (Idefics3 and
#: SmolVLM keep theirs under model.text_model; PaliGemma and the rest are not checked) are refused as
#: families by name.
VISION_LANGUAGE_TYPES = frozenset({"gemma3", "gemma3n", "gemma4", "gemma4_unified", "mistral3", "llama4",
                                   "apertus1p5"})
#: The index of a sharded safetensors checkpoint.
INDEX = "model.safetensors.index.json"
#: Where a vision-language checkpoint stores its own lm_head (absent: tied to the embedding).
_HEADS = ("lm_head.weight", "language_model.lm_head.weight")


def vision_language(config) -> bool:
    """Whether ``config`` is a vision-language checkpoint's whose text model llama-cp builds (Note [The
    text model of a vision-language checkpoint])."""
    return config.model_type in VISION_LANGUAGE_TYPES and getattr(config, "text_config", None) is not None


def checkpoint_names(path: str) -> set[str] | None:
    """The tensor names of the checkpoint directory ``path`` (its index, else the safetensors files'
    headers; no tensor is read), None without safetensors files."""
    index = os.path.join(path, INDEX)
    if os.path.isfile(index):
        with open(index) as f:
            return set(json.load(f)["weight_map"])
    files = safetensors_files(path)
    if not files:
        return None
    from safetensors import safe_open

    names: set[str] = set()
    for name in files:
        with safe_open(os.path.join(path, name), "pt") as f:
            names.update(f.keys())
    return names


def text_config(config, path: str | None = None):
    """``config``, or the text config of a vision-language checkpoint's, tied as its model is: tied
    when the checkpoint at ``path`` stores no head of its own (Mistral Small's config names no
    tie_word_embeddings, whose class default is True, and stores one; Ministral 3's says True and stores
    none), else (no files: the planner's hub configs) as its text config says."""
    if not vision_language(config):
        return config
    text = config.text_config
    names = checkpoint_names(path) if path is not None else None
    if names is not None:
        text.tie_word_embeddings = not any(head in names for head in _HEADS)
    # what the run's exports name as their class (vLLM and transformers' pipelines read it); a text
    # config has none of its own
    if _text_causal_lm_name(text):
        text.architectures = [_text_causal_lm_name(text)]
    return text


def safetensors_files(path: str) -> list[str]:
    """The safetensors files of the checkpoint in ``path``: those its index names, else every one but
    a second copy in another layout (Mistral's repositories ship consolidated.safetensors, its own
    names, beside model*.safetensors)."""
    index = os.path.join(path, INDEX)
    if os.path.isfile(index):
        with open(index) as f:
            return sorted(set(json.load(f)["weight_map"].values()))
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    return [f for f in files if f.startswith("model")] or files


def checkpoint_config(path: str, config=None):
    """The config llama-cp builds the model of the directory ``path`` from (``text_config``),
    after :func:`check_quantization`; ``config``: its AutoConfig when read already."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path) if config is None else config
    check_quantization(config, path)
    return text_config(config, path)


def vision_language_line(config, path: str) -> str | None:
    """What a run says when ``path``'s checkpoint is a vision-language one, else None."""
    if not vision_language(config):
        return None
    whole = (getattr(config, "architectures", None) or [type(config).__name__])[0]
    text = _text_causal_lm_name(config.text_config) or config.text_config.model_type
    return (f"model: {path} is a vision-language checkpoint ({whole}): llama-cp trains its text model, {text} "
            "(the language model and lm_head); the vision tower and projector are not loaded, and the "
            "checkpoints and exports of this run hold the text model (a LoRA adapter: merge it, --merge_lora)")


#: quant_method values of checkpoints llama-cp loads (MXFP4: dequantized by transformers, Note [MXFP4
#: checkpoints] in llama_cp/model/build.py).
LOADED_QUANTIZATIONS = {"mxfp4"}


def check_quantization(config, path: str) -> None:
    """ValueError naming the fix when ``path``'s checkpoint stores quantized weights (FP8 with scales,
    bitsandbytes, GPTQ, AWQ): read as plain tensors they would train as different numbers."""
    quantization = getattr(config, "quantization_config", None)
    if quantization is None:
        return
    method = (quantization.get("quant_method") if isinstance(quantization, dict)
              else getattr(quantization, "quant_method", None))
    method = getattr(method, "value", method)
    if method in LOADED_QUANTIZATIONS:
        return
    raise ValueError(
        f"--model_name {path!r}: the checkpoint's weights are quantized (config.json quantization_config "
        f"quant_method {method!r}); llama-cp trains from unquantized weights: use the model's bfloat16 release "
        "(the same repository without -FP8/-AWQ/-GPTQ/-bnb-4bit), and for a 4-bit base add --quantization 4bit"
    )


_RENAMES = (("language_model.model.", "model."), ("model.language_model.", "model."),
            ("language_model.lm_head.", "lm_head."), ("lm_head.", "lm_head."))


def text_model_tensors(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A vision-language checkpoint's tensors as its text model names them, the others dropped (Note
    [The text model of a vision-language checkpoint]); any other checkpoint's as they are."""
    if not any(key.startswith(("language_model.", "model.language_model.")) for key in state):
        return state
    renamed = {}
    for key, tensor in state.items():
        for old, new in _RENAMES:
            if key.startswith(old):
                renamed[new + key[len(old):]] = tensor
                break
    return renamed
