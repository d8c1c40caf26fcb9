"""The next-token objective (``--objective sft``): the loss of the data's trained tokens, and for
the passkey task the exact-match accuracy of its answers (Note [Objectives as parts] in
``llama_cp/train/objective.py``)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from llama_cp.data.grammar import PASSKEY
from llama_cp.model.loss import causal_lm_loss_sum, count_valid_tokens
from llama_cp.optim.step import forward_backward
from llama_cp.parallel.mesh import submesh


class NextToken:
    """Causal-LM fine-tuning on packed rows: the passkey task generated from the seed, a stream,
    or the prepared rows of a file or hub --dataset."""

    metric_names: tuple[str, ...] = ()

    def __init__(self, trainer):
        self.trainer = trainer
        self.passkey = trainer.cfg.data.dataset == PASSKEY
        #: the passkey task's accuracy before training is the baseline of the line printed at the end
        self.evaluates_before_training = self.passkey

    def build_loader(self, dp_rank: int, dp_size: int):
        """(the training loader, the eval rows)."""
        from llama_cp.data.loader import DistributedRowLoader, build_rows
        from llama_cp.data.mixture import DataSpec
        from llama_cp.data.passkey import passkey_warmup_stages
        from llama_cp.data.prepared import load_prepared_rows
        from llama_cp.data.streaming import StreamingRowLoader, streaming_eval_rows

        t = self.trainer
        cfg, d = t.cfg, t.cfg.data
        spec = DataSpec.of(d, cfg.seed)
        if d.streaming:  # Note [Streaming rows] in llama_cp/data/streaming.py
            loader = StreamingRowLoader(spec, t.tokenizer, d.context_length, d.batch_size, dp_rank, dp_size,
                                        truncate=d.truncate_documents)
            return loader, streaming_eval_rows(spec, t.tokenizer, d.context_length, d.num_eval_samples,
                                               truncate=d.truncate_documents)
        warmup_rows = 0
        if self.passkey:  # generated from the seed: nothing to keep on disk
            common = dict(tokenizer=t.tokenizer, context_length=d.context_length, cp=t.dims.cp, seed=cfg.seed,
                          passkey_digits=cfg.passkey_key_digits())
            warmup_rows = t._passkey_warmup_rows(passkey_warmup_stages(d.context_length))
            train_rows = build_rows(d.dataset, split="train", num_samples=d.num_passkey_samples,
                                    passkey_warmup_rows=warmup_rows, **common)
            eval_rows = build_rows(d.dataset, split="eval", num_samples=d.num_eval_samples, **common)
        else:  # tokenized and packed once, read from disk (Note [Prepared rows])
            train_rows, eval_rows = load_prepared_rows(
                spec, t.tokenizer, d.context_length, t.dims.cp, d.data_cache_dir, d.data_cache_shared,
                d.num_proc, say=t._say, truncate=d.truncate_documents,
            )
        # a warm-up is an order: the rows are independent draws, so nothing is lost by not shuffling
        loader = DistributedRowLoader(train_rows, d.batch_size, dp_rank, dp_size, seed=cfg.seed,
                                      shuffle=not warmup_rows)
        return loader, eval_rows

    def start(self) -> None:
        """Nothing to compute before the first step."""

    def batches(self, batches: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
        return batches

    def forward_backward(self, micro: list[dict[str, torch.Tensor]]) -> tuple[torch.Tensor, dict[str, float]]:
        """The step's mean token loss, summed over ranks: each micro-batch's summed loss is divided
        by the valid tokens of the whole step (``llama_cp.model.loss``)."""
        t = self.trainer
        num_tokens = count_valid_tokens(m["labels"] for m in micro)
        total = forward_backward(t.model, micro, num_tokens, offload=t.cfg.model.activation_offload)
        dist.all_reduce(total)
        return total, {} if num_tokens else {"no_scored_tokens": True}  # every label of the step -100: no update

    def evaluate(self) -> dict[str, float]:
        """Held-out loss, and for the passkey task the exact-match accuracy of the answer (from the
        loss's own logit chunks: no full logits either way)."""
        t = self.trainer
        loss_sum = torch.zeros((), dtype=torch.float64, device=t.device)
        correct_rows = torch.zeros((), dtype=torch.float64, device=t.device)
        labels = []
        for batch in t.eval_batches:
            local = t._to_device(batch)
            loss = causal_lm_loss_sum(t.model, local, return_correct=self.passkey)
            labels.append(local["labels"])
            if not self.passkey:
                loss_sum += loss.double()
                continue
            loss, correct = loss
            loss_sum += loss.double()
            # a row is right when all its answer tokens are, on every cp rank
            wrong = (~correct).sum(dim=1).to(torch.float64)
            dist.all_reduce(wrong, group=t.mesh["cp"].get_group())
            correct_rows += (wrong == 0).sum()
        dist.all_reduce(loss_sum)
        dp = submesh(t.mesh, "dp")
        dist.all_reduce(correct_rows, group=dp.get_group())
        result = {"eval_loss": loss_sum.item() / max(count_valid_tokens(labels), 1)}
        if self.passkey:
            result["passkey_acc"] = correct_rows.item() / self.eval_row_count()
        return result

    def eval_row_count(self) -> int:
        """The eval rows of all dp ranks."""
        t = self.trainer
        return sum(b["input_ids"].shape[0] for b in t.eval_batches) * submesh(t.mesh, "dp").size()

    def summary(self, before: dict[str, Any], after: dict[str, Any]) -> str | None:
        """The line that ends a passkey run: the accuracy before and after training."""
        if "passkey_acc" not in after:
            return None
        return (f"passkey accuracy on {self.eval_row_count()} held-out rows of {self.trainer.cfg.data.context_length} "
                f"tokens: {before['passkey_acc']:.2f} before training -> {after['passkey_acc']:.2f} after")
