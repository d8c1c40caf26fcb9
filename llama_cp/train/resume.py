"""Resuming a run (--resume true|auto): the newest intact checkpoint of its output_dir loaded
into the model, the optimizer and the data loader. The settings a resume may change are
compared with the checkpoint's config when the output_dir is claimed (``run_dir``); the
learning-rate schedule is rebuilt by the caller from this run's flags (Note [Changing settings
on resume] in llama_cp/train/run_dir.py).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from llama_cp.config import TrainConfig
from llama_cp.train.checkpoint import load_checkpoint
from llama_cp.train.checkpoint_files import resumable_checkpoint


def resume_checkpoint(cfg: TrainConfig, say: Callable[[str], None]) -> str | None:
    """The checkpoint a run with ``cfg`` goes on from, or None to start at step 0 (no --resume, or
    --resume auto and none intact). Damaged checkpoints it skips are passed to ``say``;
    FileNotFoundError when --resume true finds none. Call on every rank (it verifies)."""
    if cfg.resume == "false":
        return None
    path, skipped = resumable_checkpoint(cfg.output_dir, allow_unverified=cfg.allow_unverified_checkpoint)
    for bad, why in skipped:
        say(f"skipped checkpoint {bad}: {why}")
    if path is None:
        where = os.path.join(cfg.output_dir, "checkpoints")
        if cfg.resume == "true":
            raise FileNotFoundError(
                f"--resume: no intact checkpoint under {where}"
                f"{' (all ' + str(len(skipped)) + ' failed verification)' if skipped else ''}; "
                "use --resume auto to start from step 0 when there is none"
            )
        say(f"--resume auto: no checkpoint under {where}, starting from step 0")
    return path


def load_resumed_state(path: str, model: nn.Module, optimizer: torch.optim.Optimizer, loader: Any) -> int:
    """Load checkpoint ``path`` into ``model``, ``optimizer`` (and the RNG states) and the data
    ``loader``'s position; returns its step. The schedule is not restored: it is rebuilt from
    this run's flags (Note [Changing settings on resume])."""
    state = load_checkpoint(path, model, optimizer)
    loader.load_state_dict(state["extra"]["loader"])
    return state["step"]
