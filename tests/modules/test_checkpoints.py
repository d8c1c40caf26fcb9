"""A checkpoint as llama-cp builds and loads it, against transformers' own load of the same directory:
the buffers no checkpoint holds (Note [Buffers no checkpoint holds] in llama_cp/modules/causal_lm.py),
the text model of a vision-language checkpoint (Note [The text model of a vision-language checkpoint]
in llama_cp/modules/checkpoints.py), and the checkpoints refused before anything is built."""

import json

import pytest
import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText
from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

from llama_cp.fsdp_wrap import _full_state_for, _read_checkpoint, restore_buffers
from llama_cp.modules.causal_lm import build_causal_lm
from llama_cp.modules.checkpoints import (
    check_quantization, checkpoint_config, safetensors_files, text_config, vision_language,
)
from llama_cp.modules.families import SUPPORTED_FAMILIES, check_family, transformers_refusal

TRANSFORMERS_5 = int(transformers.__version__.split(".")[0]) >= 5
TEXT = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
            eos_token_id=2)
#: What some families need beyond TEXT to be built small (a few experts; windowed and full layers).
EXTRA = {"mixtral": dict(num_local_experts=4), "qwen3_moe": dict(num_experts=4, moe_intermediate_size=16),
         "olmoe": dict(num_experts=4), "gpt_oss": dict(num_local_experts=4),
         "qwen2_moe": dict(num_experts=4, moe_intermediate_size=16, shared_expert_intermediate_size=32),
         "deepseek_v2": dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16),
         "deepseek_v3": dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16),
         "glm4_moe": dict(n_routed_experts=8, num_experts_per_tok=4, n_group=2, topk_group=1, moe_intermediate_size=16),
         "llama4_text": dict(num_local_experts=4), "minimax_m2": dict(num_local_experts=4, num_experts_per_tok=2),
         "hunyuan_v1_moe": dict(num_experts=4, moe_topk=2),
         "afmoe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, num_shared_experts=1),
         "exaone_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, n_group=1, topk_group=1),
         "ernie4_5_moe": dict(moe_num_experts=4, moe_k=2, moe_intermediate_size=16, moe_num_shared_experts=1),
         "dots1": dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, n_shared_experts=1,
                       n_group=1, topk_group=1),
         "gemma3_text": dict(layer_types=["sliding_attention", "full_attention"], sliding_window=6),
         "olmo3": dict(layer_types=["sliding_attention", "full_attention"], sliding_window=6),
         # full layers of their own head size, values = keys, per-layer inputs, an expert block
         "gemma4_text": dict(layer_types=["sliding_attention", "full_attention"], sliding_window=6, global_head_dim=16,
                             num_global_key_value_heads=1, attention_k_eq_v=True, hidden_size_per_layer_input=8,
                             vocab_size_per_layer_input=96, final_logit_softcapping=1.0, enable_moe_block=True,
                             num_experts=4, top_k_experts=2, moe_intermediate_size=16),
         # Granite SWA: a RoPE base per layer (0: none), one per layer of TEXT
         "granite_swa": dict(layer_rope_theta=[0.0, 10000.0]),
         "granitemoe_swa": dict(layer_rope_theta=[0.0, 10000.0], num_local_experts=4),
         "kolibri1": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                          shared_expert_intermediate_size=16),
         "sarvam_mla": dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16),
         # Gemma 3n: per-layer inputs, AltUp, LAuReL (no layer reuses keys and values: of two layers, each type's
         # would have to be before the reusing ones)
         "gemma3n_text": dict(layer_types=["sliding_attention", "full_attention"], sliding_window=6,
                              num_kv_shared_layers=0, hidden_size_per_layer_input=8, vocab_size_per_layer_input=96,
                              laurel_rank=4, final_logit_softcapping=1.0),
         # Gemma 4 12B: no per-layer inputs and no expert block
         "gemma4_unified_text": dict(layer_types=["sliding_attention", "full_attention"], sliding_window=6,
                                     global_head_dim=16, num_global_key_value_heads=1, attention_k_eq_v=True,
                                     final_logit_softcapping=1.0)}


def family_config(family: str):
    return AutoConfig.for_model(family, **TEXT, **EXTRA.get(family, {}))


def buildable(family: str) -> bool:
    return family in CONFIG_MAPPING_NAMES and transformers_refusal(family, transformers.__version__) is None


@pytest.mark.parametrize("family", sorted(SUPPORTED_FAMILIES))
def test_buffers_no_checkpoint_holds_are_those_transformers_builds(family):
    """Built on meta, made real (its buffers then filled with NaN: what to_empty leaves is any memory)
    and restored: every buffer outside the state dict equals transformers' CPU build's (Gemma 3's
    embed_scale and per-layer-type inv_freq among them)."""
    if not buildable(family):
        pytest.skip(f"transformers {transformers.__version__}: {family} is not built here")
    config = family_config(family)
    torch.manual_seed(0)
    want = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model = build_causal_lm(config, device="meta")
    assert all(t.device.type == "meta" for t in [*model.parameters(), *model.buffers()])
    model.to_empty(device="cpu")
    with torch.no_grad():
        for buffer in model.buffers():
            buffer.fill_(float("nan")) if buffer.is_floating_point() else buffer.fill_(7)
    restore_buffers(model, torch.device("cpu"))
    kept = set(want.state_dict())
    restored = {name: b for name, b in model.named_buffers() if name not in kept}
    expected = {name: b for name, b in want.named_buffers() if name not in kept}
    assert restored.keys() == expected.keys()
    for name, buffer in expected.items():
        torch.testing.assert_close(restored[name], buffer, rtol=0, atol=0, msg=name)


def test_a_meta_build_makes_nothing_large_on_the_host():
    """A model built on meta for a checkpoint makes its large tensors on meta directly (Note [Buffers no
    checkpoint holds]): an embedding of 2^36 elements (256 GiB in float32, more than the host has; made
    on the CPU first, torch.empty failed) builds, and every parameter is on meta."""
    config = AutoConfig.for_model("llama", **{**TEXT, "vocab_size": 1 << 22, "hidden_size": 1 << 14,
                                              "head_dim": 128, "num_attention_heads": 128, "num_key_value_heads": 8,
                                              "num_hidden_layers": 1})
    model = build_causal_lm(config, device="meta")
    assert all(p.device.type == "meta" for p in model.parameters())
    assert model.model.embed_tokens.weight.numel() == 1 << 36

def test_a_gemma3_checkpoint_loads_as_transformers_loads_it(tmp_path):
    """The trainer's load (meta build, to_empty, restore_buffers, the checkpoint's tensors) of a saved
    Gemma 3 computes transformers' from_pretrained logits (before the fix: embed_scale was left as
    to_empty's memory)."""
    config = family_config("gemma3_text")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    # a second copy in another layout (Mistral's repositories ship one) is not read
    (tmp_path / "consolidated.safetensors").write_bytes((tmp_path / "model.safetensors").read_bytes())
    assert safetensors_files(str(tmp_path)) == ["model.safetensors"]
    model = build_causal_lm(config, device="meta").to_empty(device="cpu")
    with torch.no_grad():
        for buffer in model.buffers():
            buffer.fill_(float("nan"))
    restore_buffers(model, torch.device("cpu"))
    model.load_state_dict(_full_state_for(model.state_dict(), _read_checkpoint(str(tmp_path), config), str(tmp_path)))
    ids = torch.randint(3, 96, (2, 24))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits,
                                   AutoModelForCausalLM.from_pretrained(tmp_path)(input_ids=ids).logits)


@pytest.mark.skipif("apertus1p5_text" not in CONFIG_MAPPING_NAMES, reason="transformers without Apertus 1.5")
def test_an_apertus_1p5_text_checkpoint_loads_as_transformers_loads_it(tmp_path):
    """transformers 5.24 has a conversion mapping for Apertus 1.5's text model, a prefix change only (a released
    checkpoint's model.language_model.X to model.X); the trainer reads the files itself, renamed as it renames
    every vision-language checkpoint (not through transformers' loader, which takes a whole copy on each rank),
    and computes transformers' from_pretrained logits over the head cut to 96 of 160 tokens."""
    config = AutoConfig.for_model("apertus1p5_text", **{**TEXT, "vocab_size": 160}, output_vocab_size=96)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    model = build_causal_lm(config, device="meta").to_empty(device="cpu")
    restore_buffers(model, torch.device("cpu"))
    model.load_state_dict(_full_state_for(model.state_dict(), _read_checkpoint(str(tmp_path), config), str(tmp_path)))
    ids = torch.randint(3, 96, (2, 24))
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        assert logits.shape[-1] == 96
        torch.testing.assert_close(logits, AutoModelForCausalLM.from_pretrained(tmp_path)(input_ids=ids).logits)


#: Vision-language checkpoints -> (text config fields, their vision config); the smallest each can be.
VISION_LANGUAGE = {
    "gemma3": (dict(model_type="gemma3_text", **TEXT, **EXTRA["gemma3_text"]),
               dict(model_type="siglip_vision_model", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                    num_attention_heads=2, image_size=28, patch_size=14), dict(mm_tokens_per_image=1,
                    image_token_index=93, boi_token_index=94, eoi_token_index=95)),
    # Mistral Small 3.1/3.2: a Mistral text model, its own lm_head; its config.json names no top-level
    # tie_word_embeddings (removed after saving: vision_language_dir), whose class default is True
    "mistral3": (dict(model_type="mistral", **TEXT), dict(model_type="pixtral", hidden_size=16, intermediate_size=32,
                 num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14, head_dim=8),
                 dict(image_token_index=93, tie_word_embeddings=False)),
}
if "gemma4" in CONFIG_MAPPING_NAMES:  # Gemma 4 from E2B up: image (and audio) towers, tied
    VISION_LANGUAGE["gemma4"] = (dict(model_type="gemma4_text", **TEXT, **EXTRA["gemma4_text"]),
                                 dict(model_type="gemma4_vision", hidden_size=16, intermediate_size=32,
                                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, head_dim=8,
                                      patch_size=14, pooling_kernel_size=2, position_embedding_size=64),
                                 dict(image_token_id=93, boi_token_id=94, eoi_token_id=95, audio_config=None))
if "gemma4_unified" in CONFIG_MAPPING_NAMES:  # Gemma 4 12B: an image tower, tied
    VISION_LANGUAGE["gemma4_unified"] = (
        dict(model_type="gemma4_unified_text", **TEXT, **EXTRA["gemma4_unified_text"]),
        dict(model_type="gemma4_unified_vision", patch_size=14, pooling_kernel_size=2, mm_embed_dim=16,
             mm_posemb_size=64, output_proj_dims=32),
        dict(image_token_id=93, boi_token_id=94, eoi_token_id=95, audio_config=None))
if "llama4" in CONFIG_MAPPING_NAMES:  # Llama 4 Scout and Maverick: an image tower, an untied head
    VISION_LANGUAGE["llama4"] = (dict(model_type="llama4_text", **TEXT, **EXTRA["llama4_text"]),
                                 dict(model_type="llama4_vision_model", hidden_size=16, intermediate_size=32,
                                      num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14,
                                      vision_output_dim=16, projector_input_dim=16, projector_output_dim=32,
                                      pixel_shuffle_ratio=0.5), dict(image_token_index=93))
if "apertus1p5" in CONFIG_MAPPING_NAMES:  # Apertus 1.5: image and audio tokenizers (their codes are tokens), an untied
    # head cut to the text tokens (96 of 160: the codes are 100-115 and 116-131)
    VISION_LANGUAGE["apertus1p5"] = (
        dict(model_type="apertus1p5_text", **{**TEXT, "vocab_size": 160}, output_vocab_size=96),
        dict(codebook_size=16, embed_dim=8, latent_channels=8, base_channels=32, channel_multiplier=[1, 1],
             num_res_blocks=1, attn_resolutions=[], resolution=16),
        dict(audio_config=dict(model_type="wavtokenizer_encoder", num_filters=4, hidden_size=16, codebook_size=16,
                               codebook_dim=16, decoder_hidden_size=16, decoder_attention_num_groups=4,
                               decoder_intermediate_size=32, decoder_num_layers=1, num_lstm_layers=1),
             image_token_id=93, audio_token_id=94, image_token_offset=100, audio_token_offset=116))
if "ministral3" in CONFIG_MAPPING_NAMES:  # Ministral 3: tied by the outer config while its text config says not
    VISION_LANGUAGE["ministral3"] = (dict(model_type="ministral3", **TEXT), VISION_LANGUAGE["mistral3"][1],
                                     dict(image_token_index=93, tie_word_embeddings=True))


def vision_language_dir(name: str, path) -> torch.nn.Module:
    """A saved vision-language checkpoint of random weights; returns transformers' model of it."""
    text, vision, extra = VISION_LANGUAGE[name]
    model_type = "mistral3" if name == "ministral3" else name
    config = AutoConfig.for_model(model_type, text_config=text, vision_config=vision, **extra)
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config)
    with torch.no_grad():  # the head apart from the embedding where the model does not tie them
        if model.get_output_embeddings().weight is not model.get_input_embeddings().weight:
            model.get_output_embeddings().weight.normal_(0, 0.02)
    model.save_pretrained(path)
    if name == "mistral3":  # as released
        fields = json.loads((path / "config.json").read_text())
        del fields["tie_word_embeddings"]
        (path / "config.json").write_text(json.dumps(fields))
    return AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("name", VISION_LANGUAGE)
def test_text_model_of_a_vision_language_checkpoint_computes_its_logits(name, tmp_path):
    """llama-cp's text model of the checkpoint (its config, the trainer's load) computes the
    vision-language model's logits on text rows, tied as it is; transformers' text class of the same
    directory would load none of its weights."""
    whole = vision_language_dir(name, tmp_path)
    raw = AutoConfig.from_pretrained(tmp_path)
    assert vision_language(raw)
    config = checkpoint_config(str(tmp_path))
    assert config.model_type == VISION_LANGUAGE[name][0]["model_type"]
    assert config.architectures == [type(AutoModelForCausalLM.from_config(config)).__name__]  # the exports' class
    check_family(config)
    model = build_causal_lm(config, device="meta").to_empty(device="cpu")
    model.tie_weights()  # as recipes.export does (to_empty unties; FSDP's load keeps the tie)
    restore_buffers(model, torch.device("cpu"))
    model.load_state_dict(_full_state_for(model.state_dict(), _read_checkpoint(str(tmp_path), config), str(tmp_path)))
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert tied == (whole.get_output_embeddings().weight is whole.get_input_embeddings().weight)
    ids = torch.randint(3, 90, (2, 24))
    # transformers 5's Llama 4 forward fails after its language model ran (it reads image_outputs from the language
    # model's output): on text rows that forward is its language model's on the token embeddings, so that is called
    reference = whole.language_model if name == "llama4" and TRANSFORMERS_5 else whole
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, reference(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


def test_text_model_of_a_gemma3n_checkpoint_is_its_text_model(tmp_path):
    """A Gemma 3n vision-language checkpoint, written as released (its text model's tensors under
    model.language_model, image and audio towers beside them, k/v projections and a k norm for a layer that
    reuses keys and values, no lm_head: tied), is read as its text model: llama-cp's load computes what
    transformers' Gemma3nForCausalLM of the same weights does. Built by hand: transformers builds Gemma 3n's image
    tower through timm, which llama-cp does not install (Note [The text model of a vision-language checkpoint])."""
    from safetensors.torch import save_file

    if "gemma3n" not in CONFIG_MAPPING_NAMES or transformers_refusal("gemma3n_text", transformers.__version__):
        pytest.skip(f"transformers {transformers.__version__}: gemma3n_text is not built here")
    fields = dict(TEXT, **{**EXTRA["gemma3n_text"], "num_hidden_layers": 4, "num_kv_shared_layers": 2,
                           "layer_types": ["sliding_attention", "full_attention"] * 2})
    text = AutoModelForCausalLM.from_config(AutoConfig.for_model("gemma3n_text", **fields)).eval()
    with torch.no_grad():  # AltUp's output scales (zeros at init: the per-layer inputs would add nothing)
        for name, tensor in text.named_parameters():
            if name.endswith("correct_output_scale"):
                tensor.uniform_(0.5, 1.5)
    state = {"model.language_model." + key[len("model."):]: tensor.contiguous()
             for key, tensor in text.state_dict().items() if key.startswith("model.")}
    state.update({"model.language_model.layers.3.self_attn.k_proj.weight": torch.ones(16, 32),
                  "model.language_model.layers.3.self_attn.v_proj.weight": torch.ones(16, 32),
                  "model.language_model.layers.3.self_attn.k_norm.weight": torch.ones(8),
                  "model.vision_tower.timm_model.stem.conv.weight": torch.ones(4, 3, 3, 3),
                  "model.audio_tower.conformer.0.norm.weight": torch.ones(8),
                  "model.embed_vision.embedding.weight": torch.ones(4, 32)})
    save_file(state, tmp_path / "model.safetensors")
    whole = AutoConfig.for_model("gemma3n", text_config=fields, architectures=["Gemma3nForConditionalGeneration"])
    whole.save_pretrained(tmp_path)
    config = checkpoint_config(str(tmp_path))
    assert config.model_type == "gemma3n_text" and config.architectures == ["Gemma3nForCausalLM"]
    assert config.tie_word_embeddings
    check_family(config)
    model = build_causal_lm(config, device="meta").to_empty(device="cpu")
    model.tie_weights()
    restore_buffers(model, torch.device("cpu"))
    model.load_state_dict(_full_state_for(model.state_dict(), _read_checkpoint(str(tmp_path), config), str(tmp_path)))
    ids = torch.randint(3, 90, (2, 24))
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(input_ids=ids).logits, text(input_ids=ids).logits, rtol=1e-5,
                                   atol=1e-5)


def test_other_vision_language_models_are_refused_as_families():
    """Only the checkpoints of VISION_LANGUAGE are read as their text model: Idefics3 keeps its language
    model under model.text_model (its tensors would not be found, late): refused in one line before
    anything is built."""
    assert not vision_language(family_config("llama"))
    for model_type, reason in (("idefics3", "it has not been checked exact"),):
        if model_type not in CONFIG_MAPPING_NAMES:
            continue
        config = AutoConfig.for_model(model_type)
        assert not vision_language(config) and text_config(config) is config
        with pytest.raises(ValueError, match=rf"^model family '{model_type}' \(\w+\) is not supported by llama-cp: "
                                             rf"[^\n]*{reason}"):
            check_family(config)


@pytest.mark.parametrize("method", ["fp8", "bitsandbytes", "gptq", "awq"])
def test_quantized_checkpoints_are_refused_naming_the_fix(tmp_path, method):
    """Stored quantized (FP8 with scales, bitsandbytes, GPTQ, AWQ), a checkpoint's tensors read as
    plain ones would be other numbers: refused in one line, at the config (before anything is
    built); MXFP4 is loaded dequantized (Note [MXFP4 checkpoints])."""
    config = family_config("llama")
    config.save_pretrained(tmp_path)
    with open(tmp_path / "config.json") as f:
        fields = json.load(f)
    fields["quantization_config"] = {"quant_method": method}
    with open(tmp_path / "config.json", "w") as f:
        json.dump(fields, f)
    with pytest.raises(ValueError, match=rf"^--model_name '{tmp_path}': the checkpoint's weights are quantized "
                                         rf"\(config.json quantization_config quant_method '{method}'\); llama-cp "
                                         r"trains from unquantized weights: use the model's bfloat16 release"):
        checkpoint_config(str(tmp_path))
    check_quantization(AutoConfig.for_model("llama", quantization_config={"quant_method": "mxfp4"}), "x")


def test_families_refused_before_they_are_built():
    """check_family says, from a config alone, what check_supported says of the built model: the
    family and the class AutoModelForCausalLM would build, or the transformers floor (Apertus below 5:
    its activation's parameters are bfloat16 among float32 ones)."""
    with pytest.raises(ValueError, match=r"^model family 'phi' \(PhiForCausalLM\) is not supported by llama-cp: its "
                                         r"attention has no o_proj"):
        check_family(AutoConfig.for_model("phi"))
    assert transformers_refusal("apertus", "4.57.6") == (
        "model family 'apertus' needs transformers >= 5.0 (installed: 4.57.6): before that its xIELU activation "
        "keeps its parameters in bfloat16 beside the model's float32 ones, which FSDP2 cannot shard together; "
        "upgrade transformers")
    assert transformers_refusal("apertus", "5.0.0") is None
    if not TRANSFORMERS_5:
        with pytest.raises(ValueError, match=r"^model family 'apertus' needs transformers >= 5.0"):
            check_family(AutoConfig.for_model("apertus", **TEXT))
    else:
        check_family(AutoConfig.for_model("apertus", **TEXT))
