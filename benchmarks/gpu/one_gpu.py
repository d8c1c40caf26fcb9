"""The measured steps of the one-GPU report (``benchmarks/gpu_report.py``): llama-cp's training step
(the trainer's build and step, any memory lever, ``--offload_params`` included) and what one-GPU
users run today, plain transformers + peft with gradient checkpointing and SDPA (and Liger
Kernel's patched Llama where it is installed), timed the same way and counted by one FLOP
formula (Note [Model FLOPs] in llama_cp/model/flops.py).

Every function returns a row (a dict): the losses of the steps, the steady step time (the median
of the steps after the first), the peak of the first step and of the later ones
(``torch.cuda.max_memory_allocated``, reset before each step), tokens/s, model TFLOP/s and MFU.
"""

from __future__ import annotations

import copy
import time
from typing import Any, Callable

import torch

from benchmarks.gpu.settings import random_row, set_flags
from llama_cp.config import TrainConfig
from llama_cp.model.flops import attention_pairs, model_flops, peak_flops, throughput

#: The adapters of every LoRA row, llama-cp's defaults (``--lora_r``, ``--lora_alpha``, targets).
LORA = TrainConfig().peft


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed_steps(step: Callable[[], float], steps: int, device: torch.device) -> dict[str, Any]:
    """Run ``step`` (one optimizer step, returning its loss) ``steps`` times: the losses, the
    steady time per step and the peaks of the first step and of the later ones."""
    from llama_cp.train.reporting import PeakMemory

    peak = PeakMemory(device.type)
    losses, times, peaks = [], [], []
    for _ in range(steps):
        _sync(device)
        peak.reset()
        start = time.perf_counter()
        losses.append(step())
        _sync(device)
        times.append(time.perf_counter() - start)
        peaks.append(peak.read())
    later = times[1:] or times
    return {"losses": losses, "seconds_per_step": sorted(later)[len(later) // 2], "step_seconds": times,
            "first_step_peak_bytes": peaks[0], "measured_peak_bytes": max(peaks[1:] or peaks)}


def speed_figures(config, context_length: int, row: dict, *, lora: bool, seconds: float,
                  device: torch.device) -> dict[str, float]:
    """tokens/s, model TFLOP/s and MFU of one step of ``row`` (one FLOP formula for every row)."""
    flops = model_flops(config, lora_r=LORA.lora_r if lora else 0, lora_targets=LORA.lora_target_modules)
    step_flops = flops.step(context_length, attention_pairs(row["position_ids"]))
    name = torch.cuda.get_device_name() if device.type == "cuda" else None
    return throughput(tokens=context_length, flops=step_flops, seconds=seconds, world_size=1, peak=peak_flops(name))


def llama_cp_steps(config, context_length: int, flags: dict, *, steps: int, device: torch.device,
                   doc_len: int | None = None, build_on_cpu: bool = False, profile=None) -> dict[str, Any]:
    """``steps`` optimizer steps of llama-cp on one GPU (cp = 1) with the training ``flags``
    (``--use_peft``, the memory levers), built and stepped as the trainer does
    (``llama_cp.model.build.build_model`` for random weights). ``build_on_cpu``: initialise the
    weights on the host, so that rows built on the host and on the device start from the same
    weights. ``profile``: a context manager around the last step (torch.profiler)."""
    import contextlib

    from llama_cp import count_valid_tokens, optimizer_step, parallelize_model, shard_batch
    from llama_cp.fsdp_wrap import _reinit_rotary_buffers
    from llama_cp.modules.causal_lm import build_causal_lm
    from llama_cp.optim.optimizers import build_optimizer

    cfg = TrainConfig()
    cfg.data.context_length, cfg.data.document_mask = context_length, True
    set_flags(cfg, flags)
    mesh = cfg.parallel.dims(1).build_mesh(device.type)
    offload = cfg.model.offload_params
    torch.manual_seed(0)
    model = build_causal_lm(config, device="cpu" if offload or build_on_cpu else device)
    model = model.to("cpu" if offload else device)
    model = parallelize_model(model, cfg, mesh, device_type=device.type)
    if offload:
        _reinit_rotary_buffers(model, device)  # buffers are not offloaded (build_model does the same)
    optimizer = build_optimizer("adamw", model, lr=1e-5, weight_decay=0.0, on_host=offload)
    row = random_row(config, context_length, doc_len)
    local = {k: v.to(device) for k, v in shard_batch(row, mesh["cp"]).items()}
    num_tokens = count_valid_tokens([local["labels"]])
    done = [0]

    def step() -> float:
        done[0] += 1
        last = profile is not None and done[0] == steps
        with profile if last else contextlib.nullcontext():
            loss, _ = optimizer_step(model, optimizer, [local], num_tokens, max_grad_norm=1.0,
                                     offload=cfg.model.activation_offload)
        return float(loss)

    result = timed_steps(step, steps, device)
    return {**result, **speed_figures(config, context_length, row, lora=cfg.peft.use_peft,
                                      seconds=result["seconds_per_step"], device=device)}


def transformers_steps(config, context_length: int, *, lora: bool, steps: int, device: torch.device,
                       liger: bool = False) -> dict[str, Any]:
    """``steps`` optimizer steps of what a one-GPU user runs today: transformers' own Llama with SDPA
    attention and non-reentrant gradient checkpointing, bf16 autocast, torch's fused AdamW and
    clipping at 1.0; LoRA through peft (llama-cp's default adapters) on bf16 weights, full
    fine-tuning on fp32 weights (Trainer's ``bf16=True``). ``liger``: Liger Kernel's patched
    Llama (its RMSNorm, RoPE, SwiGLU and fused linear cross-entropy) first."""
    from transformers import AutoModelForCausalLM

    if liger:
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        apply_liger_kernel_to_llama()
    config = copy.deepcopy(config)
    config.use_cache = False
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa",
                                                 dtype=torch.bfloat16 if lora else torch.float32)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=LORA.lora_r, lora_alpha=LORA.lora_alpha, lora_dropout=0.0,
                                                 target_modules=list(LORA.lora_target_modules)))
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-5, weight_decay=0.0, **({"fused": True} if device.type == "cuda" else {}))
    row = random_row(config, context_length, None)
    ids = row["input_ids"].to(device)

    def step() -> float:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss  # transformers shifts the labels
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss)

    result = timed_steps(step, steps, device)
    return {**result, **speed_figures(config, context_length, row, lora=lora, seconds=result["seconds_per_step"],
                                      device=device)}
