"""--merge_lora's merge (llama_cp/train/export.py, Note [Exporting shard by shard]) on a plain
one-process peft model made with the run's LoraConfig (``lora_config``), against peft's own
merge_and_unload: the adapter's scale (lora_alpha / r, or lora_alpha / sqrt(r) with --use_rslora,
which differ at r = 4), with and without DoRA. The same through a trained FSDP run and
recipes.export: tests/train/test_recipe.py (slow)."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import get_peft_model
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from fsdp_checks import tiny_model
from llama_cp import TrainConfig
from llama_cp.model.build import lora_config
from llama_cp.train.export import export_pretrained


@pytest.mark.parametrize(("use_rslora", "use_dora"), [(True, False), (False, False), (True, True)])
def test_merge_equals_peft_merge_and_unload(tmp_path, use_rslora, use_dora):
    flags = TrainConfig.from_flags(use_peft=True, lora_r=4, lora_alpha=6, lora_target_modules="q_proj,v_proj,down_proj",
                                   use_rslora=use_rslora, use_dora=use_dora)
    model = get_peft_model(tiny_model(num_hidden_layers=1), lora_config(flags)).eval()  # the run's LoraConfig
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # B starts at zero: an adapter that changes nothing would merge at any scale
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1 + (1.0 if "magnitude" in name else 0))
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    assert layer.scaling["default"] == pytest.approx(6 / 2 if use_rslora else 6 / 4)  # sqrt(4) = 2

    export_pretrained(model, str(tmp_path / "merged"), merge_lora=True)
    merged = load_file(str(tmp_path / "merged" / "model.safetensors"))
    want = copy.deepcopy(model).merge_and_unload().state_dict()
    assert set(merged) == set(want)
    for name, value in merged.items():
        torch.testing.assert_close(value, want[name], atol=1e-6, rtol=1e-6, msg=lambda m, name=name: f"{name}: {m}")

    input_ids = torch.randint(0, 64, (1, 16), generator=generator)
    with torch.no_grad():
        got = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"))(input_ids=input_ids).logits
        torch.testing.assert_close(got, model(input_ids=input_ids).logits, atol=1e-5, rtol=1e-5)
