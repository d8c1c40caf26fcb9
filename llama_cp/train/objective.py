"""What the training loop asks of an objective, and the choice of one from ``--objective``.

Note [Objectives as parts]
==========================

The loop (``llama_cp.train.trainer``) builds the model, the mesh and the optimizer, steps the
schedule, logs, checkpoints and exports; what differs between fine-tuning on next tokens and on
preference pairs is one object, chosen once at start:

    Trainer.setup      objective.build_loader(dp_rank, dp_size) -> (loader, eval rows)
                       objective.start()                     before the first step (DPO: references)
    Trainer.train_step objective.batches(micro-batches)      each step's rows, on the host
                       objective.forward_backward(micro)     -> (loss of the step, its metrics)
    Trainer.evaluate   objective.evaluate()                  -> {"eval_loss", ...}
    Trainer._fit       objective.summary(before, after)      the line that ends the run

``metric_names`` are the step metrics besides the loss that a logged row averages over its steps,
and ``evaluates_before_training`` says whether an eval at step 0 is the baseline of ``summary``.
An objective reads the trainer's model, mesh, device, tokenizer and config and its small helpers
(``_to_device``, ``_say``); the loop never asks which objective it runs.

    sft   llama_cp.train.sft.NextToken          the next-token loss (the passkey task: its accuracy)
    dpo   llama_cp.train.preference.Preference  --dpo_loss sigmoid (DPO), simpo or orpo
"""

from __future__ import annotations

from typing import Any, Protocol

import torch


class Objective(Protocol):
    metric_names: tuple[str, ...]
    evaluates_before_training: bool

    def build_loader(self, dp_rank: int, dp_size: int) -> tuple[Any, Any]: ...

    def start(self) -> None: ...

    def batches(self, batches: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]: ...

    def forward_backward(self, micro: list[dict[str, torch.Tensor]]) -> tuple[torch.Tensor, dict[str, float]]: ...

    def evaluate(self) -> dict[str, float]: ...

    def summary(self, before: dict[str, Any], after: dict[str, Any]) -> str | None: ...


def build_objective(trainer) -> Objective:
    """The objective of ``trainer.cfg.objective`` (Note [Objectives as parts])."""
    if trainer.cfg.objective == "dpo":
        from llama_cp.train.preference import Preference

        return Preference(trainer)
    from llama_cp.train.sft import NextToken

    return NextToken(trainer)
