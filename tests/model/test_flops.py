"""Model FLOPs (Note [Model FLOPs] in llama_cp/model/flops.py) against torch's FlopCounterMode on real
forward+backward passes of the embedded model, the peak table, and the per-GPU figures."""

import pytest
import torch
import transformers
from torch.utils.flop_counter import FlopCounterMode
from transformers import LlamaForCausalLM

from llama_cp import apply_context_parallel
from llama_cp.model.flops import attention_pairs, model_flops, peak_flops, throughput
from llama_cp.modules.causal_lm import embedded_llama_config


def _measure(model, **batch) -> dict[str, int]:
    """FLOPs of one forward+backward by op: aten.mm are the linear layers, aten.bmm attention.
    The rotary embedding's table (inv_freq x positions, a bmm in transformers 4.x) is no model
    FLOP and is left out."""
    with FlopCounterMode(display=False) as counter:
        model(**batch, labels=batch["input_ids"]).loss.backward()
    counts = counter.get_flop_counts()
    total = dict(counts["Global"])
    for module, by_op in counts.items():
        if module.endswith("rotary_emb"):
            for op, flops in by_op.items():
                total[op] -= flops
    return {str(op): flops for op, flops in total.items() if flops}


def test_embedded_model_by_hand():
    """The embedded Llama (hidden 256, 8 heads of 32, 2 KV heads, MLP 688, vocab 1024, 4 layers),
    written out: every weight 6 FLOPs per token, attention 12 x head_dim x heads x layers per pair."""
    layer = 256 * 256 + 256 * 64 + 256 * 64 + 256 * 256 + 3 * 256 * 688  # q, k, v (GQA), o, gate/up/down
    flops = model_flops(embedded_llama_config())
    assert flops.per_token == 6 * (4 * layer + 256 * 1024)  # + lm_head; the embedding is a lookup
    assert flops.per_pair == 12 * 32 * 8 * 4
    lora = model_flops(embedded_llama_config(), lora_r=8, lora_targets=("q_proj", "down_proj"))
    adapters = 8 * (256 + 256) + 8 * (688 + 256)
    assert lora.per_token == 4 * (4 * layer + 256 * 1024) + 6 * 4 * adapters  # frozen: no weight gradient


def test_full_fine_tune_matches_the_flop_counter():
    """Eager attention computes all L x L pairs (the causal mask is applied after): the counter's
    bmm FLOPs are per_pair x L^2 per row, its mm FLOPs per_token x tokens, exactly."""
    config = embedded_llama_config(num_hidden_layers=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.set_attn_implementation("eager")
    rows, length = 2, 24
    measured = _measure(model, input_ids=torch.randint(0, config.vocab_size, (rows, length)))
    flops = model_flops(config)
    assert measured == {"aten.mm": flops.per_token * rows * length, "aten.bmm": flops.per_pair * rows * length ** 2}


def _check_lora_flops(base, config, targets, modules_to_save=()):
    """LoRA of rank 4 on ``targets`` of ``base`` (and ``modules_to_save`` trained in full): the
    counter's FLOPs of one step are model_flops'."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(base, LoraConfig(r=4, target_modules="all-linear" if targets == ("all-linear",) else
                                            list(targets), modules_to_save=list(modules_to_save) or None,
                                            task_type="CAUSAL_LM"))
    model.enable_input_require_grads()
    rows, length = 2, 24
    measured = _measure(model, input_ids=torch.randint(0, config.vocab_size, (rows, length)))
    flops = model_flops(config, lora_r=4, lora_targets=targets, modules_to_save=modules_to_save)
    assert measured == {"aten.mm": flops.per_token * rows * length, "aten.bmm": flops.per_pair * rows * length ** 2}


def test_lora_matches_the_flop_counter():
    """LoRA on some layers: base weights forward + input gradient, adapters 3 x. With the
    embedding's output requiring a gradient, as Note [Model FLOPs] counts it."""
    config = embedded_llama_config(num_hidden_layers=2)
    torch.manual_seed(0)
    base = LlamaForCausalLM(config)
    base.set_attn_implementation("eager")
    targets = ("q_proj", "v_proj", "down_proj")
    _check_lora_flops(base, config, targets)


def test_all_linear_and_modules_to_save_match_the_flop_counter():
    """all-linear: adapters on the 7 projections of each layer, not on lm_head; lm_head in
    modules_to_save: its copy trained in full (3 x forward, its frozen original not run), while
    the copies of the embedding and the norms add no matmul."""
    config = embedded_llama_config(num_hidden_layers=1)
    torch.manual_seed(0)
    base = LlamaForCausalLM(config)
    base.set_attn_implementation("eager")
    _check_lora_flops(base, config, ("all-linear",), ("lm_head", "embed_tokens", "norm"))


def test_packed_documents_count_the_pairs_attention_computes():
    """llama-cp's own attention at cp 1 on a row of documents of 4, 2 and 5 tokens, in 1 x 1
    tiles of the math kernel: it computes exactly the visible pairs, 10 + 3 + 15 = 28 (not
    11 x 12 / 2 = 66 of one causal row). Its backward recomputes the scores (2 x head_dim per
    pair and head): hardware work that model FLOPs leave out, so measured = 14/12 x counted."""
    config = embedded_llama_config(num_hidden_layers=1)
    torch.manual_seed(0)
    model = apply_context_parallel(LlamaForCausalLM(config), None, backend="math", block_size=1)
    position_ids = torch.cat([torch.arange(4), torch.arange(2), torch.arange(5)])[None]
    assert attention_pairs(position_ids) == 28
    assert attention_pairs(position_ids, document_mask=False) == 66
    assert attention_pairs(torch.arange(11).expand(3, 11)) == 3 * 66
    measured = _measure(model, input_ids=torch.randint(0, config.vocab_size, (1, 11)), position_ids=position_ids)
    flops = model_flops(config)
    recompute = 2 * 32 * 8 * 1 * 28  # head_dim x heads x layers x pairs
    assert measured == {"aten.mm": flops.per_token * 11, "aten.bmm": flops.per_pair * 28 + recompute}


@pytest.mark.parametrize("name, peak", [
    ("NVIDIA A100-SXM4-40GB", 312e12), ("NVIDIA A100-SXM4-80GB", 312e12), ("NVIDIA A100-PCIE-40GB", 312e12),
    ("NVIDIA A100 80GB PCIe", 312e12),
    ("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 NVL", 835e12), ("NVIDIA H100 PCIe", 756e12),
    ("NVIDIA H200", 989e12), ("NVIDIA H200 NVL", 835e12),  # not the SXM part's 989, whose name it contains
    ("NVIDIA H800", 989e12), ("NVIDIA H800 PCIe", 756e12), ("NVIDIA H20", 148e12),
    ("NVIDIA B200", 2250e12), ("NVIDIA GB200", 2500e12), ("NVIDIA L40S", 362e12),
    ("NVIDIA GeForce RTX 4090", 165.2e12),
    # not in the table: no guess from a part of the name (a MIG slice has a fraction of the peak)
    ("Tesla V100-SXM2-16GB", None), ("NVIDIA A100-SXM4-40GB MIG 1g.5gb", None), ("NVIDIA H100", None),
    ("H200", None), ("nvidia h200", None), (None, None),
])
def test_peak_flops_by_exact_device_name(name, peak):
    assert peak_flops(name) == peak


def test_an_unlisted_gpu_is_told_once_how_to_get_an_mfu(monkeypatch):
    """The trainer on a GPU the table does not name: no mfu, and one line on rank 0 saying so and
    naming --peak_tflops; a listed GPU, or --peak_tflops, gets its peak and no line."""
    from types import SimpleNamespace

    from llama_cp.config import TrainConfig
    from llama_cp.train.trainer import Trainer

    def start(device_name: str, **flags):
        said = []
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: device_name)
        model = LlamaForCausalLM(embedded_llama_config(num_hidden_layers=1))
        trainer = SimpleNamespace(cfg=TrainConfig.from_flags(**flags), model=model, device_type="cuda",
                                  device=torch.device("cuda", 0), _say=said.append)
        Trainer._start_flops_count(trainer)
        return trainer.peak_flops, said

    peak, said = start("NVIDIA RTX PRO 6000 Blackwell Server Edition")
    assert peak is None and said == [
        "no MFU is reported: 'NVIDIA RTX PRO 6000 Blackwell Server Edition' is not in "
        "llama_cp.model.flops.PEAK_BF16_FLOPS; pass --peak_tflops (its dense bf16 TFLOP/s) for one"]
    assert start("NVIDIA H200 NVL") == (835e12, [])
    assert start("NVIDIA RTX PRO 6000 Blackwell Server Edition", peak_tflops=500.0) == (500e12, [])


def test_throughput_figures():
    row = throughput(tokens=16384, flops=8e15, seconds=2.0, world_size=4, peak=1000e12)
    assert row == {"tokens_per_sec_per_gpu": 2048.0, "model_tflops_per_gpu": 1000.0, "mfu": 1.0}
    assert throughput(tokens=16384, flops=8e15, seconds=2.0, world_size=4, peak=None) == {
        "tokens_per_sec_per_gpu": 2048.0, "model_tflops_per_gpu": 1000.0}


def test_lora_on_phi3_fused_layers_matches_the_flop_counter():
    """Phi-3's fused qkv_proj and gate_up_proj as LoRA targets: the adapters of the fused width."""
    from transformers import AutoConfig, AutoModelForCausalLM

    sizes = {k: embedded_llama_config().to_dict()[k] for k in (
        "vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads")}
    config = AutoConfig.for_model("phi3", **sizes, num_hidden_layers=2, tie_word_embeddings=False, pad_token_id=0,
                                  bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(config)
    base.set_attn_implementation("eager")
    targets = ("qkv_proj", "gate_up_proj")
    _check_lora_flops(base, config, targets)


@pytest.mark.parametrize("model_type, fields", [
    ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2)),
    # a dense layer among the MoE ones, with its own intermediate size
    ("qwen3_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, mlp_only_layers=[1])),
])
def test_mixture_of_experts_counts_the_routed_experts(model_type, fields):
    """Each token runs through its top k experts and the router: what the counter measures on
    experts run one by one, which is exact whatever the routing."""
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, vocab_size=128, hidden_size=32, intermediate_size=48,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                  **fields)
    torch.manual_seed(0)
    eager = {"experts_implementation": "eager"} if int(transformers.__version__.split(".")[0]) >= 5 else {}
    model = AutoModelForCausalLM.from_config(config, **eager)
    model.set_attn_implementation("eager")
    rows, length = 2, 24
    measured = _measure(model, input_ids=torch.randint(0, config.vocab_size, (rows, length)))
    flops = model_flops(config)
    assert measured == {"aten.mm": flops.per_token * rows * length, "aten.bmm": flops.per_pair * rows * length ** 2}
    dense = model_flops(AutoConfig.for_model("llama", vocab_size=128, hidden_size=32, intermediate_size=48,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                             head_dim=8))
    assert flops.per_token != dense.per_token


def test_sliding_windows_count_the_pairs_they_see():
    """A 3-token window on one of two layers (Qwen3's layer_types, as Gemma 2 alternates them):
    attention in 1 x 1 tiles of the math kernel computes exactly the pairs each layer sees, and
    model_flops averages them over the layers (plus the backward's recompute, as above)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from llama_cp.modules.causal_lm import EMBEDDED_LLAMA

    fields = {k: v for k, v in EMBEDDED_LLAMA.items() if k not in ("num_hidden_layers", "max_position_embeddings")}
    config = AutoConfig.for_model("qwen3", **fields, num_hidden_layers=2, use_sliding_window=True, sliding_window=3,
                                  max_window_layers=1, max_position_embeddings=64)
    torch.manual_seed(0)
    model = apply_context_parallel(AutoModelForCausalLM.from_config(config), None, backend="math", block_size=1)
    position_ids = torch.cat([torch.arange(4), torch.arange(7)])[None]
    flops = model_flops(config)
    assert flops.windows == (None, 3)
    assert attention_pairs(position_ids, window=3) == (1 + 2 + 3 + 3) + (1 + 2 + 3 * 5)
    assert flops.pairs(position_ids) == (38 + 27) / 2  # 10 + 28 pairs without the window, 27 with it
    measured = _measure(model, input_ids=torch.randint(0, config.vocab_size, (1, 11)), position_ids=position_ids)
    recompute = 2 * 32 * 8 * (38 + 27)  # head_dim x heads x pairs, summed over the two layers
    assert measured == {"aten.mm": flops.per_token * 11, "aten.bmm": flops.per_pair * flops.pairs(position_ids)
                        + recompute}


def test_layers_of_unlike_head_sizes_weigh_their_pairs_by_their_heads():
    """Gemma 4: a windowed layer of heads of 8 and a full layer of heads of 16. Under CP's math kernel in
    1 x 1 tiles each layer computes its own pairs at its own head size; model_flops weighs each layer's pairs
    by its heads (``pair_shares``), where an average over the layers would count the two alike."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if "gemma4_text" not in CONFIG_MAPPING_NAMES:
        pytest.skip(f"transformers {transformers.__version__} has no Gemma 4")
    config = AutoConfig.for_model(
        "gemma4_text", vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, global_head_dim=16, sliding_window=3,
        layer_types=["sliding_attention", "full_attention"], hidden_size_per_layer_input=0, pad_token_id=0)
    torch.manual_seed(0)
    model = apply_context_parallel(AutoModelForCausalLM.from_config(config), None, backend="math", block_size=1)
    position_ids = torch.cat([torch.arange(4), torch.arange(7)])[None]
    flops = model_flops(config)
    assert flops.windows == (3, None) and flops.pair_shares == (1 / 3, 2 / 3)
    assert flops.per_pair == 6 * 4 * (2 * 8 + 2 * 16)
    measured = _measure(model, input_ids=torch.randint(3, config.vocab_size, (1, 11)), position_ids=position_ids)
    pairs = {8: 27, 16: 38}  # the windowed layer's 27 pairs, the full layer's 10 + 28 (as above)
    recompute = sum(2 * 4 * head_dim * count for head_dim, count in pairs.items())
    attention = sum(6 * 4 * 2 * head_dim * count for head_dim, count in pairs.items())
    assert flops.per_pair * flops.pairs(position_ids) == pytest.approx(attention, rel=1e-12)
    assert measured == {"aten.mm": flops.per_token * 11, "aten.bmm": attention + recompute}


@pytest.mark.parametrize("window", [{}, dict(sliding_window=6), dict(sliding_window=6, use_sliding_window=True,
                                                                       max_window_layers=1)])
def test_layer_windows_are_those_the_attention_layers_hold(window):
    """The per-layer windows read from a config (FLOPs, CP's windowed layouts) are the windows each
    family's attention modules hold, for every supported family (transformers' own modules)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from llama_cp.modules.families import SUPPORTED_FAMILIES, transformers_refusal
    from llama_cp.modules.layers import _WINDOW_IN_CONFIG, layer_windows

    base = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    experts = {"mixtral": dict(num_local_experts=4), "qwen3_moe": dict(num_experts=4, moe_intermediate_size=16),
               "olmoe": dict(num_experts=4),  # a few small experts: transformers 4 builds each as Linear layers
               "qwen2_moe": dict(num_experts=4, moe_intermediate_size=16, shared_expert_intermediate_size=32),
               "deepseek_v2": dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16),
               "deepseek_v3": dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16),
               "glm4_moe": dict(n_routed_experts=8, num_experts_per_tok=4, n_group=2, topk_group=1,
                                moe_intermediate_size=16),
               "hunyuan_v1_moe": dict(num_experts=4, moe_topk=2),
               "afmoe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, num_shared_experts=1),
               "exaone_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, n_group=1,
                                  topk_group=1),
               "ernie4_5_moe": dict(moe_num_experts=4, moe_k=2, moe_intermediate_size=16, moe_num_shared_experts=1),
               "dots1": dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, n_shared_experts=1,
                             n_group=1, topk_group=1),
               "gemma3n_text": dict(num_kv_shared_layers=0)}  # its default 15 reusing layers: more than the 4 here
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    for family in SUPPORTED_FAMILIES:
        if family not in CONFIG_MAPPING_NAMES:  # newer than the installed transformers (ministral, olmo3 on 4.56)
            continue
        if transformers_refusal(family, transformers.__version__):  # refused here (Apertus on 4.x)
            continue
        if family == "iquestcoder" and window.get("use_sliding_window"):  # its config refuses use_sliding_window
            continue
        config = AutoConfig.for_model(family, **base, **experts.get(family, {}), **window)
        with torch.device("meta"):  # the modules' attributes only: no weights made (1.5 s of 29 families' inits)
            model = AutoModelForCausalLM.from_config(config)
        attention = [m for m in model.modules() if hasattr(m, "o_proj")]
        in_config = getattr(config, "sliding_window", None)
        # Exaone 4 holds the config's window on its full layers too, and passes None there (is_sliding)
        held = [in_config if family in _WINDOW_IN_CONFIG else getattr(m, "sliding_window", None)
                if getattr(m, "is_sliding", True) else None for m in attention]
        assert layer_windows(config) == held, family
