"""``--compile`` (llama_cp/modules/compiled.py): which modules run through torch.compile, the
training trajectory it gives against eager's in float32 (one process; inductor's CPU kernels),
and the planner's plan of it (eager: Note [Compiled per-token modules])."""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch._dynamo.utils import counters
from torch._subclasses.fake_tensor import FakeTensorMode
from transformers import AutoConfig, AutoModelForCausalLM

from llama_cp import apply_context_parallel
from llama_cp.config import TrainConfig
from llama_cp.modules.causal_lm import decoder_layers, embedded_llama_config
from llama_cp.modules.compiled import attention_layers, compile_forward, compile_per_token_modules, compiled_summary

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8)


def _compiled(model) -> list[str]:
    return [name for name, m in model.named_modules() if getattr(m, "_llama_cp_compiled", False)]


def test_the_norms_dense_mlps_and_attention_layers_are_compiled_and_moe_mlps_stay_eager():
    llama = apply_context_parallel(AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **SMALL)), None)
    compile_per_token_modules(llama, decoder_layers(llama))
    assert sorted(_compiled(llama)) == [
        "model.layers.0.input_layernorm", "model.layers.0.mlp", "model.layers.0.post_attention_layernorm",
        "model.layers.0.self_attn", "model.layers.1.input_layernorm", "model.layers.1.mlp",
        "model.layers.1.post_attention_layernorm", "model.layers.1.self_attn", "model.norm"]
    assert compiled_summary(llama, decoder_layers(llama)) == (
        "--compile: 5 norms, 2 MLPs and 2 attention layers run through torch.compile; the attention kernels stay "
        "eager; the first steps compile")
    # MoE blocks: Mixtral's (transformers 4: block_sparse_moe, experts a ModuleList of Linear MLPs; 5: mlp,
    # fused experts) and Qwen2-MoE's (mlp in both; 4: a ModuleList of Linear MLPs, a Linear router)
    for family in ("mixtral", "qwen2_moe"):
        moe = AutoModelForCausalLM.from_config(AutoConfig.for_model(
            family, **SMALL, num_local_experts=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
            shared_expert_intermediate_size=16))
        compile_per_token_modules(moe, decoder_layers(moe))
        assert sorted(_compiled(moe)) == ["model.layers.0.input_layernorm", "model.layers.0.post_attention_layernorm",
                                          "model.layers.1.input_layernorm", "model.layers.1.post_attention_layernorm",
                                          "model.norm"], family
        assert compiled_summary(moe, decoder_layers(moe)) == (
            "--compile: 5 norms, 0 MLPs and 0 attention layers run through torch.compile; the attention kernels, "
            "2 MoE MLPs stay eager; the first steps compile")


def test_dora_mlps_compile_and_copied_norms_are_said():
    """DoRA's magnitudes are peft's parameters, not an expert's: the MLP is dense. Norms that
    --lora_modules_to_save copies are peft's wrappers, left eager, and the line says so."""
    from peft import LoraConfig, get_peft_model

    for config, compiled, line in (
        (LoraConfig(target_modules=["gate_proj", "up_proj", "down_proj"], use_dora=True), 7,
         "--compile: 5 norms, 2 MLPs and 0 attention layers run through torch.compile; the attention kernels stay "
         "eager"),
        (LoraConfig(target_modules=["q_proj"], modules_to_save=["norm"]), 2,  # peft matches every "*norm"
         "--compile: 0 norms, 2 MLPs and 0 attention layers run through torch.compile; the attention kernels, 5 "
         "norms of --lora_modules_to_save stay eager"),
    ):
        model = get_peft_model(AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **SMALL)), config)
        compile_per_token_modules(model, decoder_layers(model))
        assert len(_compiled(model)) == compiled and compiled_summary(model, decoder_layers(model)).startswith(line)


def test_a_fake_tensor_takes_the_eager_forward():
    """The planner's fake tensors never reach dynamo: the plan is eager's (Note [Compiled per-token modules])."""
    llama = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **SMALL))
    compile_per_token_modules(llama, decoder_layers(llama))
    captured = counters["stats"]["calls_captured"]
    with FakeTensorMode(allow_non_fake_inputs=True):  # the module's weights are real
        x = torch.randn(2, 5, 32, requires_grad=True)
        out = llama.model.layers[0].mlp(llama.model.layers[0].input_layernorm(x))
        out.sum().backward()
    assert out.shape == (2, 5, 32) and counters["stats"]["calls_captured"] == captured


@pytest.mark.slow
def test_the_planner_plans_compile_as_eager():
    from llama_cp.plan.simulate import plan_step_memory

    config = embedded_llama_config(num_hidden_layers=2)
    plans = [plan_step_memory(TrainConfig.from_flags(context_length=1024, use_peft=True, activation_checkpointing=True,
                                                     compile=compile, report_to="none"), 1, model_config=config)
             for compile in (False, True)]
    assert plans[0].total > 0 and plans[1] == plans[0]


def _trajectory(output_dir, **flags) -> list[tuple[float, float]]:
    from llama_cp import Trainer

    cfg = TrainConfig.from_flags(context_length=256, num_passkey_samples=16, num_eval_samples=2, max_steps=3,
                                 log_every=1, warmup_steps=1, lr=3e-3, save_every=0, report_to="none",
                                 output_dir=str(output_dir), **flags)
    Trainer(cfg).fit()
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        return [(row["loss"], row["grad_norm"]) for row in map(json.loads, f) if "loss" in row]


def eager_and_compiled(item) -> tuple[list, list, int, str]:
    """In a process of its own (the trainer leaves a process group behind): the trajectories of
    ``flags`` eager and with --compile, the frames dynamo captured in the compiled run, and its stdout."""
    import contextlib
    import io

    directory, flags = item
    torch.set_num_threads(1)
    eager = _trajectory(os.path.join(directory, "eager"), **flags)
    captured, said = counters["stats"]["calls_captured"], io.StringIO()
    with contextlib.redirect_stdout(said):
        compiled = _trajectory(os.path.join(directory, "compiled"), compile=True, **flags)
    return eager, compiled, counters["stats"]["calls_captured"] - captured, said.getvalue()


@pytest.mark.slow
def test_a_compiled_run_follows_the_eager_trajectory(tmp_path):
    """float32 on CPU: losses and gradient norms of 3 steps equal eager's to 1e-5 (inductor sums in
    another order), and the compiled graphs really ran (dynamo captured frames): LoRA on every Linear
    layer (the MLPs' and attention layers' adapters compiled) with checkpointing and the MLP and norm
    tiles, and full fine-tuning without levers (the trainable head's gradient from the compiled loss
    chunks), side by side."""
    from dist_harness import map_in_processes

    runs = {"lora_checkpointing_tiles": dict(use_peft=True, lora_target_modules=("all-linear",),
                                             activation_checkpointing=True, mlp_tile_size=64, norm_tile_size=64),
            "full": dict()}
    results = map_in_processes(eager_and_compiled, [(str(tmp_path / name), flags) for name, flags in runs.items()])
    for name, (eager, compiled, captured, said) in zip(runs, results):
        assert captured > 0, name
        assert ("--compile: 9 norms, 4 MLPs, 4 attention layers and the loss's chunks run through torch.compile"
                in said), (name, said)
        torch.testing.assert_close(torch.tensor(compiled, dtype=torch.float64),
                                   torch.tensor(eager, dtype=torch.float64), rtol=1e-5, atol=0, msg=name)


def _packed_positions(lengths: list[int]) -> torch.Tensor:
    return torch.cat([torch.arange(n) for n in lengths])[None].expand(2, -1)


def _step(model, ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad()  # no cache, as training calls it (llama_cp.model.loss)
    loss = model(input_ids=ids, position_ids=positions, labels=ids, use_cache=False).loss
    loss.backward()
    return loss.detach(), [p.grad for p in model.parameters() if p.grad is not None]


@pytest.mark.slow
def test_every_attention_family_compiles_around_its_kernel_and_equals_eager():
    """The attention layers' own forwards compiled (Note [Compiled per-token modules]), at cp 1 in float32
    on packed documents: the loss and every gradient equal eager's (inductor sums in another order), for
    the families whose attention code differs most: Llama's RoPE, Qwen 3's q/k norms, gpt-oss's sinks
    (a parameter passed to the kernel), DeepSeek-V3's latent attention (interleaved RoPE, narrower value
    heads) and Llama 4's complex RoPE with query temperature and chunks. Dynamo breaks its graphs only at
    the attention function, which it never traces (it reads host values), and another batch's documents
    compile nothing new."""
    from test_deepseek import family_model as deepseek_model
    from test_families import family_model
    from test_gpt_oss import gpt_oss_model
    from test_llama4 import llama4_model

    builders = {"llama": lambda: family_model("llama"), "qwen3": lambda: family_model("qwen3"),
                "gpt_oss": gpt_oss_model, "deepseek_v3": lambda: deepseek_model("deepseek_v3"),
                "llama4_text": llama4_model}
    for name, build in builders.items():
        eager, compiled = (apply_context_parallel(build(), None) for _ in range(2))
        layers = attention_layers(compiled)
        assert len(layers) == compiled.config.num_hidden_layers, name
        for module in layers:  # the attention layers alone, as compile_per_token_modules compiles them
            compile_forward(module)
        generator = torch.Generator().manual_seed(0)
        ids = torch.randint(3, compiled.config.vocab_size, (2, 32), generator=generator)
        breaks = dict(counters["graph_break"])
        for lengths in ([20, 12], [5, 1, 14, 12]):
            graphs = counters["stats"]["unique_graphs"]
            (loss, grads), (want_loss, want_grads) = (_step(m, ids, _packed_positions(lengths)) for m in (compiled,
                                                                                                          eager))
            torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=0, msg=name)
            assert len(grads) == len(want_grads), name
            for got, want in zip(grads, want_grads):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7, msg=name)
            if lengths[0] == 20:
                assert counters["stats"]["unique_graphs"] > graphs, name  # the first batch compiled
        assert counters["stats"]["unique_graphs"] == graphs, name  # the second one compiled nothing
        new_breaks = [reason for reason in counters["graph_break"] if counters["graph_break"][reason] >
                      breaks.get(reason, 0)]
        assert new_breaks and all("torch.compiler.disable" in reason for reason in new_breaks), (name, new_breaks)


@pytest.mark.slow
def test_gemma4_layers_sharing_keys_and_values_stay_eager(tmp_path):
    """Gemma 4's layers that store keys and values for later layers, or reuse them, read and write a dict
    the model shares. Compiled, the trainer's first step failed in backward: activation checkpointing's
    recompute took another graph than the forward ("Recomputed values ... have different metadata"). They
    stay eager and the start line says so; with every decoder layer checkpointed the compiled run follows
    eager's trajectory (float32; the gradient norms to 1e-3: Gemma's many norms, summed in inductor's
    order, move them by up to 5e-4 in 3 steps at lr 3e-3, the losses by 1e-6)."""
    from test_families_new import skip_reason

    if skip_reason("gemma4_text"):
        pytest.skip(skip_reason("gemma4_text"))
    # layers 0-1 store their keys and values, 2-3 reuse them (transformers' kv_sharing_modes)
    config = AutoConfig.for_model(
        "gemma4_text", vocab_size=264, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, global_head_dim=16, num_global_key_value_heads=1,
        attention_k_eq_v=True, num_kv_shared_layers=2, layer_types=["sliding_attention", "full_attention"] * 2,
        sliding_window=64, hidden_size_per_layer_input=8, vocab_size_per_layer_input=264, max_position_embeddings=1024)
    torch.manual_seed(0)
    check_kv_sharing_layers_stay_eager(AutoModelForCausalLM.from_config(config), tmp_path, rtol=1e-3)


def check_kv_sharing_layers_stay_eager(model, directory, rtol: float) -> None:
    """``model`` (4 layers: 0-1 store their keys and values, 2-3 reuse them) saved with the byte tokenizer and
    trained 3 steps eager and with --compile, every decoder layer checkpointed, each in a process of its own: the
    compiled graphs ran, the start line says the 4 attention layers that share keys and values stay eager, and
    the losses and gradient norms agree to ``rtol``."""
    from dist_harness import map_in_processes

    from llama_cp.data.tokenizer import byte_tokenizer

    assert [(layer.self_attn.store_full_length_kv, layer.self_attn.is_kv_shared_layer) for layer in model.model.layers
            ] == [(True, False), (True, False), (False, True), (False, True)]
    model.save_pretrained(directory / "model")
    byte_tokenizer().save_pretrained(directory / "model")
    flags = dict(model_name=str(directory / "model"), activation_checkpointing=True)
    ((eager, compiled, captured, said),) = map_in_processes(eager_and_compiled, [(str(directory), flags)], processes=1)
    assert captured > 0
    assert ("--compile: 21 norms, 4 MLPs, 0 attention layers and the loss's chunks run through torch.compile; the "
            "attention kernels, 4 attention layers that share keys and values across layers stay eager" in said), said
    torch.testing.assert_close(torch.tensor(compiled, dtype=torch.float64), torch.tensor(eager, dtype=torch.float64),
                               rtol=rtol, atol=0)


@pytest.mark.slow
def test_gemma3n_compiled_follows_eager(tmp_path):
    """Gemma 3n full fine-tuning with --compile: its MLPs (the Gaussian top-k among them) and norms compiled, its
    attention layers that store or reuse keys and values eager (as Gemma 4's), AltUp eager (not a per-token module
    the trainer compiles; it clamps its coefficients in place); every layer checkpointed. The losses and gradient
    norms of 3 steps follow eager's (float32: the losses to 1e-9, the gradient norms to 2e-6 here)."""
    from test_gemma3n import SKIP, gemma3n_model

    if SKIP:
        pytest.skip(SKIP)
    model = gemma3n_model(vocab_size=264, vocab_size_per_layer_input=264, sliding_window=64,
                          max_position_embeddings=1024, attn_implementation="sdpa")
    check_kv_sharing_layers_stay_eager(model, tmp_path, rtol=1e-5)
