"""One measured training run on the ranks of a group, what parts 2 to 4 of the GPU acceptance run
are made of: the step time, the per-step peak memory and the throughput figures; the timed loop
(:func:`timed_steps`) and the figures (:func:`speed_figures`) the one-GPU report's runs share."""

from __future__ import annotations

import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from benchmarks.gpu.settings import Settings, llama_config, random_row, set_flags
from llama_cp.config import TrainConfig
from llama_cp.model.flops import attention_pairs, model_flops, peak_flops, throughput


#: The adapters of every LoRA run, llama-cp's defaults (``--lora_r``, ``--lora_alpha``, targets).
LORA = TrainConfig().peft


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed_steps(step: Callable[[], object], steps: int, device: torch.device) -> dict[str, Any]:
    """Run ``step`` (one optimizer step, returning its loss) ``steps`` times: the losses, the
    steady time per step (the median of the steps after the first) and the peaks
    (``PeakMemory``, reset before each step) of the first step and of the later ones."""
    from llama_cp.train.reporting import PeakMemory

    peak = PeakMemory(device.type)
    losses, times, peaks = [], [], []
    for _ in range(steps):
        _sync(device)
        peak.reset()
        start = time.perf_counter()
        losses.append(float(step()))
        _sync(device)
        times.append(time.perf_counter() - start)
        peaks.append(peak.read())
    later = times[1:] or times
    return {"losses": losses, "seconds_per_step": sorted(later)[len(later) // 2], "step_seconds": times,
            "first_step_peak_bytes": peaks[0], "measured_peak_bytes": max(peaks[1:] or peaks)}


def speed_figures(config, context_length: int, position_ids: torch.Tensor, *, lora: bool, seconds: float,
                  device: torch.device, replicas: int = 1, world: int = 1) -> dict[str, float]:
    """tokens/s/GPU, model TFLOP/s/GPU and MFU of a step of ``replicas`` rows of ``context_length``
    tokens (``position_ids`` one row's) on ``world`` GPUs in ``seconds``: one FLOP formula for every
    run (Note [Model FLOPs] in llama_cp/model/flops.py), LoRA with llama-cp's default adapters."""
    flops = model_flops(config, lora_r=LORA.lora_r if lora else 0, lora_targets=LORA.lora_target_modules)
    step_flops = flops.step(context_length, attention_pairs(position_ids)) * replicas
    name = torch.cuda.get_device_name() if device.type == "cuda" else None
    return throughput(tokens=context_length * replicas, flops=step_flops, seconds=seconds, world_size=world,
                      peak=peak_flops(name))


def training_step(s: Settings, *, context_length: int, cp: int, strategy: str = "ring", packed: bool = False,
                  flags: dict | None = None) -> dict[str, Any]:
    """``s.steps`` optimizer steps of the Llama-3-8B-shaped model (bf16 on GPU) at ``context_length``
    on every rank (cp ``cp``, the rest data parallel): the steady step time (median after the
    first), the per-step peak memory, and the throughput figures."""
    from llama_cp import build_causal_lm, count_valid_tokens, optimizer_step, parallelize_model, shard_batch
    from llama_cp.optim.optimizers import build_optimizer

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
    timed = timed_steps(lambda: optimizer_step(model, optimizer, [local], num_tokens, max_grad_norm=1.0)[0],
                        s.steps, device)
    seconds = timed["seconds_per_step"]
    figures = speed_figures(config, context_length, row["position_ids"], lora=cfg.peft.use_peft, seconds=seconds,
                            device=device, replicas=world // cp, world=world)
    worst = torch.tensor([timed["measured_peak_bytes"]], dtype=torch.float64, device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return {"seconds_per_step": seconds, "measured_peak_bytes": int(worst.item()), **figures}

