"""A saved run's model as the trainer built it: a LoRA adapter directory rebuilt on its base
(Note [Evaluating an adapter]), and the tokenizer of a model directory (or the embedded one)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from llama_cp.modules.causal_lm import EXPORT_INFO, TOKENIZER_FILES, check_tokenizer_files


# Note [Evaluating an adapter]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A LoRA adapter directory holds the adapters' weights only. Its model is rebuilt as the run
# built it, with the trainer's build_model, and then the adapters' weights are put in:
#
#   adapter_config.json   base_model_name_or_path  -> --model_name (a local directory or hub id)
#                         r, lora_alpha, target_modules, target_parameters
#                                                  -> --use_peft --lora_r --lora_alpha --lora_target_*
#   llama_cp_export.json  model_name "embedded", seed  -> the embedded model's random init of that
#   (the trainer's export)                          seed, which build_model makes from --seed
#                         rope_theta, rope_scaling -> the run's --rope_theta / --rope_scaling (peft
#                                                     alone would load the base with its own RoPE)
#
#   build_model(cfg)             FSDP2-sharded peft model, its LoRA weights freshly initialised
#   adapter_model.safetensors    read whole on every rank (it is small); set_model_state_dict with
#                                full tensors keeps each rank's shards of them (DTensors)
#
# target_modules may name layers whole (model.layers.0.self_attn.q_proj): peft writes all-linear
# so when it adapts fewer than 20 layers (MIN_TARGET_MODULES_FOR_OPTIMIZATION, peft 0.15 to 0.21; more are
# written as the names' last parts), as a 2-layer model's or a user's own list does. Each name is
# taken by its last part, as --lora_target_modules takes it: every layer so named gets adapters,
# and an adapter of only some of them finds its model's other layers missing (below).
#
# peft saves each adapter tensor under the model's name with the adapter's name taken out
# (...q_proj.lora_A.default.weight -> ...q_proj.lora_A.weight). Every tensor of the file must
# find its LoRA tensor in the model, and every LoRA tensor of the model its tensor in the file,
# else the adapter is refused (other targets). rsLoRA, DoRA and modules_to_save copies are the
# trainer's own flags (--use_rslora, --use_dora, --lora_modules_to_save): build_model makes those
# layers, and their tensors come from the file like A and B (peft saves a DoRA magnitude as
# ...q_proj.lora_magnitude_vector and a copy under the name of what it copies). Per-module ranks
# or alphas (rank_pattern, alpha_pattern) are refused: build_model makes none.


@dataclass(frozen=True)
class Adapter:
    """A LoRA adapter directory and the training flags that rebuild its model (Note [Evaluating an
    adapter])."""

    path: str
    #: TrainConfig flags of the base and the adapters' shape
    flags: dict[str, Any]

    @classmethod
    def read(cls, model_name: str) -> Adapter | None:
        """The adapter at ``--model_name``; None when it is no adapter directory. ValueError naming
        the flag for an adapter this cannot rebuild."""
        path = os.path.expanduser(model_name)
        if model_name == "embedded" or not os.path.isfile(os.path.join(path, "adapter_config.json")):
            return None
        with open(os.path.join(path, "adapter_config.json")) as f:
            config = json.load(f)
        info = {}
        if os.path.isfile(os.path.join(path, EXPORT_INFO)):
            with open(os.path.join(path, EXPORT_INFO)) as f:
                info = json.load(f)
        where = f"--model_name {model_name!r} is a LoRA adapter"
        merge = "merge it into its base (peft's merge_and_unload, then save_pretrained) and evaluate that directory"
        if config.get("peft_type", "LORA") != "LORA":
            raise ValueError(f"--model_name {model_name!r} is a {config['peft_type']} adapter, not LoRA: {merge}")
        if config.get("rank_pattern") or config.get("alpha_pattern"):
            raise ValueError(f"{where} with per-module ranks or alphas (rank_pattern / alpha_pattern), which the "
                             f"trainer's model does not build: {merge}")
        targets = config.get("target_modules") or []
        if isinstance(targets, str):
            raise ValueError(f"{where} whose target_modules is the pattern {targets!r}, not a list of layer names: "
                             f"{merge}")
        base = "embedded" if info.get("model_name") == "embedded" else (
            config.get("base_model_name_or_path") or info.get("model_name"))
        if not base:
            raise ValueError(f"{where} that names no base model (adapter_config.json's base_model_name_or_path is "
                             f"null, and there is no {EXPORT_INFO}): set base_model_name_or_path to the base's "
                             f"directory or hub id (for the embedded model write {EXPORT_INFO}: "
                             '{"model_name": "embedded", "seed": <the run\'s --seed>})')
        flags = {"model_name": base, "use_peft": True, "lora_r": config["r"], "lora_alpha": config["lora_alpha"],
                 "lora_target_modules": tuple(dict.fromkeys(name.rsplit(".", 1)[-1] for name in targets)),
                 "lora_target_parameters": tuple(config.get("target_parameters") or ()),
                 "use_rslora": bool(config.get("use_rslora")), "use_dora": bool(config.get("use_dora")),
                 "lora_modules_to_save": tuple(config.get("modules_to_save") or ())}
        if base == "embedded":
            flags["seed"] = info.get("seed", 0)
        flags.update({key: info[key] for key in ("rope_theta", "rope_scaling") if info.get(key) is not None})
        return cls(path, flags)

    def tokenizer_path(self, base_path: str | None) -> str | None:
        """The adapter directory when it holds a tokenizer (the trainer's export does), else the base's."""
        own = any(os.path.isfile(os.path.join(self.path, name)) for name in TOKENIZER_FILES)
        return self.path if own else base_path

    def load_into(self, model) -> None:
        """Put the adapters' weights into ``model`` (``build_model`` of :attr:`flags`, sharded or not)."""
        from safetensors.torch import load_file
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions, get_model_state_dict, set_model_state_dict,
        )

        file = os.path.join(self.path, "adapter_model.safetensors")
        if not os.path.isfile(file):
            raise FileNotFoundError(f"--model_name {self.path!r}: no adapter_model.safetensors (peft's "
                                    "save_pretrained writes it)")
        saved = load_file(file)
        own = get_model_state_dict(model)  # this rank's shards, under the model's names
        names = {_saved_name(name): name for name in own if ".lora_" in name or ".modules_to_save." in name}
        unknown, missing = sorted(set(saved) - set(names)), sorted(set(names) - set(saved))
        wrong = sorted(key for key in set(saved) & set(names) if saved[key].shape != own[names[key]].shape)
        if unknown or missing or wrong:
            found = [f"{len(found)} {what}, e.g. {found[0]}" for found, what in
                     ((unknown, "not in the model"), (missing, "missing"), (wrong, "of another shape")) if found]
            raise ValueError(f"--model_name {self.path!r}: the adapter's tensors do not match the LoRA layers of "
                             f"its adapter_config.json ({'; '.join(found)})")
        full = {names[key]: value.to(own[names[key]].dtype) for key, value in saved.items()}
        set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, strict=False))


def _saved_name(name: str) -> str:
    """The name peft's save_pretrained gives the model's trainable tensor ``name``: the adapter's
    name taken out, a DoRA magnitude without its .weight, a modules_to_save copy under the name of
    what it copies."""
    if ".lora_magnitude_vector." in name:
        return name.split(".lora_magnitude_vector.")[0] + ".lora_magnitude_vector"
    if ".modules_to_save." in name:
        head, tail = name.split(".modules_to_save.", 1)
        return f"{head}.{tail.split('.', 1)[1]}"
    return name.replace(".default.", ".")


def load_tokenizer(path: str | None):
    """The embedded byte tokenizer (``path`` None) or the model directory's."""
    if path is None:
        from llama_cp.data.tokenizer import byte_tokenizer

        return byte_tokenizer()
    from transformers import AutoTokenizer

    check_tokenizer_files(path)
    return AutoTokenizer.from_pretrained(path)
