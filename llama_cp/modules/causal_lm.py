"""The embedded default model: a small Llama config, random init, no download; model
structure helpers, the compute-dtype rule, and the RoPE settings of the command line."""

from __future__ import annotations

import contextlib
import json
import math
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
    # the embedded byte tokenizer's <|bos|>, <|eos|> (llama_cp/data/tokenizer.py): generate() stops at eos. Its
    # <|pad|> (256) is set at export only: a pad_token_id here would zero that embedding row (padding_idx)
    bos_token_id=257,
    eos_token_id=258,
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
    """The transformer blocks of an HF model (the classes in its ``_no_split_modules``), also under peft
    and FSDP2 (whose ``fully_shard`` names the class ``FSDP<name>``)."""
    base = base_causal_lm(model)
    names = set(getattr(base, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__.removeprefix("FSDP") in names]
    if not layers:
        raise ValueError(f"found no decoder layers ({sorted(names)}) in {type(model).__name__}")
    return layers


# Note [Buffers no checkpoint holds]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A checkpoint's model is built on the meta device, made real with to_empty and then given the
# checkpoint's tensors. Its non-persistent buffers are in no checkpoint: RoPE's inv_freq (in
# Gemma 3 and OLMo 3 one per layer type: full_attention_inv_freq, sliding_attention_inv_freq)
# and, in transformers 5, Gemma 1/2/3's embed_scale (sqrt(hidden_size): models/gemma3/
# modeling_gemma3.py Gemma3TextScaledWordEmbedding, 5.24). to_empty leaves them uninitialised
# memory. Rebuilding only the modules with a buffer named inv_freq missed both: a Gemma 3
# checkpoint trained with its embeddings scaled by whatever the memory held (zeros on a fresh
# CPU page: every gradient zero; against transformers, logits off by 0.9). So build_causal_lm
# builds such a model with its buffers on the CPU, as transformers computes them, and everything
# else on meta (_parameters_on_meta), keeps the buffers' values (``_built_buffers`` of the model),
# and leaves the model as a meta build was; llama_cp.fsdp_wrap.restore_buffers puts them back after
# to_empty. Nothing large may be made on the CPU meanwhile: a factory call (torch.empty, zeros, ...)
# of LARGE_ON_META elements or more is made on meta (DeepSeek-V3's fused experts are one 30 GB
# tensor, which torch.empty cannot even reserve on a small host; Llama 4's experts are torch.zeros,
# written); smaller ones are made and at once moved to meta when they become parameters.

#: Elements from which a tensor made while a model is built on meta is made there directly.
LARGE_ON_META = 1 << 20
_FACTORIES = frozenset({torch.empty, torch.zeros, torch.ones, torch.full, torch.randn, torch.rand,
                        torch.empty_strided})


def _requested_numel(args: tuple, kwargs: dict) -> int:
    """The number of elements a factory call asks for: its size as a sequence or as ints."""
    size = kwargs.get("size", args[0] if args else ())
    if isinstance(size, int):
        size = [arg for arg in args if isinstance(arg, int)]
    return math.prod(int(n) for n in size) if isinstance(size, (tuple, list, torch.Size)) else 0


class _LargeOnMeta(torch.overrides.TorchFunctionMode):
    """Factory calls of LARGE_ON_META elements or more, on the CPU or no device, made on meta."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _FACTORIES and torch.device(kwargs.get("device") or "cpu").type == "cpu" and (
                _requested_numel(args, kwargs) >= LARGE_ON_META):
            kwargs = {**kwargs, "device": "meta"}
        return func(*args, **kwargs)


@contextlib.contextmanager
def _parameters_on_meta():
    """Within: each parameter a module registers is moved to the meta device, and large tensors are
    made there (_LargeOnMeta); buffers stay on the CPU, computed."""
    register = nn.Module.register_parameter

    def register_on_meta(module, name, param):
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = register_on_meta
    try:
        with _LargeOnMeta():
            yield
    finally:
        nn.Module.register_parameter = register


def build_causal_lm(config, device: torch.device | str = "cpu") -> nn.Module:
    """The HF causal LM of ``config`` with float32 parameters on ``device`` (``"meta"``: no
    memory, to load sharded weights into or to plan with), whatever dtype the checkpoint's
    config names. The trainer and the memory planner both build here, so what FSDP shards,
    and the optimizer state made from it, is float32; bf16 is only FSDP's compute dtype
    (``shard_model``'s ``param_dtype``). The values of the buffers no checkpoint holds are kept
    for ``fsdp_wrap.restore_buffers`` (Note [Buffers no checkpoint holds])."""
    from transformers import AutoModelForCausalLM

    meta = torch.device(device).type == "meta"
    with _parameters_on_meta() if meta else torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    built = [(module, name, buffer) for module in model.modules() for name, buffer in
             module.named_buffers(recurse=False)
             if name in module._non_persistent_buffers_set and buffer.device.type != "meta"]  # not a large one
    model._built_buffers = built
    if meta:  # otherwise as a meta build was: every tensor on meta
        for module in model.modules():
            for name, buffer in module.named_buffers(recurse=False):
                module._buffers[name] = buffer.to("meta")
    return model


#: Files that hold a tokenizer in an HF model directory (any one is enough).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")
#: Written beside an exported adapter (llama_cp/train/export.py): its base model and the settings it must be
#: given; read back where the adapter is loaded again (recipes.export, llama_cp/eval/adapter.py).
EXPORT_INFO = "llama_cp_export.json"


def check_model_name(name: str) -> None:
    """Fail before anything is built when ``--model_name`` names a local directory (a path:
    it starts with /, ./, ../ or ~, or exists) that is missing or is no HF model directory, a
    .gguf file that is missing, or a packaged GGUF model whose package is not installed
    (``llama_cp.modules.gguf``). Other names are hub ids ("meta-llama/Llama-3.1-8B") or "embedded"."""
    if name == "embedded":
        return
    from llama_cp.modules.gguf import gguf_path, require_gguf

    if gguf_path(name) is not None:  # a .gguf file that exists, or an installed packaged model
        require_gguf()
        return
    path = os.path.expanduser(name)
    looks_local = name.startswith(("/", "./", "../", "~")) or os.path.exists(path)
    if not looks_local:
        return
    if not os.path.isdir(path):
        raise FileNotFoundError(
            f"--model_name {name!r}: no such directory ({os.path.abspath(path)}); pass a local HF model "
            "directory (with config.json, *.safetensors and the tokenizer), a .gguf file, a hub id, or embedded"
        )
    adapter = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(os.path.join(path, "config.json")) and os.path.isfile(adapter):
        with open(adapter) as f:
            base = json.load(f).get("base_model_name_or_path")
        raise FileNotFoundError(
            f"--model_name {name!r} is a LoRA adapter (adapter_config.json), not a model: train from its base "
            f"({f'--model_name {base}' if base else 'the model it was trained on'}), or merge it into its base first "
            f"(python -m recipes.export --checkpoint {name} --merge_lora --output_dir DIR) and train from DIR"
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


# Note [RoPE settings from the command line]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Context extension changes how RoPE turns positions into angles, in the model's config,
# before the model (and its rotary module) is built: --rope_theta sets the base frequency
# (ABF, as Llama 2 Long and Llama 3 raise it), --rope_scaling the scaling type and its
# parameters, in transformers' own names. transformers >= 5 keeps both in one dict,
# ``config.rope_parameters`` (with ``rope_theta`` in it); 4.x keeps ``config.rope_theta`` and
# ``config.rope_scaling`` apart. Both are written, so the exported config.json loads with
# the same RoPE anywhere.
#
# Each scaling type reaches a length, checked against --context_length:
#
#   linear    factor x max_position_embeddings       positions divided by factor
#   yarn      factor x original_max_position_embeddings  (default: the model's max_position_embeddings)
#   llama3    factor x original_max_position_embeddings
#   longrope  factor x original_max_position_embeddings  (factor default: max_position_embeddings / original)
#   dynamic   any length: the base grows with the longest position (max_position_embeddings is its start)
#
# and max_position_embeddings becomes that length (without scaling it grows to
# --context_length; dynamic keeps it, as its start), so the exported config says how long
# the model now reads; a bare --rope_theta leaves a model's own scaling as it is. For yarn
# and longrope this also keeps transformers 4.x exact: it derives their factor from
# max_position_embeddings / original_max_position_embeddings.

#: --rope_scaling types -> (required parameters, optional parameters), transformers' names.
ROPE_SCALING_PARAMETERS = {
    "default": ((), ()),
    "linear": (("factor",), ()),
    "dynamic": (("factor",), ()),
    "yarn": (("factor",), ("original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow",
                           "mscale", "mscale_all_dim", "truncate")),
    "llama3": (("factor", "low_freq_factor", "high_freq_factor"), ("original_max_position_embeddings",)),
    "longrope": (("short_factor", "long_factor"), ("factor", "original_max_position_embeddings", "attention_factor")),
}
ROPE_SCALING_EXAMPLE = "yarn:factor=8,original_max_position_embeddings=8192"


def parse_rope_scaling(value: str) -> dict | None:
    """``--rope_scaling`` as transformers' dict (``{"rope_type": ..., parameters}``), None for
    "none" (or empty). ``value`` is ``type:key=value,...`` (numbers, true/false) or a JSON
    object (needed for longrope's factor lists). ValueError, one line, for anything else
    (Note [RoPE settings from the command line])."""
    value = value.strip()
    if value in ("", "none"):
        return None
    fix = f"write it as {ROPE_SCALING_EXAMPLE} or as a JSON object"
    if value.startswith("{"):
        try:
            spec = json.loads(value)
        except json.JSONDecodeError as error:
            raise ValueError(f"--rope_scaling is not valid JSON ({error.msg}, column {error.colno}); {fix}") from None
        spec = dict(spec)
    else:
        rope_type, _, parameters = value.partition(":")
        spec = {"rope_type": rope_type.strip()}
        for item in filter(None, (part.strip() for part in parameters.split(","))):
            key, equals, text = item.partition("=")
            if not equals:
                raise ValueError(f"--rope_scaling: {item!r} is not key=value; {fix}")
            try:
                spec[key.strip()] = json.loads(text)
            except json.JSONDecodeError:
                raise ValueError(f"--rope_scaling: {key.strip()}={text} is not a number; {fix}") from None
    if "type" in spec:  # the older spelling of rope_type
        spec.setdefault("rope_type", spec.pop("type"))
    rope_type = spec.get("rope_type")
    if rope_type not in ROPE_SCALING_PARAMETERS:
        raise ValueError(
            f"--rope_scaling type {rope_type!r} is not one of {', '.join(ROPE_SCALING_PARAMETERS)}; {fix}"
        )
    required, optional = ROPE_SCALING_PARAMETERS[rope_type]
    missing = [key for key in required if key not in spec]
    unknown = sorted(set(spec) - {"rope_type", "rope_theta", *required, *optional})
    if missing or unknown:
        problems = [f"needs {', '.join(missing)}"] * bool(missing) + [f"has no {', '.join(unknown)}"] * bool(unknown)
        known = ", ".join((*required, *optional)) or "none"
        raise ValueError(f"--rope_scaling {rope_type} {' and '.join(problems)} (its parameters: {known})")
    factor = spec.get("factor")
    if factor is not None and (isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor < 1):
        raise ValueError(f"--rope_scaling {rope_type}: factor must be a number >= 1, got {factor!r}")
    return spec


def rope_parameters(config) -> dict:
    """The RoPE of ``config`` as one dict (``rope_type``, ``rope_theta``, parameters), from
    either transformers layout."""
    if hasattr(config, "rope_parameters"):  # transformers >= 5
        return dict(config.rope_parameters or {})
    scaling = dict(getattr(config, "rope_scaling", None) or {})
    if "type" in scaling:
        scaling.setdefault("rope_type", scaling.pop("type"))
    return {"rope_type": "default", **scaling, "rope_theta": config.rope_theta}


def apply_rope_settings(
    config, rope_theta: float = 0.0, rope_scaling: str = "none", context_length: int | None = None
):
    """Write ``--rope_theta`` (0: keep the model's) and ``--rope_scaling`` ("none": keep the model's)
    into the HF ``config`` before its model is built, after checking that the scaling reaches
    ``context_length`` (Note [RoPE settings from the command line]). Returns ``config``."""
    spec = parse_rope_scaling(rope_scaling)
    if not rope_theta and spec is None:
        return config
    current = rope_parameters(config)
    layer_types = set(getattr(config, "layer_types", None) or ())
    if layer_types & set(current):
        raise ValueError(
            f"--rope_theta / --rope_scaling: {config.model_type} has one RoPE per layer type "
            f"({', '.join(sorted(layer_types & set(current)))}); edit rope_parameters in its config.json instead"
        )
    params = dict(current) if spec is None else {"rope_theta": current.get("rope_theta"), **spec}
    if rope_theta:
        params["rope_theta"] = float(rope_theta)
    rope_type = params.get("rope_type", "default")
    longest = config.max_position_embeddings
    if rope_type in ("yarn", "llama3", "longrope"):
        original = params.setdefault("original_max_position_embeddings", config.max_position_embeddings)
        factor = params.get("factor") or config.max_position_embeddings / original
        longest = round(factor * original)
        covers = f"factor {factor:g} x original_max_position_embeddings {original}"
    elif rope_type == "linear":
        original, factor = config.max_position_embeddings, params["factor"]
        longest = round(factor * original)
        covers = f"factor {factor:g} x max_position_embeddings {original}"
    if spec is not None and rope_type not in ("default", "dynamic"):
        if context_length is not None and context_length > longest:
            raise ValueError(
                f"--context_length {context_length} is longer than --rope_scaling {rope_type} reaches ({covers} = "
                f"{longest} tokens): raise factor to {math.ceil(context_length / original)} or lower --context_length"
            )
        config.max_position_embeddings = longest
    elif rope_type == "default" and context_length is not None:
        config.max_position_embeddings = max(config.max_position_embeddings, context_length)
    try:
        if hasattr(config, "rope_parameters"):  # transformers >= 5: one dict
            config.rope_parameters = params
            config.standardize_rope_params()
            config.validate_rope()
        else:  # transformers 4.x: rope_theta and rope_scaling apart
            from transformers.modeling_rope_utils import rope_config_validation

            config.rope_theta = params.pop("rope_theta")
            config.rope_scaling = None if rope_type == "default" else params
            if rope_type == "longrope":  # 4.x's longrope reads it from the config, not from rope_scaling
                config.original_max_position_embeddings = params["original_max_position_embeddings"]
            rope_config_validation(config)
    except KeyError as error:  # transformers names a missing key
        raise ValueError(f"--rope_scaling {rope_type}: {error.args[0]}") from None
    return config


# Note [Positions past the model's]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A model's config names the longest position it was made for (max_position_embeddings: 8192 for
# SmolLM2, 40960 for Qwen3, 131072 for Llama 3.1 with its llama3 scaling). RoPE computes its angles
# for any position, so rows longer than that train without an error, on angles the model never saw:
# an extension by fine-tuning alone. That is a choice some make, so it is not refused; but it is
# said once at start, when neither --rope_theta nor --rope_scaling is given (those are checked
# against --context_length instead: Note [RoPE settings from the command line]), with the scaling
# that would reach the length. Dynamic scaling grows with the positions by design and is left out.


def positions_past_config(config, context_length: int, rope_theta: float = 0.0, rope_scaling: str = "none") -> str | None:
    """The start line of a run whose rows are longer than ``config``'s max_position_embeddings with
    its RoPE as it is (Note [Positions past the model's]); None when there is nothing to say."""
    longest = getattr(config, "max_position_embeddings", None)
    if rope_theta or parse_rope_scaling(rope_scaling) is not None or not longest or context_length <= longest:
        return None
    rope = rope_parameters(config)
    rope_type = rope.get("rope_type", "default")
    if rope_type == "dynamic":
        return None
    if set(getattr(config, "layer_types", None) or ()) & set(rope):  # one RoPE per layer type (Gemma 3)
        fix = "its config.json's rope_parameters set to reach it"
    elif rope_type == "default":
        fix = f"--rope_scaling yarn:factor={math.ceil(context_length / longest)} or a larger --rope_theta"
    else:  # the model's own scaling
        fix = f"--rope_scaling {rope_type} with a factor that reaches {context_length}"
    return (f"--context_length {context_length} is past the model's max_position_embeddings {longest}, with its RoPE "
            f"unchanged: positions past {longest} are ones it never saw, which the fine-tune alone has to teach it; an "
            f"extension usually scales RoPE too: {fix} (Note [Positions past the model's] in "
            "llama_cp/modules/causal_lm.py, docs/long_context.md)")
