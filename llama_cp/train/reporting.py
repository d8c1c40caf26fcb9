"""Where a run's metrics go besides ``metrics.jsonl``: TensorBoard and Weights & Biases.

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
from collections.abc import Sequence
from typing import Any

from llama_cp.config import REPORTERS

TENSORBOARD_DIR = "tensorboard"
WANDB_ID_FILE = "wandb_run_id"


def run_info(config: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """The resolved config and the versions that produced a run (logged with it)."""
    from importlib.metadata import PackageNotFoundError, version

    import peft
    import torch
    import transformers

    try:  # the installed distribution's (llama_cp/__init__.py's __version__, which setup.cfg reads)
        ours = version("llama-cp")
    except PackageNotFoundError:  # run from a checkout that was never pip-installed
        ours = "unknown"
    versions = {
        "llama_cp": ours, "torch": torch.__version__, "transformers": transformers.__version__,
        "peft": peft.__version__, "python": platform.python_version(),
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
