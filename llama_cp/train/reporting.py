"""Where a run's metrics go besides ``metrics.jsonl`` (TensorBoard and Weights & Biases), the
peak memory a metrics row carries (:class:`PeakMemory`), and the run's throughput line.

    reporter = Reporter(output_dir, ("tensorboard",), run_info=run_info(cfg), start_step=0)
    reporter.log({"loss": 2.3, "lr": 1e-4}, step=1)
    reporter.close()

Only rank 0 reports. ``metrics.jsonl`` stays the record the trainer itself reads
(resume, ``loss.png``); the reporters mirror its rows:

- ``tensorboard``: event files in ``output_dir/tensorboard`` (``tensorboard --logdir``).
  A resumed run purges the events after the step it resumed from, as it rewrites
  the metrics rows, so a crash and resume shows one curve, not two.
- ``wandb``: ``wandb.init`` with the resolved config and versions; the run id is kept in
  ``output_dir/wandb_run_id`` so that ``--resume`` continues the same W&B run.

Every numeric value of a row is a scalar (``train/loss``, ``eval/eval_loss``, ...; the
throughput of Note [Model FLOPs], ``train/tokens_per_sec_per_gpu``, ``train/model_tflops_per_gpu``
and ``train/mfu``, among them);
the resolved config and the versions go in as text (TensorBoard) or config (W&B).
"""

from __future__ import annotations

import json
import os
import platform
import resource
from collections.abc import Sequence
from typing import Any

import torch

from llama_cp.config import REPORTERS
from llama_cp.model.flops import throughput

TENSORBOARD_DIR = "tensorboard"
WANDB_ID_FILE = "wandb_run_id"


def run_info(config: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """The resolved config and the versions that produced a run (logged with it)."""
    from importlib.metadata import PackageNotFoundError, version

    import transformers

    def installed(distribution: str) -> str:  # read from its metadata: importing peft costs ~1 s of a start-up
        try:
            return version(distribution)
        except PackageNotFoundError:  # llama-cp run from a checkout that was never pip-installed
            return "unknown"

    versions = {
        "llama_cp": installed("llama-cp"), "torch": torch.__version__, "transformers": transformers.__version__,
        "peft": installed("peft"), "python": platform.python_version(),
        "cuda": torch.version.cuda, "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
    }
    return {"config": config, "versions": versions, **extra}


class Reporter:
    """Mirrors metrics rows to TensorBoard / W&B (rank 0 only; a no-op elsewhere)."""

    def __init__(
        self, output_dir: str, report_to: Sequence[str], *, run_info: dict[str, Any], start_step: int = 0,
        enabled: bool = True,
    ):
        self.writer = None
        self.wandb_run = None
        if not enabled:
            return
        if "tensorboard" in report_to:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step: events of an earlier attempt after the resumed step are dropped
            self.writer = SummaryWriter(
                os.path.join(output_dir, TENSORBOARD_DIR), purge_step=start_step + 1 if start_step else None
            )
            self.writer.add_text("run_info", "```\n" + json.dumps(run_info, indent=1, default=str) + "\n```", 0)
        if "wandb" in report_to:
            import wandb

            id_file = os.path.join(output_dir, WANDB_ID_FILE)
            run_id = open(id_file).read().strip() if start_step and os.path.exists(id_file) else None
            self.wandb_run = wandb.init(
                project=os.environ.get("WANDB_PROJECT", "llama-cp"), dir=output_dir, id=run_id,
                resume="allow" if run_id else None, config=run_info,
            )
            with open(id_file, "w") as f:
                f.write(self.wandb_run.id)

    def log(self, row: dict[str, Any], step: int) -> None:
        scalars = {_tag(k): float(v) for k, v in row.items() if k != "step" and isinstance(v, (int, float))}
        if self.writer is not None:
            for tag, value in scalars.items():
                self.writer.add_scalar(tag, value, step)
            self.writer.flush()
        if self.wandb_run is not None:
            self.wandb_run.log(scalars, step=step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        if self.wandb_run is not None:
            self.wandb_run.finish()
            self.wandb_run = None


def _tag(key: str) -> str:
    """``eval/...`` for eval metrics, ``train/...`` for the rest."""
    return f"eval/{key}" if key.startswith(("eval_", "passkey")) else f"train/{key}"


# Note [Peak memory in metrics]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Start-up (building and loading the model, rank 0 quantizing a QLoRA checkpoint, the
# optimizer, a resume) is reported once, as ``load_peak_memory_bytes`` in run_info.json
# (and in TensorBoard's / W&B's copy of it). Each training step starts a new window: the
# peak is reset before the step and read after it, and a metrics row's
# ``peak_memory_bytes`` is the largest step peak since the previous row that carries one
# (log_every > 1 covers several steps); eval and checkpoint saving fall between windows.
# Both are the maximum over ranks. What a peak is depends on the device:
#
#   cuda  torch.cuda.max_memory_allocated (tensors only, not the allocator's cache),
#         reset by torch.cuda.reset_peak_memory_stats
#   cpu   the process's peak resident set (VmHWM in /proc/self/status), reset by writing
#         5 to /proc/self/clear_refs (Linux >= 4.0); it counts the weights and everything
#         else resident during the step. Where that file cannot be written (not Linux, a
#         locked-down sandbox) it is the peak since the process started, as getrusage says.


class PeakMemory:
    """This process's peak memory since :meth:`reset` (Note [Peak memory in metrics])."""

    def __init__(self, device_type: str):
        self.device_type = device_type

    def reset(self) -> None:
        if self.device_type == "cuda":
            torch.cuda.reset_peak_memory_stats()
            return
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:  # not Linux, or not allowed: the peak stays the process's
            pass

    def read(self) -> int:
        if self.device_type == "cuda":
            return torch.cuda.max_memory_allocated()
        try:
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1]) * 1024  # kB
        except OSError:
            pass
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def throughput_line(run_totals: list[tuple[float, int, float]], world_size: int, peak: float | None) -> str | None:
    """The run's summary line: tokens/s/GPU, model TFLOP/s/GPU and MFU (with a ``peak``) over the
    steps' (seconds, tokens, model FLOPs) in ``run_totals``, the first left out when there are more
    (it warms up kernels and the allocator); None for a run of no step."""
    steps = run_totals[1:] or run_totals
    if not steps:
        return None
    seconds, tokens, flops = (sum(column) for column in zip(*steps))
    summary = throughput(tokens=tokens, flops=flops, seconds=seconds, world_size=world_size, peak=peak)
    mfu = f", MFU {summary['mfu']:.1%} of {peak / 1e12:g} TFLOP/s" if "mfu" in summary else ""
    plural = "s" if len(steps) != 1 else ""
    return (f"throughput over {len(steps)} step{plural}: {summary['tokens_per_sec_per_gpu']:.1f} tokens/s/GPU, "
            f"{summary['model_tflops_per_gpu']:.4g} model TFLOP/s/GPU{mfu}")
