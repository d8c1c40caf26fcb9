"""The preference objective (``--objective dpo`` with ``--dpo_loss`` sigmoid, simpo or orpo): whole
pairs packed in rows, DPO's reference log-probabilities, the pair loss and TRL's metrics (Note
[Objectives as parts] in ``llama_cp/train/objective.py``)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from llama_cp.data.grammar import PASSKEY
from llama_cp.data.preference import PAIR_COUNT, batch_sequences
from llama_cp.model.preference import preference_losses
from llama_cp.optim.step import preference_forward_backward
from llama_cp.parallel.mesh import submesh


class Preference:
    """DPO, SimPO or ORPO on pairs of (prompt, chosen, rejected) (Note [Packed preference pairs])."""

    #: the pair loss's metrics (TRL's names), averaged over a logged row's steps like the loss
    metric_names: tuple[str, ...] = ()
    #: the reward accuracy before training is the baseline of the line printed at the end
    evaluates_before_training = True

    def __init__(self, trainer):
        self.trainer = trainer
        self.references = None  # {"train", "eval"}: the stored reference sums of a full-fine-tune DPO run
        self.step_pairs = 0  # this dp rank's pairs in the current step

    def build_loader(self, dp_rank: int, dp_size: int):
        """(the training loader, the eval rows): the built-in passkey pairs, generated from the seed
        (the first rows of the length warm-up pack 4, then 2 pairs of shorter documents: Note
        [Passkey length warm-up]), or the prepared pairs of a file or hub --dataset; rows of
        ``PreferenceRows``."""
        from llama_cp.data.loader import DistributedRowLoader
        from llama_cp.data.mixture import DataSpec
        from llama_cp.data.packing import _pad_id
        from llama_cp.data.passkey import passkey_warmup_stages
        from llama_cp.data.preference import PreferenceRows, pack_pairs, passkey_pairs
        from llama_cp.data.prepared import load_prepared_rows

        t = self.trainer
        cfg, d = t.cfg, t.cfg.data
        warmup = 0
        if d.dataset != PASSKEY:
            train_rows, eval_rows = load_prepared_rows(
                DataSpec.of(d, cfg.seed), t.tokenizer, d.context_length, t.dims.cp, d.data_cache_dir,
                d.data_cache_shared, d.num_proc, say=t._say, truncate=d.truncate_documents, objective="dpo")
        else:
            # a warm-up's share of the rows the run reads, as for the SFT task; its stages hold 4 and 2 pairs a row
            stages = [parts // 2 for parts in passkey_warmup_stages(d.context_length) if parts > 2]
            warmup = t._passkey_warmup_rows(stages)
            per_row = [stages[i * len(stages) // warmup] if i < warmup else 1 for i in range(d.num_passkey_samples)]
            rows = []
            for split, layout in (("train", per_row), ("eval", [1] * d.num_eval_samples)):
                pairs = passkey_pairs(len(layout), d.context_length, t.tokenizer, split, cfg.seed,
                                      cfg.passkey_key_digits(), layout)
                rows.append(PreferenceRows(pack_pairs(pairs, d.context_length, t.dims.cp, _pad_id(t.tokenizer))))
            train_rows, eval_rows = rows
        loader = DistributedRowLoader(train_rows, d.batch_size, dp_rank, dp_size, seed=cfg.seed, shuffle=not warmup)
        return loader, eval_rows

    def start(self) -> None:
        """DPO's reference sums of every train and eval row for a full fine-tune (Note [Reference
        log-probabilities computed once] in llama_cp/train/reference.py), from the initial
        weights, before any checkpoint is loaded; none where the step needs none stored (SimPO,
        ORPO, or the adapters-off pass of --use_peft)."""
        t = self.trainer
        cfg = t.cfg
        if cfg.dpo_loss == "sigmoid" and cfg.model.model_name == "embedded":
            t._say("--dpo_loss sigmoid keeps the model near its reference, and the embedded model's reference is "
                   "random weights that know nothing of the task: the built-in preference task learns from scratch "
                   "with --dpo_loss orpo (docs/recipe.md)")
        if cfg.dpo_loss != "sigmoid":
            return
        if cfg.peft.use_peft:
            t._say("DPO's reference model: the base model with the LoRA adapters switched off (one more "
                   "forward per micro-batch, no gradient)")
            return
        self.references = self._stored_or_computed_references()

    def _stored_or_computed_references(self) -> dict[str, Any]:
        from llama_cp.train.reference import compute_reference, load_reference, reference_key, save_reference

        t = self.trainer
        cfg = t.cfg
        dp = submesh(t.mesh, "dp")
        # the eval reads --num_eval_samples rows: computed at every start, only on them (the others stay empty)
        sources = {"train": (t.loader.rows, None),
                   "eval": (t.eval_batches.rows, t._eval_rows) if t.eval_batches else (None, None)}
        prepared = getattr(t.loader.rows.rows, "path", None)  # a PreparedRows file, or generated rows
        directory = Path(prepared).parent / "reference" if prepared else None
        m = cfg.model
        key = reference_key(t.model_path, cfg.seed, {"rope_theta": m.rope_theta, "rope_scaling": m.rope_scaling,
                            "dtype": m.dtype, "device": t.device_type}, str(directory))
        references = {}
        for split, (rows, indices) in sources.items():
            if rows is None:
                continue
            path = directory / f"{key}-{split}.npz" if directory and split == "train" else None
            stored = load_reference(path, len(rows)) if path else None
            # read only where every rank found it (a node without it computes, and so must all: collectives)
            found = torch.tensor([float(stored is not None)], device=t.device)
            dist.all_reduce(found, op=dist.ReduceOp.MIN)
            if found.item():
                t._say(f"DPO's reference log-probabilities of the {split} rows: read from {path}")
                references[split] = stored
                continue
            references[split] = compute_reference(
                t.model, rows, cfg.data.batch_size, dp.get_group(), dp.get_local_rank(), dp.size(),
                t._to_device, t.mesh["cp"], desc=f"reference {split}", progress=t.rank == 0 and sys.stderr.isatty(),
                indices=indices)
            where = "computed from the initial weights"
            if path is not None and int(os.environ.get("LOCAL_RANK", t.rank)) == 0:
                try:
                    save_reference(path, references[split])
                    where += f", stored in {path}"
                except OSError as error:  # e.g. a read-only shared cache: the run goes on, the next one computes
                    print(f"rank {t.rank}: DPO's reference log-probabilities not stored in {path}: {error}",
                          file=sys.stderr)
            count = len(rows) if indices is None else len(indices)
            t._say(f"DPO's reference log-probabilities of the {count} {split} rows: {where} (Note [Reference "
                   "log-probabilities computed once])")
        dist.barrier()
        return references

    def _numbered(self, batch: dict[str, torch.Tensor], split: str) -> dict[str, torch.Tensor]:
        """A preference batch numbered as one (``batch_sequences``), with its rows' stored reference sums."""
        batch = batch_sequences(batch)
        return self.references[split].add_to(batch) if self.references else batch

    def batches(self, batches: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
        self.step_pairs = sum(int(b[PAIR_COUNT].sum()) for b in batches)  # this dp rank's
        return [self._numbered(b, "train") for b in batches]

    def forward_backward(self, micro: list[dict[str, torch.Tensor]]) -> tuple[torch.Tensor, dict[str, float]]:
        """A step's loss (the mean over the step's pairs) and TRL's metrics, means over the same
        pairs; the step's pairs counted over dp (each pair once, not once per cp rank)."""
        t = self.trainer
        cfg = t.cfg
        pairs = self._over_dp(torch.tensor([float(self.step_pairs)], dtype=torch.float64, device=t.device))
        _, sums = preference_forward_backward(
            t.model, micro, int(pairs.item()), kind=cfg.dpo_loss, beta=cfg.dpo_beta, gamma=cfg.simpo_gamma,
            cp_group=t.mesh["cp"], offload=cfg.model.activation_offload)
        means = self._pair_means(sums, pairs.item())
        loss = torch.tensor(means.pop("loss"), dtype=torch.float64, device=t.device)
        self.metric_names = tuple(sorted(means))
        return loss, means

    def evaluate(self) -> dict[str, float]:
        """The preference loss and TRL's metrics on the eval pairs, as ``eval_loss``, ``eval_rewards/...``."""
        t = self.trainer
        cfg = t.cfg
        sums: dict[str, torch.Tensor] = {}
        pairs = 0
        for batch in t.eval_batches:
            pairs += int(batch[PAIR_COUNT].sum())
            local = t._to_device(self._numbered(batch, "eval"))
            losses, metrics = preference_losses(t.model, local, kind=cfg.dpo_loss, beta=cfg.dpo_beta,
                                                gamma=cfg.simpo_gamma, cp_group=t.mesh["cp"],
                                                reference=local.get("reference_logps"))
            for name, values in {"loss": losses, **metrics}.items():
                sums[name] = sums.get(name, 0) + values.double().sum()
        pairs = self._over_dp(torch.tensor([float(pairs)], dtype=torch.float64, device=t.device)).item()
        return {f"eval_{name}": value for name, value in self._pair_means(sums, pairs).items()}

    def _pair_means(self, sums: dict[str, torch.Tensor], pairs: float) -> dict[str, float]:
        """Each metric's mean over ``pairs`` (every dp rank's) from this dp rank's ``sums``: one all-reduce."""
        names = sorted(sums)
        reduced = self._over_dp(torch.stack([sums[name] for name in names]))
        return {name: value / max(pairs, 1) for name, value in zip(names, reduced.tolist())}

    def _over_dp(self, values: torch.Tensor) -> torch.Tensor:
        """The sum over dp ranks of a value every rank of a cp group holds alike (an all-reduce over
        the world, divided by cp: the world's group is the one every step already uses)."""
        dist.all_reduce(values)
        return values / self.trainer.dims.cp

    def summary(self, before: dict[str, Any], after: dict[str, Any]) -> str | None:
        """The line that ends a run: the reward accuracy before and after training."""
        if "eval_rewards/accuracies" not in after:
            return None
        pairs = "pairs" if self.trainer.cfg.data.dataset != PASSKEY else "passkey pairs"
        return (f"reward accuracy (chosen over rejected) on the held-out {pairs}: "
                f"{before['eval_rewards/accuracies']:.2f} before training -> {after['eval_rewards/accuracies']:.2f} after")
