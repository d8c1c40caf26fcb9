"""The planner against real runs: the planned per-rank peak (fake tensors, one process, the
4-layer embedded model, simulated whole) equals the peak tracked in real
2-rank gloo runs of the same configurations within 5%.

The plans are made before the ranks start, in two processes of their own (the planner needs
torch.distributed uninitialised), and handed to the ranks through a JSON file named in an
environment variable.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist

from dist_harness import Checks, map_in_processes
from llama_cp.config import TrainConfig
from llama_cp.modules.causal_lm import embedded_llama_config
from llama_cp.modules.quantize import installed_qlora_refusal
from llama_cp.plan.memory import create_optimizer_state, measure_step_memory, step_peak
from llama_cp.plan.simulate import plan_step_memory

WORLD_SIZE = 2
PLANS_ENV = "LLAMA_CP_TEST_MEMORY_PLANS"
CASES = {
    "cp2-ring-full": dict(cp=2, cp_strategy="ring"),
    "cp2-ulysses-lora-ckpt": dict(cp=2, cp_strategy="ulysses", use_peft=True, activation_checkpointing=True),
    "dp_shard2-full-ckpt": dict(dp_shard=2, activation_checkpointing=True),
    # QLoRA: the NF4 codes sharded, each Linear's weight dequantized in forward and backward
    "cp2-ring-qlora": dict(cp=2, cp_strategy="ring", use_peft=True, quantization="4bit"),
    "dp_shard2-qlora-ckpt": dict(dp_shard=2, use_peft=True, quantization="4bit", activation_checkpointing=True),
    # the long-context levers (llama_cp/config.py): each one, then all with gradient accumulation
    "cp2-lora-ckpt-frozen_bf16-offload": dict(cp=2, use_peft=True, activation_checkpointing=True,
                                              frozen_dtype="bfloat16", offload_checkpoints=True),
    "dp_shard2-full-ckpt-tiled": dict(dp_shard=2, activation_checkpointing=True, mlp_tile_size=256,
                                      norm_tile_size=256),
    # a DPO step: LoRA's reference pass (adapters off, no gradient), then the pairs' forward and backward
    "cp2-lora-dpo-ckpt": dict(cp=2, use_peft=True, objective="dpo", activation_checkpointing=True),
    "cp2-lora-all_levers-accum2": dict(
        cp=2, use_peft=True, lora_target_modules="q_proj,v_proj,gate_proj,down_proj", activation_checkpointing=True,
        frozen_dtype="bfloat16", offload_checkpoints=True, mlp_tile_size=256, norm_tile_size=256,
        loss_chunk_size=0, gradient_accumulation_steps=2, context_length=1024,
    ),
}


def case_config(name: str) -> TrainConfig:
    # the real runs are on CPU, so the plan models the CPU attention kernel they run
    return TrainConfig.from_flags(**{"context_length": 2048, "dtype": "float32", "attention_backend": "sdpa_cpu",
                                     **CASES[name]})


def plan_case(name: str) -> tuple[int, int]:
    """The planned peak and host bytes of the busiest rank of the case."""
    plan = plan_step_memory(case_config(name), WORLD_SIZE, model_config=embedded_llama_config())
    return plan.total, plan.host


def measure_real_peak(name: str) -> int:
    """Tracked peak of the busiest rank in one real optimizer step of the case (every rank calls this)."""
    from transformers import LlamaForCausalLM

    from llama_cp.model.build import parallelize_model
    from llama_cp.optim.optimizers import build_optimizer
    from llama_cp.parallel.sharding import shard_batch

    cfg = case_config(name)
    p = cfg.parallel
    mesh = p.dims().build_mesh("cpu")
    torch.manual_seed(0)
    model = parallelize_model(LlamaForCausalLM(embedded_llama_config()), cfg, mesh)
    optimizer = build_optimizer("adamw", model, lr=1e-4, weight_decay=0.0)  # the trainer's groups
    create_optimizer_state(model, optimizer, max_grad_norm=cfg.optim.max_grad_norm)
    generator = torch.Generator().manual_seed(dist.get_rank())
    micro, preference = [], None
    for _ in range(cfg.optim.gradient_accumulation_steps):
        ids = torch.randint(0, 256, (1, cfg.data.context_length), generator=generator)
        batch = {"input_ids": ids, "labels": ids.clone()}
        if cfg.objective == "dpo":  # one pair: the row's first half chosen, its second half rejected
            half = cfg.data.context_length // 2
            batch["position_ids"] = (torch.arange(cfg.data.context_length) % half)[None]
            batch["labels"][:, half - 1::half] = -100  # no label crosses into the other sequence
            batch["sequence_ids"] = torch.where(batch["labels"] != -100, torch.arange(cfg.data.context_length) // half, -1)
            batch["sequence_lengths"] = (batch["sequence_ids"][0, :, None] == torch.arange(2)).sum(0)
            preference = dict(kind=cfg.dpo_loss, beta=cfg.dpo_beta, gamma=cfg.simpo_gamma, cp_group=mesh["cp"],
                              num_pairs=mesh["dp"].size() * cfg.optim.gradient_accumulation_steps)
        micro.append(shard_batch(batch, mesh["cp"]))
    num_tokens = cfg.data.context_length * mesh["dp"].size() * len(micro)
    peak = step_peak(measure_step_memory(model, optimizer, micro, num_tokens, max_grad_norm=cfg.optim.max_grad_norm,
                                         preference=preference))
    total = torch.tensor([peak.total, peak.host], dtype=torch.float64)
    dist.all_reduce(total, op=dist.ReduceOp.MAX)
    return int(total[0].item()), int(total[1].item())


checks = Checks()


def _add_case(name: str) -> None:
    def check() -> None:
        with open(os.environ[PLANS_ENV]) as f:
            planned, planned_host = json.load(f)[name]
        real, real_host = measure_real_peak(name)
        print(f"{name}: planned {planned} B, measured {real} B ({(planned - real) / real:+.2%}); "
              f"host: planned {planned_host} B, measured {real_host} B")
        assert abs(planned - real) <= 0.05 * real, f"{name}: planned {planned} B, measured {real} B"
        # offloaded checkpoint inputs: exactly the bytes the real run kept in host memory
        assert planned_host == real_host and (real_host > 0) == CASES[name].get("offload_checkpoints", False), name

    # QLoRA cases need what Note [QLoRA's version floor] (llama_cp/modules/quantize.py) asks of torch and bitsandbytes
    checks.add(check, name, skip=installed_qlora_refusal() if CASES[name].get("quantization") else None)


for _name in CASES:
    _add_case(_name)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    path = tmp_path_factory.mktemp("memory_plans") / "plans.json"
    names = checks.to_run  # the cases the ranks will run: selected (tests/conftest.py), not skipped
    plans = dict(zip(names, map_in_processes(plan_case, names), strict=True))
    path.write_text(json.dumps(plans))
    os.environ[PLANS_ENV] = str(path)  # spawned ranks inherit the environment
    try:
        return checks.run(__name__, WORLD_SIZE)
    finally:
        del os.environ[PLANS_ENV]


@pytest.mark.parametrize("name", checks.names)
def test_planned_peak_matches_real_run(results, name):
    checks.assert_passed(results, name)
