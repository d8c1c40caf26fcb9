"""``python -m recipes.plan_memory``: the JSON contract, the cp=8 activation cut on a
Llama-3-8B shape, the max-context search, and its errors."""

from __future__ import annotations

import contextlib
import copy
import glob
import io
import json
import os

import pytest
import torch
from transformers import LlamaForCausalLM

from dist_harness import map_in_processes
from llama_cp.config import TrainConfig
from llama_cp.modules.causal_lm import embedded_llama_config
from llama_cp.modules.quantize import installed_qlora_refusal
from llama_cp.plan.fit import find_max_context, with_context
from llama_cp.plan.memory import GiB
from memory_matrix import once_per_arguments
from recipes.plan_memory import main

KEYS = {"parameters", "gradients", "optimizer", "activations", "temporary", "total"}


def run_json(capsys, **flags) -> dict:
    main(json=True, **flags)
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.mark.slow
def test_llama3_8b_lora_131k_cp8_json_and_activation_cut(capsys, tmp_path):
    from transformers import LlamaConfig

    from llama_cp.plan.simulate import MODEL_PRESETS

    # the Llama-3-8B shape with 4 layers: one simulation a plan (the ratios below are per layer)
    LlamaConfig(**{**MODEL_PRESETS["llama3-8b"], "num_hidden_layers": 4}).save_pretrained(tmp_path)
    common = dict(model_name=str(tmp_path), context_length=131072, num_gpus=8, use_peft=True)
    cp8 = run_json(capsys, cp=8, **common)
    assert KEYS <= cp8["per_rank_bytes"].keys()
    assert cp8["gpu_memory_bytes"] == 80 * GiB and isinstance(cp8["fits"], bool)
    parts = sum(v for k, v in cp8["per_rank_bytes"].items() if k != "total")
    assert parts == cp8["per_rank_bytes"]["total"]
    cp1 = run_json(capsys, cp=1, **common)
    ratio = cp1["per_rank_bytes"]["activations"] / cp8["per_rank_bytes"]["activations"]
    assert ratio >= 6, f"cp=8 cut activations only {ratio:.2f}x"
    # the same LoRA state on every rank layout of 8 GPUs: sharded over all 8 either way
    assert cp1["per_rank_bytes"]["optimizer"] == cp8["per_rank_bytes"]["optimizer"]


@pytest.mark.slow
def test_find_max_context_is_the_largest_that_fits(monkeypatch):
    import llama_cp.plan.simulate as simulate

    # the search's own plans of `length` and `length + 512` answer the checks below
    once_per_arguments(monkeypatch, simulate, "plan_step_memory")
    config = embedded_llama_config(num_hidden_layers=3)  # 3 layers: each plan is one simulation
    cfg = TrainConfig.from_flags(cp=2, context_length=1024)
    budget = int(0.2 * GiB)
    length, at_max = find_max_context(cfg, 2, budget, model_config=config, granularity=512)
    assert length > 0 and length % 512 == 0 and at_max.total <= budget
    assert simulate.plan_step_memory(with_context(cfg, length), 2, model_config=config) == at_max
    assert simulate.plan_step_memory(with_context(cfg, length + 512), 2, model_config=config).total > budget


def test_errors_name_the_flag(capsys):
    with pytest.raises(ValueError, match=r"--num_gpus 8 does not match.*cp\(3\)"):
        main(model_name="embedded", num_gpus=8, cp=3, context_length=1536)
    with pytest.raises(ValueError, match="--model_name 'llama9'.*llama3-8b"):
        main(model_name="llama9", num_gpus=1)
    with pytest.raises(ValueError, match="did you mean --context_length"):
        main(model_name="embedded", num_gpus=1, context_lenght=4096)
    with pytest.raises(ValueError, match="cannot simulate --optimizer adamw8bit"):
        main(model_name="embedded", num_gpus=1, context_length=1024, optimizer="adamw8bit")
    with pytest.raises(ValueError, match="cannot simulate --cp_strategy allgather"):
        main(model_name="embedded", num_gpus=2, cp=2, context_length=1024, cp_strategy="allgather")
    with pytest.raises(ValueError, match="--headroom"):
        main(model_name="embedded", num_gpus=1, context_length=1024, headroom=1.5)


@pytest.mark.slow
def test_plot_max_context_fsdp_only_vs_cp(tmp_path, monkeypatch):
    import recipes.plan_memory as plan_memory

    monkeypatch.setattr(plan_memory, "PLOT_GPUS", (1, 2))
    monkeypatch.setattr(plan_memory, "PLOT_GRANULARITY", 4096)  # fewer plans per search; the shape is the same
    # on 1 GPU both layouts are cp=1 over 1 rank, the same search (equal TrainConfig and arguments): run it once
    searched = once_per_arguments(monkeypatch, plan_memory, "search_max_context")
    config = embedded_llama_config(num_hidden_layers=3)
    cfg = TrainConfig.from_flags(context_length=1024)
    png = tmp_path / "max_context.png"
    points = plan_memory.plot_max_context(cfg, config, int(0.2 * GiB), str(png), 0.2)
    lengths = {(p["num_gpus"], p["layout"]): p["max_context_length"] for p in points}
    assert lengths[1, "FSDP only"] == lengths[1, "FSDP + CP"] > 0  # cp=1 either way
    assert lengths[2, "FSDP + CP"] > lengths[2, "FSDP only"] >= lengths[1, "FSDP only"]
    assert png.stat().st_size > 0
    assert len(searched) == 3  # 1 GPU (once), 2 GPUs FSDP only, 2 GPUs FSDP + CP


@pytest.mark.slow  # plans under fake tensors: seconds each
def test_bf16_checkpoint_is_planned_with_float32_shards(tmp_path):
    """The planner builds like the trainer (``build_causal_lm``): a checkpoint whose config.json
    says bfloat16 is planned with float32 sharded parameters, gradients and optimizer state,
    exactly like its float32 copy, and the parameters take 4 bytes each."""
    from llama_cp.plan.simulate import simulate_step_phases

    config = embedded_llama_config(num_hidden_layers=2)
    for dtype in ("bfloat16", "float32"):
        config.dtype = dtype
        config.save_pretrained(tmp_path / dtype)
    cfg = {dtype: TrainConfig.from_flags(model_name=str(tmp_path / dtype), context_length=256)
           for dtype in ("bfloat16", "float32")}
    bf16, fp32 = (simulate_step_phases(cfg[d], world_size=1) for d in ("bfloat16", "float32"))
    assert bf16 == fp32
    params = sum(p.numel() for p in LlamaForCausalLM(config).parameters())
    assert bf16["optimizer"].tracked["Sharded Param"] == 4 * params


CONFIGS = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "..", "..", "configs", "*.yaml")))


def preset_and_gpus(path: str) -> tuple[TrainConfig, int]:
    cfg = TrainConfig.from_flags(path, model_name="llama3-8b")
    p = cfg.parallel
    return cfg, p.cp * max(p.dp_shard, 1) * p.dp_replicate


def preset_refusal(path: str) -> str | None:
    """Why preset ``path`` cannot be planned here: a QLoRA preset where QLoRA is refused, which its
    config already refuses (Note [QLoRA's version floor] in llama_cp/modules/quantize.py); None
    when it can."""
    try:
        preset_and_gpus(path)
    except ValueError as error:
        if str(error) != installed_qlora_refusal():
            raise
        return str(error)
    return None


def plan_preset(job: tuple[str, str]) -> dict:
    """The planner CLI's JSON line for preset ``path`` on the GPUs it names, its context shortened
    and the model a 2-layer Llama-3-8B in ``model_dir`` (one simulation, not the 3 and 4 layers of
    the 32-layer plan; the planner's default model for a preset without one: checked apart). Two layers
    keep every check of test_every_shipped_config_plans biting (the offloaded checkpoints' host bytes;
    parameters of the 8B shape: its embedding and head alone are 1.05 G) at half the CPU time of four."""
    path, model_dir = job
    cfg, num_gpus = preset_and_gpus(path)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main(json=True, config=path, num_gpus=num_gpus, context_length=1024 * cfg.parallel.cp, model_name=model_dir)
    return json.loads(out.getvalue().strip().splitlines()[-1])


@pytest.fixture(scope="module")
def preset_plans(tmp_path_factory) -> dict[str, dict]:
    """Every preset that can be planned here, planned in two processes (``map_in_processes``)."""
    from transformers import LlamaConfig

    from llama_cp.plan.simulate import MODEL_PRESETS

    model_dir = str(tmp_path_factory.mktemp("llama3_8b_2_layers"))
    LlamaConfig(**{**MODEL_PRESETS["llama3-8b"], "num_hidden_layers": 2}).save_pretrained(model_dir)
    plannable = [path for path in CONFIGS if preset_refusal(path) is None]
    plans = map_in_processes(plan_preset, [(path, model_dir) for path in plannable])
    return dict(zip(plannable, plans, strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("path", CONFIGS, ids=[os.path.basename(p) for p in CONFIGS])
def test_every_shipped_config_plans(preset_plans, path):
    """Each preset in configs/ goes through the planner CLI with its own flags (gradient
    accumulation, levers, parallel degrees) on the Llama-3-8B shape; only the context is
    shortened, to keep the suite fast (the full-length figures: docs/memory.md)."""
    if preset_refusal(path) is not None:
        pytest.skip(preset_refusal(path))
    cfg, num_gpus = preset_and_gpus(path)
    result = preset_plans[path]
    assert result["per_rank_bytes"]["total"] > 0
    assert (result["host_bytes_per_rank"] > 0) == (cfg.model.offload_checkpoints or cfg.model.offload_params)
    # a preset that names no model is planned as the planner's default model, not the tiny embedded one
    from recipes.plan_memory import build_config

    assert build_config(path, num_gpus, {}).model.model_name == "llama3-8b"
    # the 8B shape's parameters (with --offload_params its fp32 shards are host memory: 4 of the 16
    # bytes a parameter keeps there)
    on_gpu = result["host_bytes_per_rank"] / 4 if cfg.model.offload_params else result["per_rank_bytes"]["parameters"]
    assert on_gpu > GiB / num_gpus


@pytest.mark.slow  # plans under fake tensors: seconds each
def test_gradient_accumulation_keeps_the_sharded_gradients_between_micro_batches():
    """--gradient_accumulation_steps 2 plans (FSDPMemTracker refused a second forward before):
    the second micro-batch's peak holds the sharded gradients of the first."""
    from llama_cp.plan.simulate import simulate_step_phases

    config = embedded_llama_config(num_hidden_layers=2)
    phases = {steps: simulate_step_phases(TrainConfig.from_flags(context_length=512, gradient_accumulation_steps=steps),
                                          1, model_config=config) for steps in (1, 2)}
    trainable = phases[1]["optimizer"].tracked["Sharded Grad"]
    assert trainable > 0
    assert phases[2]["forward_backward"].tracked.get("Sharded Grad", 0) == trainable
    assert phases[1]["forward_backward"].tracked.get("Sharded Grad", 0) < trainable
    assert phases[2]["forward_backward"].total > phases[1]["forward_backward"].total


@pytest.mark.slow  # plans under fake tensors: seconds each
def test_a_plan_walks_no_heap_and_tracks_its_phases_with_the_collector_off(monkeypatch):
    """Note [No collection in a tracked phase]: no full collection (a walk of every object of the
    process, 0.22 s each, a fifth of a small plan), and no automatic one inside a tracked phase,
    where it would free the step's cyclic garbage at a point set by the process's history; the
    collector is back on after the plan."""
    import gc

    import llama_cp.plan.memory
    from llama_cp.plan.simulate import simulate_step_phases

    collections, inside = [], []
    monkeypatch.setattr(gc, "collect", lambda *args: collections.append(args) or 0)
    for name in ("forward_backward", "apply_gradients"):  # the tracked phases' work, as measure_step_memory calls it
        work = getattr(llama_cp.plan.memory, name)
        monkeypatch.setattr(llama_cp.plan.memory, name,
                            lambda *args, _work=work, _name=name, **kwargs:
                            inside.append((_name, gc.isenabled())) or _work(*args, **kwargs))
    assert gc.isenabled()
    cfg = TrainConfig.from_flags(context_length=256, gradient_accumulation_steps=2)
    simulate_step_phases(cfg, 1, model_config=embedded_llama_config(num_hidden_layers=2))
    assert collections == []
    # the optimizer's state made by an untracked step first (create_optimizer_state), then the tracked phases
    assert inside == [("apply_gradients", True), ("forward_backward", False), ("forward_backward", False),
                      ("apply_gradients", False)], inside
    assert gc.isenabled()


@pytest.mark.slow  # plans under fake tensors: seconds each
def test_the_categories_add_up_to_the_tracked_total():
    """Every byte FSDPMemTracker counts lands in one of the plan's categories, in every phase: the
    categories add up to the tracked total, and no tracked category is left out of them (a
    category dropped from llama_cp.plan.memory._GROUPS would still leave the total right)."""
    from llama_cp.plan.memory import _GROUPS
    from llama_cp.plan.simulate import simulate_step_phases

    cfg = TrainConfig.from_flags(context_length=512, cp=2, use_peft=True, activation_checkpointing=True,
                                 offload_checkpoints=True, dtype="bfloat16")
    grouped = {name for names in _GROUPS.values() for name in names}
    for phase, plan in simulate_step_phases(cfg, 2, model_config=embedded_llama_config()).items():
        categories = {name: value for name, value in plan.to_dict().items() if name != "total"}
        assert sum(categories.values()) == plan.total > 0, (phase, categories, plan.total)
        counted = {name for name, value in plan.tracked.items() if name != "Total" and value}
        assert counted <= grouped, (phase, counted - grouped)
        assert plan.tracked["Total"] == plan.total, phase


@pytest.mark.slow  # plans under fake tensors: seconds each
def test_the_adamw_step_is_its_state_and_one_sqrt_list():
    """Note [Counting the AdamW step]: a full fine-tune's optimizer phase holds the fp32 parameters
    and gradients, AdamW's two moments and step counters, and the foreach step's sqrt(exp_avg_sq)
    of the larger parameter group (the matrices that decay), nothing more: what an H200 measured
    on torch 2.11, where FSDPMemTracker's fake step counted three more sqrt lists (49.48 GiB
    planned for a 36.65 GiB step)."""
    from llama_cp.optim.optimizers import DECAYS, parameter_groups
    from llama_cp.plan.simulate import simulate_step_phases

    config = embedded_llama_config(num_hidden_layers=2)
    cfg = TrainConfig.from_flags(context_length=256, activation_checkpointing=True, dtype="bfloat16")
    plan = simulate_step_phases(cfg, 1, model_config=config)["optimizer"]
    model = LlamaForCausalLM(config)
    params = list(model.parameters())
    decaying = [g for g in parameter_groups(model, 0.01) if g[DECAYS]]
    matrices = sum(p.numel() for g in decaying for p in g["params"])
    assert 2 * matrices > sum(p.numel() for p in params)  # the group that decays is the larger
    state = 8 * sum(p.numel() for p in params) + 4 * len(params)  # two fp32 moments, a step counter each
    assert plan.optimizer == state + 4 * matrices, (plan.optimizer, state, 4 * matrices)
    assert plan.total == plan.parameters + plan.gradients + plan.optimizer + plan.activations + plan.temporary
    assert plan.gradients == 4 * sum(p.numel() for p in params) == plan.tracked["Sharded Param"]


@pytest.mark.slow  # plans under fake tensors: seconds each
def test_the_adamw_step_extrapolates_each_group():
    """Note [Counting the AdamW step]: with tied embeddings the group that does not decay (the
    embedding) is the larger at 3 and 4 layers and the smaller at 16, so the plan from 3 and 4
    layers takes the largest of the extrapolated groups, not the extrapolated largest: it equals
    the 16-layer simulation, whose peak is the optimizer phase."""
    from llama_cp.plan.memory import step_peak
    from llama_cp.plan.simulate import plan_step_memory, simulate_step_phases

    config = embedded_llama_config(num_hidden_layers=16, vocab_size=8192, hidden_size=128, intermediate_size=344,
                                   num_attention_heads=4, num_key_value_heads=1, head_dim=32, tie_word_embeddings=True)
    cfg = TrainConfig.from_flags(context_length=64, activation_checkpointing=True, dtype="bfloat16")
    whole = simulate_step_phases(cfg, 1, model_config=copy.deepcopy(config))
    assert max(whole.values(), key=lambda b: b.total) is whole["optimizer"]
    embedding = 4 * config.vocab_size * config.hidden_size  # fp32 bytes; tied, so no lm_head among the matrices
    layers, rest = whole["optimizer"].sqrt_groups  # the matrices that decay; the embedding and the norms
    assert layers > rest > embedding and layers // 4 < embedding  # at 4 layers the embedding's group is the larger
    assert plan_step_memory(cfg, 1, model_config=copy.deepcopy(config)) == step_peak(whole)  # simulate_step_memory's


@pytest.mark.slow  # plans under fake tensors: seconds each
def test_offloaded_parameters_are_planned_as_host_memory(capsys):
    """Note [Planning --offload_params]: the offloaded step's device bytes are the plain step's less
    the sharded parameters, gradients and AdamW state (float32: 4 + 4 + 8 bytes per parameter
    shard), plus the largest copy-in (bf16 compute: one float32 parameter shard before its cast,
    here the embedding's or lm_head's) and the largest group's float32 gradient shards (a decoder
    layer's); the optimizer phase runs on the CPU with fused AdamW (no foreach temporaries), so all of
    it but the buffers is host memory. The CLI says both."""
    from llama_cp.plan.simulate import simulate_step_phases

    config = embedded_llama_config(num_hidden_layers=2)
    flags = dict(context_length=1024, dp_shard=2, activation_checkpointing=True, dtype="bfloat16")
    plain, offloaded = (simulate_step_phases(TrainConfig.from_flags(**flags, offload_params=offload), 2,
                                             model_config=config) for offload in (False, True))
    model = LlamaForCausalLM(config)
    layer = sum(p.numel() for p in model.model.layers[0].parameters())
    assert layer > model.lm_head.weight.numel() + config.hidden_size  # the head's group is the smaller
    transient = 4 * config.vocab_size * config.hidden_size // 2 + 4 * layer // 2  # shards of world 2
    for phase in ("eval", "forward_backward"):
        tracked = plain[phase].tracked
        state = tracked["Sharded Param"] + tracked.get("Sharded Grad", 0) + tracked["OptState"]
        assert tracked["Sharded Param"] == 4 * sum(p.numel() for p in model.parameters()) // 2
        assert offloaded[phase].total == plain[phase].total - state + transient, phase
        assert offloaded[phase].host == state and offloaded[phase].communication == plain[phase].communication + transient
        assert offloaded[phase].parameters == plain[phase].parameters - tracked["Sharded Param"]
    # the optimizer phase on the host, fused AdamW: the state (fp32 shards, gradients, two moments)
    # and the step counters, no foreach temporaries (Note [Counting the AdamW step]; before, torch
    # 2.10's tracker counted 41.6 MB here for 15.3 MB of state)
    tracked = plain["optimizer"].tracked
    state = tracked["Sharded Param"] + 3 * tracked["Sharded Grad"]
    assert offloaded["optimizer"].total == tracked["Buffer"]  # the RoPE tables stay on the device
    assert state <= offloaded["optimizer"].host < min(1.01 * state, plain["optimizer"].total)
    main(json=True, model_name="embedded", context_length=1024, num_gpus=2, dp_shard=2, offload_params=True,
         activation_checkpointing=True, dtype="bfloat16")
    out = capsys.readouterr().out
    result = json.loads(out.strip().splitlines()[-1])
    assert result["host_bytes_per_rank"] > 16 * sum(p.numel() for p in model.parameters()) // 2
    assert result["host_bytes_per_node"] == 2 * result["host_bytes_per_rank"]
    assert "sharded parameters, gradients and AdamW state (--offload_params)" in out and "a node of 2 GPUs" in out


def breakdown_at(tokens: int) -> tuple[list, int]:
    """The groups ``step_peak_tensors`` finds at ``tokens`` tokens, and the planner's tracked peak
    there (two simulations of their own), for ``map_in_processes``."""
    from llama_cp.plan.breakdown import step_peak_tensors
    from llama_cp.plan.simulate import simulate_step_memory

    config = embedded_llama_config()
    cfg = TrainConfig.from_flags(context_length=tokens, use_peft=True, activation_checkpointing=True, dtype="bfloat16")
    return step_peak_tensors(cfg, 1, model_config=config), simulate_step_memory(cfg, 1, model_config=config).total


@pytest.mark.slow  # plans under fake tensors: seconds each
def test_breakdown_lists_the_tensors_at_the_peak_with_their_bytes_per_token():
    """--breakdown (llama_cp/plan/breakdown.py): the tensors made in the step and alive at its peak
    add up to the planner's tracked peak less what existed before the step (the LoRA weights,
    their AdamW state, the RoPE tables: under 2%); a tensor whose shape holds the token count
    is per token, and at twice the tokens its group holds twice the bytes. The two lengths are
    planned in two processes (``map_in_processes``: one core each)."""
    from llama_cp.plan.breakdown import describe_groups

    groups, totals = {}, {}
    lengths = (2048, 4096)
    for tokens, (found, total) in zip(lengths, map_in_processes(breakdown_at, list(lengths)), strict=True):
        groups[tokens] = {group.label: group for group in found}
        totals[tokens] = total
        made = sum(group.nbytes for group in found)
        assert 0.98 * totals[tokens] <= made <= totals[tokens], (tokens, made, totals[tokens])
        assert [group.nbytes for group in found] == sorted((group.nbytes for group in found), reverse=True)
        text = describe_groups(found, tokens, top=3)
        assert len(text.splitlines()) == 4 and "B/token" in text and "modeling_llama.py:forward" in text, text
    per_token = [group for group in groups[2048].values() if group.per_token]
    assert per_token and all("T" in g.label.split("(")[1].split(")")[0].split(", ") for g in per_token)
    largest = max(per_token, key=lambda group: group.nbytes)
    assert groups[4096][largest.label].nbytes == 2 * largest.nbytes, largest


@pytest.mark.slow  # plans under fake tensors: seconds each
def test_plan_memory_with_memory_auto_chooses_then_plans(capsys, tmp_path, monkeypatch):
    """python -m recipes.plan_memory --memory auto: the trainer's choice (llama_cp/plan/auto.py) is
    printed, and the plan and the max-context search are made with its levers."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    embedded_llama_config().save_pretrained(tmp_path / "model")  # a local model: checkpointing on by default
    main(json=True, model_name=str(tmp_path / "model"), context_length=512, num_gpus=1, memory="auto",
         gpu_memory_gb=80)
    out = capsys.readouterr().out
    result = json.loads(out.strip().splitlines()[-1])
    chosen = [line for line in out.splitlines() if line.startswith("--memory auto: ")]
    peak = result["per_rank_bytes"]["total"]
    assert chosen == [f"--memory auto: no lever -> planned peak {peak / GiB:.2f} GiB (1 plans)"], out
    assert "activation checkpointing off" in out  # the plan is the chosen levers', not the resolved default's
