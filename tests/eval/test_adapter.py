"""llama_cp/eval/adapter.py: what rebuilds a LoRA adapter's model (the reload itself:
tests/train/test_recipe.py)."""

import json
import os

import pytest

from peft import LoraConfig, get_peft_model
from transformers import LlamaForCausalLM

from llama_cp.eval.adapter import Adapter
from llama_cp.model.build import lora_targets
from llama_cp.modules.causal_lm import embedded_llama_config


def test_adapter_settings_are_read_and_unusable_adapters_refused(tmp_path):
    """An adapter directory gives the flags of its base (llama_cp_export.json's embedded seed and
    RoPE, else base_model_name_or_path) and its LoRA shape; one that cannot be rebuilt is one line."""
    def adapter(name, config, info=None):
        os.makedirs(tmp_path / name)
        config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"],
                  "base_model_name_or_path": None, **config}
        (tmp_path / name / "adapter_config.json").write_text(json.dumps(config))
        if info is not None:
            (tmp_path / name / "llama_cp_export.json").write_text(json.dumps(info))
        return str(tmp_path / name)

    embedded = Adapter.read(adapter("embedded", {}, {"model_name": "embedded", "seed": 3, "rope_theta": 1e6,
                                                      "rope_scaling": "none", "context_length": 512}))
    assert embedded.flags == {"model_name": "embedded", "seed": 3, "use_peft": True, "lora_r": 4, "lora_alpha": 8,
                              "lora_target_modules": ("q_proj", "v_proj"), "lora_target_parameters": (),
                              "use_rslora": False, "use_dora": False, "lora_modules_to_save": (),
                              "rope_theta": 1e6, "rope_scaling": "none"}
    hub = Adapter.read(adapter("hub", {"base_model_name_or_path": "org/base", "use_rslora": True, "use_dora": True,
                                       "modules_to_save": ["embed_tokens", "norm"]}))
    assert hub.flags["model_name"] == "org/base" and "seed" not in hub.flags
    assert hub.flags["use_rslora"] and hub.flags["use_dora"] and hub.flags["lora_modules_to_save"] == ("embed_tokens",
                                                                                                        "norm")
    # peft writes all-linear's layers by their whole names when it adapts fewer than 20 (a model of 2 layers):
    # taken by their last parts, the layers --lora_target_modules all-linear adapts
    model = LlamaForCausalLM(embedded_llama_config(num_hidden_layers=2))
    all_linear = lora_targets(model, ("all-linear",))
    get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")).save_pretrained(
        tmp_path / "by_name")
    (tmp_path / "by_name" / "llama_cp_export.json").write_text(json.dumps({"model_name": "embedded"}))
    written = json.loads((tmp_path / "by_name" / "adapter_config.json").read_text())["target_modules"]
    assert "model.layers.1.mlp.down_proj" in written, written
    targets = Adapter.read(str(tmp_path / "by_name")).flags["lora_target_modules"]
    assert sorted(targets) == sorted(all_linear) and len(targets) == 7, targets
    assert Adapter.read("embedded") is None and Adapter.read(str(tmp_path)) is None
    for name, config, message in [
        ("pattern", {"rank_pattern": {"q_proj": 16}}, "per-module ranks"),
        ("regex", {"target_modules": "all-linear", "base_model_name_or_path": "org/base"}, "the pattern 'all-linear'"),
        ("orphan", {}, "names no base model"),
    ]:
        with pytest.raises(ValueError, match=message):
            Adapter.read(adapter(name, config))
