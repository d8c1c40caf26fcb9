"""FSDP memory regression tests: the planned per-rank peak of a mid-size Llama over the
matrix of ``memory_matrix.py``, against the baselines kept in ``baselines.json``, plus
scaling rules that hold whatever the baselines say. Everything runs under fake tensors
in this process (no memory is allocated, no other process is started)."""

from __future__ import annotations

import dataclasses
import functools
import math

import pytest
import torch

from dist_harness import map_in_processes
from llama_cp.config import TrainConfig
from llama_cp.plan.memory import step_peak
from llama_cp.plan.simulate import plan_step_memory, simulate_step_memory, simulate_step_phases
from memory_matrix import CASES, case_config, case_name, load_baselines, mid_size_config, once_per_arguments, run_case

MiB = 1 << 20
TOLERANCE = 0.02  # a category more than 2% above its baseline fails
#: A category more than 10% *below* its baseline fails too: a plan that suddenly needs much
#: less usually stopped counting something (a tensor no longer tracked, a phase skipped); an
#: intended saving refreshes the baselines and says why in the commit.
DROP_TOLERANCE = 0.10


@pytest.fixture(scope="module")
def phases():
    return dict(zip(CASES, map_in_processes(run_case, list(CASES)), strict=True))


@pytest.fixture(scope="module")
def planned(phases):
    return {name: step_peak(by_phase) for name, by_phase in phases.items()}


def regressions(now: dict[str, int], before: dict[str, int]) -> tuple[list[str], list[str]]:
    """The categories more than TOLERANCE above, and more than DROP_TOLERANCE below, their
    baselines (1 KiB of slack either way)."""
    worse = [key for key in now if now[key] > before[key] * (1 + TOLERANCE) + 1024]
    dropped = [key for key in now if now[key] + 1024 < before[key] * (1 - DROP_TOLERANCE)]
    return worse, dropped


def test_growth_and_large_drops_are_both_flagged():
    before = {"parameters": 100 * MiB, "activations": 100 * MiB, "temporary": 100 * MiB}
    now = {"parameters": 103 * MiB, "activations": 85 * MiB, "temporary": 95 * MiB}
    assert regressions(now, before) == (["parameters"], ["activations"])


@pytest.mark.parametrize("name", list(CASES))
def test_matches_baseline(planned, name):
    baselines = load_baselines()
    assert name in baselines, f"no baseline for {name}: run `python tests/plan/memory_matrix.py`"
    now, before = planned[name].to_dict(), baselines[name]
    worse, dropped = regressions(now, before)
    if worse or dropped:
        def flag(key):
            return "   <-- over" if key in worse else "   <-- dropped" if key in dropped else ""

        rows = "\n".join(
            f"  {key:<14} baseline {before[key] / MiB:9.2f} MiB   now {now[key] / MiB:9.2f} MiB   "
            f"{(now[key] - before[key]) / max(before[key], 1):+.1%}{flag(key)}"
            for key in now
        )
        pytest.fail(
            f"{name}: per-rank peak memory grew more than {TOLERANCE:.0%} or fell more than {DROP_TOLERANCE:.0%} "
            f"(is something no longer counted?):\n{rows}\n"
            "If intended, refresh with `python tests/plan/memory_matrix.py` and say why in the commit."
        )


def activation_bytes(result) -> int:
    """Everything at the peak that is not parameters, gradients, optimizer state or FSDP's
    communication buffers: saved activations plus backward temporaries. Which of the two a
    tensor counts as depends on where the peak falls (the loss's forward or its backward),
    so only their sum is a fair measure across layouts."""
    return result.activations + result.temporary


def fixed_activation_bytes(tuning: str) -> int:
    """The part of the activation peak that context parallelism cannot split: a full fine-tune's
    float32 accumulator of the lm_head gradient (vocab x hidden x 4 bytes, a temporary of the
    chunked loss's backward, independent of the tokens), plus 1 MiB of small per-step tensors."""
    config = mid_size_config()
    head_gradient = config.vocab_size * config.hidden_size * 4 if tuning == "full" else 0
    return head_gradient + MiB


@pytest.mark.parametrize("cp", [2, 4])
def test_activations_split_by_cp(planned, cp):
    checked = 0
    for name, (case_cp, dp_shard, tuning, checkpointing, seq_len) in CASES.items():
        if case_cp != cp:
            continue
        reference = planned[case_name(1, dp_shard, tuning, checkpointing, seq_len)]
        bound = 1.1 * activation_bytes(reference) / cp + fixed_activation_bytes(tuning)
        got = activation_bytes(planned[name])
        assert got <= bound, f"{name}: {got / MiB:.2f} MiB > 1.1 x cp1 / {cp} + fixed = {bound / MiB:.2f} MiB"
        checked += 1
    assert checked == 16


@functools.lru_cache(maxsize=None)
def _meta_model(tuning: str):
    """The matrix's model on the meta device (LoRA-wrapped for "lora"): built once per tuning, as
    its parameters do not depend on the world size."""
    cfg = case_config(1, 1, tuning, False, 2048)
    with torch.device("meta"):
        from transformers import LlamaForCausalLM

        model = LlamaForCausalLM(mid_size_config())
        if tuning == "lora":
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(model, LoraConfig(
                r=cfg.peft.lora_r, lora_alpha=cfg.peft.lora_alpha,
                target_modules=list(cfg.peft.lora_target_modules), task_type="CAUSAL_LM",
            ))
    return model


def _shard_bytes(tuning: str, world: int) -> tuple[int, int, int]:
    """(all parameters, trainable parameters, the largest of the optimizer's param groups) bytes of
    rank 0's FSDP shards: fp32 storage, except LoRA's frozen weights, stored in bf16
    (``--frozen_dtype auto`` with bf16 compute, as in the matrix); dim 0 of every tensor is split in
    ``world`` pieces of ceil(dim0 / world) rows (rank 0 is never short)."""
    from llama_cp.optim.optimizers import parameter_groups

    model = _meta_model(tuning)
    everything = trainable = 0
    shard = {}
    for param in model.parameters():
        rows = math.ceil(param.shape[0] / world)
        shard[param] = nbytes = rows * (param.numel() // param.shape[0]) * (4 if param.requires_grad else 2)
        everything += nbytes
        trainable += nbytes if param.requires_grad else 0
    largest = max(sum(shard[p] for p in group["params"]) for group in parameter_groups(model, 0.0))
    return everything, trainable, largest


@pytest.mark.parametrize("tuning", ["full", "lora"])
def test_state_is_sharded_over_dp_shard_x_cp(phases, tuning):
    for name, (cp, dp_shard, case_tuning, checkpointing, seq_len) in CASES.items():
        if case_tuning != tuning:
            continue
        world = cp * dp_shard
        params, trainable, largest_group = _shard_bytes(tuning, world)
        # in the optimizer phase every gradient exists, reduce-scattered to its shard
        optimizer_phase = phases[name]["optimizer"]
        assert optimizer_phase.tracked["Sharded Param"] == params, name
        assert optimizer_phase.tracked["Sharded Grad"] == trainable, name
        # AdamW's state: exp_avg and exp_avg_sq shaped like the shard, plus a 4-byte step counter
        # per tensor (seen in forward+backward; during the step its temporaries count as well)
        tensors = 3 * 9 + 3 if tuning == "full" else 3 * 4 * 2
        assert phases[name]["forward_backward"].optimizer == 2 * trainable + 4 * tensors, name
        # at the step's peak the GPU's foreach AdamW (Note [AdamW's implementation, pinned]) also holds
        # sqrt(exp_avg_sq) of every trainable shard of one param group at once, fp32 (FSDPMemTracker
        # counts what the step allocates as optimizer state); the groups are stepped one after the other
        assert optimizer_phase.optimizer >= 2 * trainable + largest_group, (name, optimizer_phase.optimizer, trainable)


def test_layer_extrapolation_is_exact(phases, monkeypatch):
    """Note [Planning from a few layers]: 3 and 4 simulated layers predict 6 layers exactly.

    Each case of the matrix's list is a case of the matrix, whose 3-layer simulation ``phases``
    already holds: the planner's 3-layer simulation of the same configuration (equal TrainConfig,
    equal model config, same world size) is that one, reused; the 4- and 6-layer ones run here.
    The last case has its backward's peak in a middle layer (1024 tokens, MLP/norm tiles, offloaded
    checkpoints and parameters), which 2 and 3 layers overstated by one layer's gradient buffer
    per extrapolated layer."""
    import llama_cp.plan.simulate as simulate

    matrix = [((case_config(*case), case[0] * case[1]), {"model_config": mid_size_config()}, phases[name])
              for name, case in CASES.items()]
    simulated = once_per_arguments(monkeypatch, simulate, "simulate_step_phases", known=matrix)
    middle_peak = dataclasses.replace(case_config(2, 1, "full", True, 1024), model=dataclasses.replace(
        case_config(2, 1, "full", True, 1024).model, mlp_tile_size=1024, norm_tile_size=1024, loss_chunk_size=256,
        offload_checkpoints=True, offload_params=True))
    cases = [(case_config(*case), case[0] * case[1]) for case in
             [(2, 1, "lora", True, 2048), (1, 2, "full", False, 2048), (4, 2, "full", True, 4096)]]
    for cfg, world in [*cases, (middle_peak, 2)]:
        # a fresh model config per case, as each matrix case has (the planner's model build sets
        # its attention implementation and dtype fields on the config it is given)
        config = mid_size_config(num_hidden_layers=6)
        assert plan_step_memory(cfg, world, model_config=config) == simulate_step_memory(
            cfg, world, model_config=config
        ), cfg
    # per matrix case a 4-layer simulation (the planner's) and a 6-layer one (the check's): the
    # planner's 3-layer one was the matrix's; the last case simulates all three
    computed = [kwargs["model_config"].num_hidden_layers for _, kwargs, _ in simulated[len(matrix):]]
    assert computed == [4, 6] * 3 + [3, 4, 6], computed


def test_each_lever_cuts_the_planned_peak():
    """The long-context levers against the same LoRA + checkpointing plan without them (bf16
    compute, 2048 tokens, one rank, loss chunks small enough that a layer's backward is the
    peak): each cuts the peak by what it is for. (bf16 frozen weights: the exact shard sizes
    of test_state_is_sharded_over_dp_shard_x_cp.)"""
    from memory_matrix import MID_SIZE

    tokens, hidden, layers = 2048, MID_SIZE["hidden_size"], MID_SIZE["num_hidden_layers"]

    def plan(**flags):
        cfg = TrainConfig.from_flags(context_length=tokens, use_peft=True, activation_checkpointing=True,
                                     dtype="bfloat16", loss_chunk_size=256, attention_backend="sdpa_cpu", **flags)
        return step_peak(simulate_step_phases(cfg, 1, model_config=mid_size_config()))

    base = plan()
    # checkpoint inputs in host memory: all but the two on the device (the one recomputed and
    # the one prefetched) leave the device at the backward peak
    offload = plan(offload_checkpoints=True)
    per_layer = tokens * hidden * 2
    assert base.host == 0 and offload.host == layers * per_layer
    assert base.total - offload.total >= (layers - 2) * per_layer
    # tiled MLP and norms: the MLP intermediates (gate, up, their product: 3 x 1536 bf16 per
    # token) and the fp32 norm intermediates (several x 4 bytes x hidden per token) go
    tiled = plan(mlp_tile_size=512, norm_tile_size=512)
    intermediates = tokens * MID_SIZE["intermediate_size"] * 2
    assert base.total - tiled.total >= 2 * intermediates + 2 * tokens * hidden * 4
