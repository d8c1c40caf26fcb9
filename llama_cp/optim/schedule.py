"""The learning-rate schedule: a linear warm-up to --lr, then cosine or linear decay down to
``--min_lr_ratio * --lr`` at the last step (or a constant rate).

    scheduler = start_schedule(optimizer, cfg.optim, total_steps, step)   # lr of `step`
    ...; optimizer.step(); scheduler.step()                             # once per optimizer step

The rate is a pure function of the step and the flags, so a resumed run builds its schedule
afresh at the resumed step instead of loading the old one (Note [Changing settings on resume]
in llama_cp/train/run_dir.py).
"""

from __future__ import annotations

import functools
import math

import torch

from llama_cp.config import OptimConfig
from llama_cp.optim.optimizers import DECAYS


def lr_factor(step: int, total_steps: int, optim: OptimConfig) -> float:
    """The fraction of --lr that optimizer step ``step`` (0-based) of ``total_steps`` uses."""
    if step < optim.warmup_steps:
        return (step + 1) / (optim.warmup_steps + 1)
    progress = min(1.0, (step - optim.warmup_steps) / max(1, total_steps - optim.warmup_steps))
    floor = optim.min_lr_ratio
    if optim.lr_scheduler == "cosine":
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    if optim.lr_scheduler == "linear":
        return 1.0 - (1 - floor) * progress
    return 1.0


def start_schedule(
    optimizer: torch.optim.Optimizer, optim: OptimConfig, total_steps: int, step: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """A scheduler for ``optimizer`` that stands at ``step``, with --lr of ``optim`` written into
    every param group and --weight_decay into those that decay (a loaded optimizer keeps its
    moments, not its rates; Note [Which parameters decay] in llama_cp/optim/optimizers.py)."""
    for group in optimizer.param_groups:
        group.update(initial_lr=optim.lr, weight_decay=optim.weight_decay if group.get(DECAYS, True) else 0.0)
    # LambdaLR steps once when created: last_epoch becomes `step`, lr = --lr * lr_factor(step)
    factor = functools.partial(lr_factor, total_steps=total_steps, optim=optim)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor, last_epoch=step - 1)
