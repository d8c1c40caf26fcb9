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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a script from anywhere

import torch  # noqa: E402
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--output", default="probe.json")
    parser.add_argument("--dry_run", action="store_true")
    args = parser.parse_args()
    from benchmarks.gpu.one_gpu import attention_kernels, llama_cp_steps, transformers_steps
    from benchmarks.gpu.one_gpu_parts import _device, flags_of, shapes
    from benchmarks.gpu.settings import llama_config

    device = _device()
    shape = shapes(args.dry_run, 4)
    config, length = llama_config(shape["model"]), shape["speed_lens"][-1]
    report: dict = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
                    "length": length}

    def save():
        with open(args.output, "w") as f:
            json.dump(report, f, indent=1)

    report["kernels"] = attention_kernels(length, device)
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
