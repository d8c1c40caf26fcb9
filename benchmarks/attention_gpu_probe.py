"""Where llama-cp's one-GPU step loses to transformers + peft (docs/gpu_report/): the attention kernels
torch offers for a Llama-3-8B layer's causal attention (SDPA's flash, cuDNN and efficient backends,
with GQA expanded and with ``enable_gqa``), the ops transformers' own step calls, and llama-cp's
step with and without ``--attention_block_size``, side by side on the same GPU.

    python benchmarks/attention_gpu_probe.py --output probe.json             # one CUDA GPU, ~1 minute
    python benchmarks/attention_gpu_probe.py --dry_run --output probe.json   # CPU, tiny shapes
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a script from anywhere

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402


class OpNames(TorchDispatchMode):
    """The names of the attention ops that run under it."""

    def __init__(self):
        super().__init__()
        self.names: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.name()
        if "attention" in name or "flash" in name or "cudnn" in name:
            self.names[name] = self.names.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def _time(work, device: torch.device, reps: int = 3) -> float:
    work()
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        work()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / reps


def kernels(length: int, device: torch.device) -> list[dict]:
    """Forward + backward of one causal attention of ``length`` tokens (32 heads, 8 KV heads, 128): the
    time, and on a GPU the bytes a call allocates at its peak beyond its inputs (its output, lse,
    gradients, the expanded KV heads and the kernel's own workspace)."""
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
                work()  # warm: the peak below is the steady call's
                if device.type == "cuda":
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated() if device.type == "cuda" else 0
                seconds = _time(work, device)
                extra = torch.cuda.max_memory_allocated() - base if device.type == "cuda" else None
                rows.append({"kernel": f"sdpa {name}, GQA {gqa}", "ms": seconds * 1e3, "tflops": flops / seconds / 1e12,
                             "peak_extra_bytes": extra})
            except Exception as error:  # noqa: BLE001
                rows.append({"kernel": f"sdpa {name}, GQA {gqa}", "error": str(error).strip().splitlines()[0][:200]})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--output", default="probe.json")
    parser.add_argument("--dry_run", action="store_true")
    args = parser.parse_args()
    from benchmarks.gpu.one_gpu import llama_cp_steps, transformers_steps
    from benchmarks.gpu.one_gpu_parts import _config, _device, flags_of, shapes

    device = _device()
    shape = shapes(args.dry_run, 4)
    config, length = _config(shape["model"]), shape["speed_lens"][-1]
    report: dict = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
                    "length": length}

    def save():
        with open(args.output, "w") as f:
            json.dump(report, f, indent=1)

    report["kernels"] = kernels(length, device)
    save()
    names = OpNames()
    with names:
        transformers_steps(config, length, lora=True, steps=1, device=device)
    report["transformers_attention_ops"] = names.names
    save()
    gc.collect()  # peft's wrappers hold the model in reference cycles: gone before the next peak
    torch.cuda.empty_cache() if device.type == "cuda" else None
    for block in (16384, 0):
        flags = {**flags_of("lora", "checkpointing"), "attention_block_size": block}
        names = OpNames()
        with names:
            llama_cp_steps(config, length, flags, steps=1, device=device)
        row = llama_cp_steps(config, length, flags, steps=3, device=device)
        report[f"llama_cp_block_{block}"] = {"ops": names.names, **{k: row[k] for k in (
            "seconds_per_step", "step_seconds", "measured_peak_bytes", "model_tflops_per_gpu", "losses")}}
        save()
        gc.collect()
    print(json.dumps(report, indent=1))
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
