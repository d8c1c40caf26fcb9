"""The planner against real runs: the planned per-rank peak (fake tensors, one process, the
4-layer embedded model extrapolated from 2 and 3 layers) equals the peak tracked in real
2-rank gloo runs of the same configurations within 5%."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from llama_cp.config import TrainConfig
from llama_cp.memory import create_optimizer_state, measure_step_memory, plan_step_memory, step_peak
from llama_cp.mesh import ParallelDims, free_port
from llama_cp.models import embedded_llama_config

WORLD_SIZE = 2
CASES = {
    "cp2-ring-full": dict(cp=2, cp_strategy="ring"),
    "cp2-ulysses-lora-ckpt": dict(cp=2, cp_strategy="ulysses", use_peft=True, activation_checkpointing=True),
    "dp_shard2-full-ckpt": dict(dp_shard=2, activation_checkpointing=True),
}


def case_config(name: str) -> TrainConfig:
    return TrainConfig.from_flags(context_length=2048, dtype="float32", **CASES[name])


def _worker(rank: int, port: int, out_dir: str) -> None:
    from transformers import LlamaForCausalLM

    from llama_cp.optim import build_optimizer
    from llama_cp.sharding import shard_batch
    from llama_cp.trainer import parallelize_model

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE)
    measured = {}
    for name in CASES:
        cfg = case_config(name)
        p = cfg.parallel
        mesh = ParallelDims(dp_replicate=p.dp_replicate, dp_shard=p.dp_shard, cp=p.cp).build_mesh("cpu")
        torch.manual_seed(0)
        model = parallelize_model(LlamaForCausalLM(embedded_llama_config()), cfg, mesh, param_dtype=None)
        optimizer = build_optimizer("adamw", model.parameters(), lr=1e-4, weight_decay=0.0)
        create_optimizer_state(model, optimizer, max_grad_norm=cfg.optim.max_grad_norm)
        ids = torch.randint(0, 256, (1, cfg.data.context_length), generator=torch.Generator().manual_seed(rank))
        batch = shard_batch({"input_ids": ids, "labels": ids.clone()}, mesh["cp"])
        num_tokens = cfg.data.context_length * mesh["dp"].size()
        peak = step_peak(measure_step_memory(model, optimizer, [batch], num_tokens, max_grad_norm=1.0))
        totals = [None] * WORLD_SIZE
        dist.all_gather_object(totals, peak.total)
        measured[name] = max(totals)
    if rank == 0:
        with open(os.path.join(out_dir, "measured.json"), "w") as f:
            json.dump(measured, f)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    out_dir = str(tmp_path_factory.mktemp("memory_validation"))
    mp.start_processes(_worker, args=(free_port(), out_dir), nprocs=WORLD_SIZE, start_method="spawn")
    with open(os.path.join(out_dir, "measured.json")) as f:
        return json.load(f)


@pytest.mark.parametrize("name", list(CASES))
def test_planned_peak_matches_real_run(measured, name):
    planned = plan_step_memory(case_config(name), WORLD_SIZE, model_config=embedded_llama_config())
    real = measured[name]
    print(f"{name}: planned {planned.total} B, measured {real} B ({(planned.total - real) / real:+.2%})")
    assert abs(planned.total - real) <= 0.05 * real, f"{name}: planned {planned.total} B, measured {real} B"
