"""``llama_cp.model.build.model_path``: a hub id's snapshot holds every file a model directory
needs to load as it was saved (weights, config, tokenizer, chat template). The LoRA options'
refusals, each one line before anything is sharded (their exactness under FSDP2 + CP is checked
in tests/model/test_levers_world2.py)."""

import fnmatch
import os
import re
import shutil

import huggingface_hub
import pytest
import torch
import transformers
from transformers import AutoTokenizer, LlamaForCausalLM

from llama_cp.config import PeftConfig, TrainConfig
from llama_cp.data.tokenizer import byte_tokenizer
from llama_cp.model.build import check_lora_targets, check_modules_to_save, model_path
from llama_cp.modules.causal_lm import embedded_llama_config
from llama_cp.modules.quantize import installed_qlora_refusal

TEMPLATE = "{% for m in messages %}<|bos|>{{ m['role'] }}: {{ m['content'] }}<|eos|>{% endfor %}"


def test_a_hub_snapshot_fetches_every_file_a_saved_model_needs(tmp_path, monkeypatch):
    """transformers saves a chat template as chat_template.jinja: a snapshot restricted to other
    patterns loaded the tokenizer without its template, and chat data was then rendered without it.
    Mistral's second copy of the weights (consolidated.safetensors, its own names) is not fetched."""
    saved = tmp_path / "saved"
    LlamaForCausalLM(embedded_llama_config(num_hidden_layers=1)).save_pretrained(saved)
    tokenizer = byte_tokenizer()
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(saved)
    wanted = sorted(os.listdir(saved))
    shutil.copy(saved / "model.safetensors", saved / "consolidated.safetensors")  # Mistral's second copy
    fetched = {}

    def snapshot_download(repo_id, allow_patterns, ignore_patterns=()):  # the hub, as a folder of what was uploaded
        fetched["patterns"] = allow_patterns, ignore_patterns
        local = tmp_path / "snapshot"
        for name in os.listdir(saved):
            if any(fnmatch.fnmatch(name, pattern) for pattern in allow_patterns) and not any(
                    fnmatch.fnmatch(name, pattern) for pattern in ignore_patterns):
                local.mkdir(exist_ok=True)
                shutil.copy(saved / name, local / name)
        return str(local)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    path = model_path("org/model")
    assert sorted(os.listdir(path)) == wanted, fetched["patterns"]
    assert AutoTokenizer.from_pretrained(path).chat_template == TEMPLATE


def test_all_linear_stands_alone_in_lora_target_modules():
    model = LlamaForCausalLM(embedded_llama_config(num_hidden_layers=1))
    check_lora_targets(model, ("all-linear",))
    with pytest.raises(ValueError, match=r"^--lora_target_modules all-linear,q_proj: all-linear already names every "
                                         r"Linear layer but the output layer; give all-linear alone, or a list of names$"):
        TrainConfig.from_flags(use_peft=True, lora_target_modules="all-linear,q_proj")


def test_the_output_layer_takes_no_lora_adapter():
    """peft's LoRA Linear adds its update to what the head returns, which under the chunked loss is
    the loss, not logits: a (batch, tokens, hidden) tensor came back where a scalar was due."""
    model = LlamaForCausalLM(embedded_llama_config(num_hidden_layers=1))
    with pytest.raises(ValueError, match=r"^--lora_target_modules: lm_head is the output layer, which computes the "
                                         r"chunked loss .* --lora_modules_to_save lm_head, or leave it out$"):
        check_lora_targets(model, ("q_proj", "lm_head"))


def test_modules_to_save_are_names_of_the_model_and_no_tied_embedding():
    untied = LlamaForCausalLM(embedded_llama_config(num_hidden_layers=1))
    check_modules_to_save(untied, ("embed_tokens", "norm", "lm_head"))
    with pytest.raises(ValueError, match=r"^--lora_modules_to_save: no module of LlamaForCausalLM is named embeddings "
                                         r"\(or ends so\); its modules are act_fn, down_proj, embed_tokens, "):
        check_modules_to_save(untied, ("norm", "embeddings"))
    if installed_qlora_refusal() is None:  # NF4 codes cannot train
        from llama_cp.modules.quantize import quantize_model

        with torch.device("meta"):
            quantized = quantize_model(LlamaForCausalLM(embedded_llama_config(num_hidden_layers=1)))
        check_modules_to_save(quantized, ("embed_tokens", "norm", "lm_head"))
        with pytest.raises(ValueError, match=r"^--lora_modules_to_save mlp,q_proj: its Linear layers hold 4-bit codes "):
            check_modules_to_save(quantized, ("q_proj", "norm", "mlp"))
    tied = LlamaForCausalLM(embedded_llama_config(num_hidden_layers=1, tie_word_embeddings=True))
    check_modules_to_save(tied, ("norm",))  # the norms may be copied
    for names in (("embed_tokens", "norm"), ("lm_head",)):
        with pytest.raises(ValueError, match=rf"^--lora_modules_to_save {names[0]}: LlamaForCausalLM ties lm_head to "
                                             r"embed_tokens \(tie_word_embeddings\); a trainable copy of one unties "
                                             r"them, and FSDP2 would find their shared tensor in two groups "):
            check_modules_to_save(tied, names)


def test_lora_options_refused_where_they_cannot_be_exact():
    with pytest.raises(ValueError, match=r"^--use_rslora and --use_dora are LoRA options: add --use_peft, or drop them$"):
        TrainConfig.from_flags(use_rslora=True, use_dora=True)
    with pytest.raises(ValueError, match=r"^--use_dora with --quantization 4bit: DoRA normalises each adapted base "
                                         r"weight, and peft reads it from the layer's weight, which under QLoRA holds "
                                         r"the packed NF4 codes"):
        PeftConfig(use_peft=True, use_dora=True, quantization="4bit").check()
    with pytest.raises(ValueError, match=r"^--use_dora with --lora_target_parameters: peft has no DoRA for adapters "):
        PeftConfig(use_peft=True, use_dora=True, lora_target_parameters=("mlp.experts.gate_up_proj",)).check()


@pytest.mark.slow  # a fresh interpreter importing transformers and peft: ~5 s
def test_a_run_that_quantizes_nothing_says_nothing_of_bitsandbytes():
    """Note [bitsandbytes' CPU kernel warning]: peft imports bitsandbytes when it is installed, whose CPU
    backend warned at import about a 4-bit gemv kernel llama-cp never calls; the model builder
    silences it before peft is imported."""
    import subprocess
    import sys

    # has_avx512bf16: bitsandbytes >= 0.46 (0.45.1, the floor, has no CPU kernels and no such warning)
    probe = ("import sys, llama_cp.model.build, peft.tuners.lora, bitsandbytes.functional as f; "
             "print('bitsandbytes' in sys.modules, bool(getattr(f, 'has_avx512bf16', bool)()))")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    imported, warns_here = result.stdout.split()
    assert imported == "True"  # peft did import it: the check below is not vacuous
    assert "gemm_4bit_forward" not in result.stderr, result.stderr
    if warns_here != "True":
        pytest.skip("this CPU has no AVX512-BF16, where bitsandbytes does not warn: nothing was silenced")


def test_the_backend_check_takes_the_head_size_attention_computes_with():
    """DeepSeek's latent attention runs at qk_nope + qk_rope (its config's head_dim is the RoPE
    slice's): an explicit --attention_backend is checked at that size, in one line."""
    from transformers import AutoConfig

    from llama_cp.model.build import check_attention_backend

    config = AutoConfig.for_model("deepseek_v3", hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
                                  qk_nope_head_dim=256, qk_rope_head_dim=64, v_head_dim=128, kv_lora_rank=16)
    assert config.head_dim == 64
    cfg = TrainConfig.from_flags(attention_backend="sdpa_flash", dtype="bfloat16")
    with pytest.raises(ValueError, match=r"^--attention_backend sdpa_flash .*takes head sizes 8, 16, \.\.\., 256, not 320"):
        check_attention_backend(cfg, config, "cuda")


def test_ulysses_refused_where_the_heads_do_not_split_names_only_strategies_that_run():
    """Ulysses needs --cp to divide the query heads: the refusal offers ring and allgather, and
    hybrid only with a degree that divides both (none for 9 heads at cp 2)."""
    from types import SimpleNamespace

    from llama_cp.attention.hybrid import check_ulysses_degree
    from llama_cp.model.build import check_strategy_heads

    cfg = TrainConfig.from_flags(cp=2, cp_strategy="ulysses")
    with pytest.raises(ValueError, match=r"^--cp_strategy ulysses at --cp 2: this model's attention heads, "
                                         r"num_attention_heads \(9\), do not split over 2 ranks; use --cp_strategy "
                                         r"ring or allgather \(any head count\)$"):
        check_strategy_heads(cfg, SimpleNamespace(num_attention_heads=9))
    cfg = TrainConfig.from_flags(cp=4, cp_strategy="ulysses")
    with pytest.raises(ValueError, match=r"\(any head count\), or --cp_strategy hybrid --ulysses_degree 2 \(Ulysses "
                                         r"over 2 ranks, the ring across them\)$"):
        check_strategy_heads(cfg, SimpleNamespace(num_attention_heads=6))
    check_ulysses_degree("hybrid", 2, 4, heads=6)  # the degree offered is one hybrid takes
    check_strategy_heads(cfg, SimpleNamespace(num_attention_heads=8))  # 8 heads split over 4 ranks


def test_heads_that_vary_by_layer_split_only_where_every_layer_splits():
    """Laguna's query heads vary by layer (num_attention_heads_per_layer): Ulysses needs --cp to divide
    each layer's, so the check and ``auto`` go by the count dividing all of them (4 for 4 and 8), not by
    num_attention_heads (8; before the fix Ulysses at cp 8 passed the check and failed in the forward)."""
    from types import SimpleNamespace

    from llama_cp.model.build import check_strategy_heads, cp_strategy

    laguna = SimpleNamespace(num_attention_heads=8, num_attention_heads_per_layer=[4, 8])
    with pytest.raises(ValueError, match=r"^--cp_strategy ulysses at --cp 8: this model's attention heads, "
                                         r"num_attention_heads_per_layer \(4, 8: 4 divides each\), do not split over "
                                         r"8 ranks;.* --cp_strategy hybrid --ulysses_degree 4 "):
        check_strategy_heads(TrainConfig.from_flags(cp=8, cp_strategy="ulysses"), laguna)
    check_strategy_heads(TrainConfig.from_flags(cp=4, cp_strategy="ulysses"), laguna)
    assert cp_strategy(TrainConfig.from_flags(cp=8, cp_strategy="auto"), laguna) == ("hybrid", 4)
    assert cp_strategy(TrainConfig.from_flags(cp=4, cp_strategy="auto"), laguna) == ("ulysses", 0)
    same = SimpleNamespace(num_attention_heads=8, num_attention_heads_per_layer=[8, 8])
    assert cp_strategy(TrainConfig.from_flags(cp=8, cp_strategy="auto"), same) == ("ulysses", 0)


def test_peft_adapting_other_weights_than_the_targets_name_is_said():
    """Note [peft's MoE target conversion]: on a Qwen3-MoE of a dense layer 0 and an expert layer 1, peft
    under transformers 5 turns all-linear's gate_proj/up_proj/down_proj into the fused experts' parameters
    and the router's weight, and the dense MLP gets no adapter: said in one line, --merge_lora refused
    (before training, in the trainer), and the MFU counts the adapters that are there. Under transformers 4
    the experts are Linear layers: nothing to say."""
    from peft import get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from llama_cp.model.build import adapted_linears, lora_config, lora_target_changes
    from llama_cp.train.export import check_mergeable

    config = AutoConfig.for_model("qwen3_moe", vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4,
                                  num_experts_per_tok=2, moe_intermediate_size=16, mlp_only_layers=[0])
    for targets, said in (("all-linear", r"fused experts and router by the names of transformers 4 \(target "
                                         r"parameters down_proj, gate.weight, gate_up_proj\); the Linear layers "
                                         r"down_proj, gate_proj, up_proj \(the dense layers' MLPs, shared experts\) get "
                                         r"none"),
                          ("q_proj,down_proj", r"fused experts by the names of transformers 4 \(target parameters "
                                               r"down_proj\); the Linear layers down_proj \(")):
        cfg = TrainConfig.from_flags(use_peft=True, lora_target_modules=targets)
        model = get_peft_model(AutoModelForCausalLM.from_config(config), lora_config(cfg))
        line = lora_target_changes(model, cfg.peft.lora_target_modules)
        if not getattr(model.peft_config["default"], "target_parameters", None):  # transformers 4: Linear experts
            assert line is None and int(transformers.__version__.split(".")[0]) < 5
            assert "down_proj" in adapted_linears(model)
            continue
        # what the MFU counts adapters on: the Linear layers that have one
        assert adapted_linears(model) == (("k_proj", "o_proj", "q_proj", "v_proj") if targets == "all-linear"
                                          else ("q_proj",))
        assert line.startswith(f"--lora_target_modules {targets}: peft ") and re.search(said, line), line
        with pytest.raises(ValueError, match=r"^--merge_lora: the adapter has adapters on fused expert tensors"):
            check_mergeable(model)
    plain = get_peft_model(AutoModelForCausalLM.from_config(config), lora_config(TrainConfig.from_flags(use_peft=True)))
    assert lora_target_changes(plain, ("q_proj", "k_proj", "v_proj", "o_proj")) is None
    # the head's trainable copy (modules_to_save) is no Linear layer left without an adapter
    cfg = TrainConfig.from_flags(use_peft=True, lora_target_modules="all-linear", lora_modules_to_save="lm_head")
    model = get_peft_model(AutoModelForCausalLM.from_config(config), lora_config(cfg))
    line = lora_target_changes(model, cfg.peft.lora_target_modules)
    assert line is None or "the Linear layers down_proj, gate_proj, up_proj (" in line, line
    with pytest.raises(ValueError, match=r"^--merge_lora with --lora_target_parameters: adapters on fused expert "
                                         r"tensors are not merged here; drop --merge_lora"):
        TrainConfig.from_flags(use_peft=True, merge_lora=True, lora_target_parameters="mlp.experts.down_proj")
