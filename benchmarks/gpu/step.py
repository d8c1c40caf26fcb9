"""One measured training run on the ranks of a group, what parts 2 to 4 of the GPU acceptance run
are made of: the step time, the per-step peak memory and the throughput figures."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.gpu.settings import Settings, llama_config, random_row, set_flags
from llama_cp.config import TrainConfig
from llama_cp.model.flops import attention_pairs, model_flops, peak_flops, throughput


def _sync(device_type: str) -> None:
    if device_type == "cuda":
        torch.cuda.synchronize()


def training_step(s: Settings, *, context_length: int, cp: int, strategy: str = "ring", packed: bool = False,
                  flags: dict | None = None) -> dict[str, Any]:
    """``s.steps`` optimizer steps of the Llama-3-8B-shaped model (bf16 on GPU) at ``context_length``
    on every rank (cp ``cp``, the rest data parallel): the steady step time (median after the
    first), the per-step peak memory, and the throughput figures."""
    from llama_cp import build_causal_lm, count_valid_tokens, optimizer_step, parallelize_model, shard_batch
    from llama_cp.optim.optimizers import build_optimizer
    from llama_cp.train.reporting import PeakMemory

    world = dist.get_world_size()
    cfg = TrainConfig()
    cfg.data.context_length, cfg.data.document_mask = context_length, True
    cfg.parallel.cp, cfg.parallel.dp_shard, cfg.parallel.cp_strategy = cp, world // cp, strategy
    set_flags(cfg, flags or {})
    config = llama_config(s.model)
    mesh = cfg.parallel.dims(world).build_mesh(s.device_type)
    device = torch.device(s.device_type, torch.cuda.current_device() if s.device_type == "cuda" else 0)
    torch.manual_seed(0)
    model = parallelize_model(build_causal_lm(config, device=device), cfg, mesh)
    optimizer = build_optimizer("adamw", [p for p in model.parameters() if p.requires_grad], lr=1e-5, weight_decay=0.0)
    dp_rank = mesh["dp_shard"].get_local_rank()
    row = random_row(config, context_length, s.doc_len if packed else None, seed=dp_rank)
    local = {k: v.to(device) for k, v in shard_batch(row, mesh["cp"]).items()}
    num_tokens = count_valid_tokens([local["labels"]])
    peak = PeakMemory(s.device_type)
    times, peaks = [], []
    for _ in range(s.steps):
        _sync(s.device_type)
        peak.reset()
        start = time.perf_counter()
        optimizer_step(model, optimizer, [local], num_tokens, max_grad_norm=1.0)
        _sync(s.device_type)
        times.append(time.perf_counter() - start)
        peaks.append(peak.read())
    seconds = sorted(times[1:] or times)[len(times[1:] or times) // 2]
    p = cfg.peft
    flops = model_flops(config, lora_r=p.lora_r if p.use_peft else 0, lora_targets=p.lora_target_modules)
    step_flops = flops.step(context_length, attention_pairs(row["position_ids"])) * (world // cp)
    name = torch.cuda.get_device_name() if s.device_type == "cuda" else None
    figures = throughput(tokens=context_length * (world // cp), flops=step_flops, seconds=seconds,
                         world_size=world, peak=peak_flops(name))
    worst = torch.tensor([max(peaks[1:] or peaks)], dtype=torch.float64, device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return {"seconds_per_step": seconds, "measured_peak_bytes": int(worst.item()), **figures}

