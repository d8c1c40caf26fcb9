"""The measured steps of the one-GPU report (``benchmarks/gpu_report.py``): llama-cp's training step
(the trainer's build and step, any memory lever, ``--offload_params`` included) and what one-GPU
users run today, plain transformers + peft with gradient checkpointing and SDPA (and Liger
Kernel's patched Llama where it is installed), timed the same way and counted by one FLOP
formula (Note [Model FLOPs] in llama_cp/model/flops.py).

The step functions return a row (a dict): the losses of the steps, the steady step time (the median
of the steps after the first), the peak of the first step and of the later ones
(``torch.cuda.max_memory_allocated``, reset before each step), tokens/s, model TFLOP/s and MFU.
:func:`attention_kernels` times torch's attention kernels alone.
"""

from __future__ import annotations

import copy
import time
from typing import Any

import torch

from benchmarks.gpu.settings import random_row, set_flags
from benchmarks.gpu.step import LORA, _sync, speed_figures, timed_steps
from llama_cp.config import TrainConfig


def llama_cp_steps(config, context_length: int, flags: dict, *, steps: int, device: torch.device,
                   doc_len: int | None = None, build_on_cpu: bool = False, profile=None) -> dict[str, Any]:
    """``steps`` optimizer steps of llama-cp on one GPU (cp = 1) with the training ``flags``
    (``--use_peft``, the memory levers), built and stepped as the trainer does
    (``llama_cp.model.build.build_model`` for random weights). ``build_on_cpu``: initialise the
    weights on the host, so that rows built on the host and on the device start from the same
    weights. ``profile``: a context manager around the last step (torch.profiler)."""
    import contextlib

    from llama_cp import count_valid_tokens, optimizer_step, parallelize_model, shard_batch
    from llama_cp.fsdp_wrap import restore_buffers
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
        restore_buffers(model, device)  # buffers are not offloaded (build_model does the same)
    optimizer = build_optimizer("adamw", model, lr=1e-5, weight_decay=0.0, on_host=offload)
    row = random_row(config, context_length, doc_len)
    local = {k: v.to(device) for k, v in shard_batch(row, mesh["cp"]).items()}
    num_tokens = count_valid_tokens([local["labels"]])
    done = [0]

    def step() -> torch.Tensor:
        done[0] += 1
        last = profile is not None and done[0] == steps
        with profile if last else contextlib.nullcontext():
            loss, _ = optimizer_step(model, optimizer, [local], num_tokens, max_grad_norm=1.0,
                                     offload=cfg.model.activation_offload)
        return loss

    result = timed_steps(step, steps, device)
    return {**result, **speed_figures(config, context_length, row["position_ids"], lora=cfg.peft.use_peft,
                                      seconds=result["seconds_per_step"], device=device)}


def transformers_steps(config, context_length: int, *, lora: bool, steps: int, device: torch.device,
                       liger: bool = False, profile=None) -> dict[str, Any]:
    """``steps`` optimizer steps of what a one-GPU user runs today: transformers' own Llama with SDPA
    attention and non-reentrant gradient checkpointing, bf16 autocast, torch's fused AdamW and
    clipping at 1.0; LoRA through peft (llama-cp's default adapters) on bf16 weights, full
    fine-tuning on fp32 weights (Trainer's ``bf16=True``). ``liger``: Liger Kernel's patched
    Llama (its RMSNorm, RoPE, SwiGLU and fused linear cross-entropy) first. ``profile``: as
    :func:`llama_cp_steps`'."""
    import contextlib

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
    done = [0]

    def step() -> torch.Tensor:
        done[0] += 1
        with profile if profile is not None and done[0] == steps else contextlib.nullcontext():
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = model(input_ids=ids, labels=ids, use_cache=False).loss  # transformers shifts the labels
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return loss

    result = timed_steps(step, steps, device)
    return {**result, **speed_figures(config, context_length, row["position_ids"], lora=lora,
                                      seconds=result["seconds_per_step"], device=device)}


def attention_kernels(length: int, device: torch.device, reps: int = 3) -> list[dict]:
    """Forward + backward of one causal attention of ``length`` tokens (32 heads, 8 KV heads, 128) by
    each of torch's SDPA backends here (CPU: math), KV heads expanded and with ``enable_gqa``: the
    time of a steady call and, on a GPU, the bytes it allocates at its peak beyond its inputs (its
    output, lse, gradients, the expanded KV heads and the kernel's own workspace)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    g = torch.Generator(device=device).manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    q = torch.randn(1, 32, length, 128, device=device, dtype=dtype, generator=g, requires_grad=True)
    k = torch.randn(1, 8, length, 128, device=device, dtype=dtype, generator=g, requires_grad=True)
    v = torch.randn(1, 8, length, 128, device=device, dtype=dtype, generator=g, requires_grad=True)
    flops = 3.5 * 4 * length * length / 2 * 128 * 32  # forward (2 products) + backward (5), causal half
    backends = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                "efficient": SDPBackend.EFFICIENT_ATTENTION} if device.type == "cuda" else {"math": SDPBackend.MATH}
    rows = []
    for name, backend in backends.items():
        for gqa in ("expanded", "enable_gqa"):
            def work():
                with sdpa_kernel([backend]):
                    if gqa == "expanded":
                        out = F.scaled_dot_product_attention(q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1),
                                                             is_causal=True)
                    else:
                        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
                out.sum().backward()
            try:
                work()  # warm: the time and the peak below are the steady calls'
                _sync(device)
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated() if device.type == "cuda" else 0
                start = time.perf_counter()
                for _ in range(reps):
                    work()
                _sync(device)
                seconds = (time.perf_counter() - start) / reps
                extra = torch.cuda.max_memory_allocated() - base if device.type == "cuda" else None
                rows.append({"kernel": f"sdpa {name}, GQA {gqa}", "ms": seconds * 1e3, "tflops": flops / seconds / 1e12,
                             "peak_extra_bytes": extra})
            except Exception as error:  # noqa: BLE001
                rows.append({"kernel": f"sdpa {name}, GQA {gqa}", "error": str(error).strip().splitlines()[0][:200]})
    return rows


#: The packed-window rows of the kernels part: a chat-like stream of documents (log-normal lengths,
#: median 300 tokens, as benchmarks/document_mask.py's chat mix) under Gemma 3's 1024-token window
#: (both cut to the row's 1/16 and 1/4 in the dry run's short rows).
PACKED_WINDOW, CHAT_MEDIAN = 1024, 300


def packed_window_calls(length: int, device: torch.device, reps: int = 3) -> list[dict]:
    """Forward + backward of llama-cp's attention over one packed row of chat-like documents with a
    sliding window, at cp 1 (32 heads, 8 KV heads, 128): the varlen calls with the window (Note
    [Varlen document calls]) against a call per piece, as llama-cp ran windowed blocks until bd40944;
    their kernel calls, time, and the largest difference of their outputs and gradients. On the CPU (the
    dry run) both run the CPU stand-in of torch's flash kernel."""
    import contextlib
    import math
    from unittest import mock

    from llama_cp.attention import kernels, pieces, varlen
    from llama_cp.attention.documents import DocumentLayout
    from llama_cp.attention.workspace import ModelledBackend
    from llama_cp.parallel.sharding import document_starts

    g = torch.Generator().manual_seed(0)
    window, median = min(PACKED_WINDOW, length // 4), min(CHAT_MEDIAN, length // 16)
    lengths, total = [], 0
    while total < length:
        lengths.append(min(length - total, max(1, round(median * math.exp(float(torch.randn((), generator=g)))))))
        total += lengths[-1]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    block = DocumentLayout(document_starts(positions)).full_row_pieces(window)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    # made on the device: at 64K tokens the host's generator took 8 s of the part's time (2 cores)
    on_device = torch.Generator(device=device).manual_seed(1)
    q = torch.randn(1, 32, length, 128, device=device, dtype=dtype, generator=on_device, requires_grad=True)
    k, v = (torch.randn(1, 8, length, 128, device=device, dtype=dtype, generator=on_device, requires_grad=True)
            for _ in range(2))
    backend = kernels.select_backend(q, varlen=True) if device.type == "cuda" else ModelledBackend("sdpa_flash")
    if backend is None:  # a GPU before sm80, or float32: no varlen kernel runs here
        return [{"kernel": f"llama-cp, {len(lengths)} documents, window {window}", "error": "no varlen backend here"}]
    per_piece = sum(len(varlen.segments(p)) for p in block)
    windows = varlen.varlen_windows(block)
    calls = {"varlen calls": sum(map(len, windows)) if windows else per_piece, "a call per piece": per_piece}
    rows, results = [], {}
    for name in calls:
        path = mock.patch.object(varlen, "varlen_windows", lambda block: None) if name != "varlen calls" else (
            contextlib.nullcontext())

        def work():
            for t in (q, k, v):
                t.grad = None
            out = pieces.pieces_attention(q, k, v, block, scale=128**-0.5, backend=backend)
            out.backward(torch.ones_like(out))
            return out.detach(), *(t.grad for t in (q, k, v))

        label = f"llama-cp {backend}, {len(lengths)} documents, window {window}: {name}"
        try:
            with path:
                results[name] = work()  # warm; its values are the ones compared
                _sync(device)
                start = time.perf_counter()
                for _ in range(reps):
                    work()
                _sync(device)
            seconds = (time.perf_counter() - start) / reps
            rows.append({"kernel": label, "ms": seconds * 1e3, "calls_per_pass": calls[name]})
        except Exception as error:  # noqa: BLE001
            rows.append({"kernel": label, "error": str(error).strip().splitlines()[0][:200]})
    if len(results) == 2:
        rows[0]["max_abs_difference"] = max(float((a.float() - b.float()).abs().max())
                                            for a, b in zip(*results.values(), strict=True))
    return rows
