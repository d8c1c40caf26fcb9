"""--rope_theta and --rope_scaling: parsed, checked against --context_length, written into the
model's config before it is built and into the exported config.json. Exactness under CP of a
model built from them is tests/modules/test_families.py's (``rope_flags_*`` checks)."""

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from llama_cp.config import TrainConfig
from llama_cp.modules.causal_lm import apply_rope_settings, embedded_llama_config, parse_rope_scaling, rope_parameters


def llama_8k():
    return embedded_llama_config(max_position_embeddings=8192, num_hidden_layers=1)


def test_forms_of_rope_scaling_parse_to_transformers_dicts():
    assert parse_rope_scaling("none") is None and parse_rope_scaling("") is None
    assert parse_rope_scaling("yarn:factor=8,original_max_position_embeddings=8192,beta_fast=32.5") == {
        "rope_type": "yarn", "factor": 8, "original_max_position_embeddings": 8192, "beta_fast": 32.5,
    }
    assert parse_rope_scaling('{"type": "linear", "factor": 2.0}') == {"rope_type": "linear", "factor": 2.0}
    assert parse_rope_scaling("default") == {"rope_type": "default"}
    # a YAML mapping (or fire's parse of a JSON object) arrives as a dict
    cfg = TrainConfig.from_flags(rope_scaling={"rope_type": "dynamic", "factor": 4})
    assert json.loads(cfg.model.rope_scaling) == {"rope_type": "dynamic", "factor": 4}


@pytest.mark.parametrize("value, message", [
    ("yarn", "--rope_scaling yarn needs factor (its parameters: factor, original_max_position_embeddings, "
             "attention_factor, beta_fast, beta_slow, mscale, mscale_all_dim, truncate)"),
    ("linear:factr=2", "--rope_scaling linear needs factor and has no factr (its parameters: factor)"),
    ("ntk:factor=2", "--rope_scaling type 'ntk' is not one of default, linear, dynamic, yarn, llama3, longrope; "
                     "write it as yarn:factor=8,original_max_position_embeddings=8192 or as a JSON object"),
    ("linear:factor", "--rope_scaling: 'factor' is not key=value; write it as "
                      "yarn:factor=8,original_max_position_embeddings=8192 or as a JSON object"),
    ("linear:factor=two", "--rope_scaling: factor=two is not a number; write it as"),
    ("linear:factor=0.5", "--rope_scaling linear: factor must be a number >= 1, got 0.5"),
    ('{"rope_type": "yarn",', "--rope_scaling is not valid JSON"),
])
def test_bad_rope_scaling_is_one_line_at_config_time(value, message):
    with pytest.raises(ValueError) as error:
        TrainConfig.from_flags(rope_scaling=value)
    assert str(error.value).startswith(message), str(error.value)
    with pytest.raises(ValueError, match="--rope_theta must be >= 0.0, got -1.0"):
        TrainConfig.from_flags(rope_theta=-1)


def test_yarn_extends_an_8k_model_to_64k():
    config = apply_rope_settings(llama_8k(), 0.0, "yarn:factor=8", context_length=65536)
    assert rope_parameters(config) == {
        "rope_type": "yarn", "rope_theta": 500000.0, "factor": 8, "original_max_position_embeddings": 8192,
    }
    assert config.max_position_embeddings == 65536  # what transformers 4.x derives the factor from
    with pytest.raises(ValueError) as error:
        apply_rope_settings(llama_8k(), 0.0, "yarn:factor=8", context_length=131072)
    assert str(error.value) == (
        "--context_length 131072 is longer than --rope_scaling yarn reaches (factor 8 x "
        "original_max_position_embeddings 8192 = 65536 tokens): raise factor to 16 or lower --context_length"
    )
    with pytest.raises(ValueError, match=r"--context_length 40000 is longer than --rope_scaling linear reaches "
                                         r"\(factor 4 x max_position_embeddings 8192 = 32768 tokens\): raise "
                                         r"factor to 5 or lower --context_length"):
        apply_rope_settings(llama_8k(), 0.0, "linear:factor=4", context_length=40000)


def test_each_type_and_theta_land_in_the_config():
    config = apply_rope_settings(llama_8k(), 1e6, "none", context_length=32768)  # ABF: only the base
    assert rope_parameters(config) == {"rope_type": "default", "rope_theta": 1e6}
    assert config.max_position_embeddings == 32768
    config = apply_rope_settings(llama_8k(), 0.0, "dynamic:factor=4", context_length=65536)
    assert rope_parameters(config) == {"rope_type": "dynamic", "rope_theta": 500000.0, "factor": 4}
    assert config.max_position_embeddings == 8192  # dynamic scales from here: kept
    config = apply_rope_settings(
        llama_8k(), 0.0, "llama3:factor=8,low_freq_factor=1.0,high_freq_factor=4.0", context_length=65536)
    assert rope_parameters(config)["original_max_position_embeddings"] == 8192
    assert config.max_position_embeddings == 65536
    longrope = {"rope_type": "longrope", "short_factor": [1.0] * 16, "long_factor": [4.0] * 16, "factor": 4}
    config = apply_rope_settings(llama_8k(), 0.0, json.dumps(longrope), context_length=32768)
    assert rope_parameters(config) == {**longrope, "rope_theta": 500000.0, "original_max_position_embeddings": 8192}
    # the model's own scaling stays when only --rope_theta is given
    config = apply_rope_settings(apply_rope_settings(llama_8k(), 0.0, "yarn:factor=8"), 1e6, "none", 65536)
    assert rope_parameters(config)["rope_type"] == "yarn" and rope_parameters(config)["rope_theta"] == 1e6
    untouched = llama_8k()
    assert apply_rope_settings(untouched, 0.0, "none", 131072).max_position_embeddings == 8192


def test_rope_settings_change_the_model_and_reach_the_exported_config(tmp_path):
    config = apply_rope_settings(llama_8k(), 0.0, "yarn:factor=4,beta_fast=16", context_length=32768)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    plain = llama_8k()
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(plain)
    positions = torch.arange(0, 20000, 997)[None]
    ids = torch.randint(0, 256, positions.shape)
    assert not torch.allclose(model(ids, position_ids=positions).logits, base(ids, position_ids=positions).logits)
    model.save_pretrained(tmp_path)
    reloaded = AutoConfig.from_pretrained(tmp_path)
    assert rope_parameters(reloaded) == rope_parameters(config)
    assert reloaded.max_position_embeddings == 32768
    again = AutoModelForCausalLM.from_pretrained(tmp_path)
    torch.testing.assert_close(again(ids, position_ids=positions).logits, model(ids, position_ids=positions).logits)


def test_per_layer_type_rope_is_refused():
    config = AutoConfig.for_model("gemma3_text", num_hidden_layers=2, sliding_window_pattern=2)
    if not hasattr(config, "rope_parameters"):
        pytest.skip("transformers 4.x keeps Gemma 3's local RoPE apart (rope_local_base_freq)")
    with pytest.raises(ValueError, match=r"--rope_theta / --rope_scaling: gemma3_text has one RoPE per layer type "
                                         r"\(full_attention, sliding_attention\); edit rope_parameters in its "
                                         r"config.json instead"):
        apply_rope_settings(config, 1e6, "none")


def test_yarn_preset_extends_an_8k_llama_to_64k():
    import os

    preset = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "llama3_8b_yarn_64k.yaml")
    cfg = TrainConfig.from_flags(preset, model_name="meta-llama/Meta-Llama-3-8B")
    assert cfg.data.context_length == 65536
    config = apply_rope_settings(llama_8k(), cfg.model.rope_theta, cfg.model.rope_scaling, cfg.data.context_length)
    assert rope_parameters(config) == {
        "rope_type": "yarn", "rope_theta": 500000.0, "factor": 8, "original_max_position_embeddings": 8192,
    }
    assert config.max_position_embeddings == 65536


def test_the_trainer_refuses_a_scaling_short_of_the_context_before_starting(tmp_path):
    import torch.distributed as dist

    from llama_cp.train.trainer import Trainer

    cfg = TrainConfig.from_flags(rope_scaling="yarn:factor=2,original_max_position_embeddings=256",
                                 context_length=1024, output_dir=str(tmp_path / "run"), report_to="none")
    with pytest.raises(ValueError) as error:
        Trainer(cfg).fit()
    assert str(error.value) == (
        "--context_length 1024 is longer than --rope_scaling yarn reaches (factor 2 x "
        "original_max_position_embeddings 256 = 512 tokens): raise factor to 4 or lower --context_length"
    )
    assert not dist.is_initialized() and not (tmp_path / "run").exists()


def test_rows_past_the_models_positions_are_said_with_the_scaling_that_reaches_them():
    """Note [Positions past the model's]: a run longer than max_position_embeddings with the model's
    RoPE as it is gets one line naming a scaling that reaches the length; flags that change RoPE (checked
    against the length instead), a length inside, and dynamic scaling get none."""
    from llama_cp.modules.causal_lm import positions_past_config

    line = positions_past_config(llama_8k(), 20000)
    assert line.startswith("--context_length 20000 is past the model's max_position_embeddings 8192, with its RoPE "
                           "unchanged: positions past 8192 are ones it never saw"), line
    assert "--rope_scaling yarn:factor=3 or a larger --rope_theta" in line, line
    # the factor named reaches the length: apply_rope_settings takes it
    assert apply_rope_settings(llama_8k(), 0.0, "yarn:factor=3", 20000).max_position_embeddings == 24576
    assert positions_past_config(llama_8k(), 8192) is None
    assert positions_past_config(llama_8k(), 20000, rope_theta=5e6) is None
    assert positions_past_config(llama_8k(), 20000, rope_scaling="yarn:factor=3") is None
    # a model's own scaling: its type, with a factor to raise
    llama31 = apply_rope_settings(llama_8k(), 0.0, "llama3:factor=8,low_freq_factor=1,high_freq_factor=4", 65536)
    line = positions_past_config(llama31, 131072)
    assert "--rope_scaling llama3 with a factor that reaches 131072" in line and "65536" in line, line
    dynamic = apply_rope_settings(llama_8k(), 0.0, "dynamic:factor=2", 8192)
    assert positions_past_config(dynamic, 65536) is None
    gemma3 = AutoConfig.for_model("gemma3_text", max_position_embeddings=1024)
    line = positions_past_config(gemma3, 4096)
    if set(gemma3.layer_types) & set(rope_parameters(gemma3)):  # transformers >= 5: one RoPE per layer type
        assert "scales RoPE too: its config.json's rope_parameters set to reach it" in line, line
    else:
        assert "--rope_scaling yarn:factor=4" in line, line
