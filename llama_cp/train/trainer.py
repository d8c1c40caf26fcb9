"""The training loop shared by ``recipes/finetune_longctx.py`` and notebooks.

    from llama_cp import Trainer, TrainConfig
    Trainer(TrainConfig.from_flags(context_length=8192, cp=2)).fit()

One optimizer step: ``gradient_accumulation_steps`` micro-batches per
data-parallel rank, each sharded over the cp group; the loss of every
micro-batch is its summed token loss divided by the valid tokens of the whole
step (all ranks, all micro-batches), so FSDP's gradient sum is the
single-process gradient of the mean loss (see ``llama_cp.model.loss``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

from llama_cp.config import TrainConfig
from llama_cp.data.tokenizer import build_tokenizer
from llama_cp.model.build import model_path
from llama_cp.model.flops import model_flops, peak_flops, throughput
from llama_cp.model.loss import causal_lm_loss_sum, count_valid_tokens
from llama_cp.optim.optimizers import build_optimizer
from llama_cp.optim.schedule import lr_factor, start_schedule
from llama_cp.optim.step import clip_gradients, forward_backward
from llama_cp.parallel.mesh import init_distributed, local_peers, machine_device_type, submesh
from llama_cp.parallel.sharding import shard_batch
from llama_cp.train.failures import StopSignals, collective_failure, stop_nonfinite
from llama_cp.train.reporting import PeakMemory
from llama_cp.train.resume import load_resumed_state, resume_checkpoint
from llama_cp.train.run_dir import OutputDirClaim, plot_losses, truncate_metrics, write_atomically


class Trainer:
    """Builds everything from a :class:`TrainConfig` and trains with :meth:`fit`."""

    def __init__(self, cfg: TrainConfig):
        cfg.resolve_defaults()  # a config built without from_flags (Note [Defaults by run])
        self.cfg = cfg
        self.memory_choice: dict[str, Any] | None = None  # what --memory chose (run_info.json): _choose_memory

    # ------------------------------------------------------------ setup
    def setup(self) -> None:
        cfg = self.cfg
        if self.memory_choice is None:  # setup() called without fit()
            self._choose_memory()
        self.device_type = init_distributed(timeout_s=cfg.collective_timeout, cpu_collectives=cfg.model.offload_params)
        self.peak_memory = PeakMemory(self.device_type)
        self.peak_memory.reset()  # start-up's window: not what ran before in this process (a notebook)
        self.rank = dist.get_rank()
        self._local_peers = local_peers() if dist.get_world_size() > 1 else []  # Note [Stuck ranks] in failures.py
        self.device = (
            torch.device("cuda", torch.cuda.current_device()) if self.device_type == "cuda" else torch.device("cpu")
        )
        self.dims = cfg.parallel.dims()
        self.mesh = self.dims.build_mesh(self.device_type)
        self.model_path = model_path(cfg.model.model_name)
        self.tokenizer = self._build_tokenizer()
        self.model = self._build_model()
        from llama_cp.model.build import cp_strategy

        self.cp_strategy, ulysses_degree = cp_strategy(cfg, self.model.config)
        if cfg.parallel.cp_strategy == "auto" and cfg.parallel.cp > 1:
            extra = f" --ulysses_degree {ulysses_degree}" if ulysses_degree else ""
            self._say(f"--cp_strategy auto: {self.cp_strategy}{extra} (Note [Choosing a strategy])")
        self._start_flops_count()
        self.optimizer = self._build_optimizer()
        self._build_data()  # the schedule needs total_steps
        self.references = self._build_references()  # from the initial weights, before any checkpoint is loaded
        self._start_schedule(0)
        os.makedirs(cfg.output_dir, exist_ok=True)

    def _choose_memory(self) -> None:
        """--memory auto, before the process group and the model exist: every rank plans the same
        job and sets the same levers on CUDA (Note [Choosing the memory levers] in
        llama_cp/plan/auto.py); on CPU the choice is only said."""
        from llama_cp.plan.auto import choose_for_run

        device_type = machine_device_type()
        local = int(os.environ.get("LOCAL_RANK", "0"))  # the device init_distributed will take
        total = torch.cuda.get_device_properties(local).total_memory if device_type == "cuda" else None
        world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
        self.memory_choice = choose_for_run(self.cfg, world, device_type, total, say=self._say)

    def _build_tokenizer(self):
        return build_tokenizer(self.model_path, self.cfg.data.chat_template)

    def _build_model(self):
        from llama_cp.model.build import build_model

        return build_model(self.cfg, self.mesh, self.device, self.model_path)

    def _start_flops_count(self) -> None:
        """The model FLOPs per token and per attention pair, and the GPU's peak (Note [Model FLOPs])."""
        from llama_cp.modules.causal_lm import base_causal_lm

        p = self.cfg.peft
        self.flops = model_flops(base_causal_lm(self.model).config, lora_r=p.lora_r if p.use_peft else 0,
                                 lora_targets=p.lora_target_modules, modules_to_save=p.lora_modules_to_save)
        device_name = torch.cuda.get_device_name(self.device) if self.device_type == "cuda" else None
        self.peak_flops = self.cfg.peak_tflops * 1e12 or peak_flops(device_name)
        if device_name is not None and self.peak_flops is None:  # names match exactly: say why no mfu, once
            self._say(f"no MFU is reported: {device_name!r} is not in llama_cp.model.flops.PEAK_BF16_FLOPS; pass "
                      "--peak_tflops (its dense bf16 TFLOP/s) for one")
        self._run_totals = []  # (seconds, tokens, model FLOPs) of each step of this run: the summary

    def _build_optimizer(self) -> torch.optim.Optimizer:
        o = self.cfg.optim
        # the model, not its parameters: norms, biases and embeddings do not decay (Note [Which parameters decay])
        return build_optimizer(o.optimizer, self.model, lr=o.lr, weight_decay=o.weight_decay,
                               on_host=self.cfg.model.offload_params)

    def _build_data(self) -> None:
        from llama_cp.config import PASSKEY
        from llama_cp.data.loader import DistributedRowLoader, build_rows
        from llama_cp.data.mixture import DataSpec
        from llama_cp.data.passkey import passkey_warmup_stages
        from llama_cp.data.prepared import load_prepared_rows
        from llama_cp.data.streaming import StreamingRowLoader, streaming_eval_rows

        cfg, d, dims = self.cfg, self.cfg.data, self.dims
        dp = submesh(self.mesh, "dp")
        dp_rank, dp_size = dp.get_local_rank(), dp.size()
        spec = DataSpec.of(d, cfg.seed)
        if d.streaming:  # Note [Streaming rows] in llama_cp/data/streaming.py
            self.loader = StreamingRowLoader(spec, self.tokenizer, d.context_length, d.batch_size, dp_rank, dp_size,
                                             truncate=d.truncate_documents)
            eval_rows = streaming_eval_rows(spec, self.tokenizer, d.context_length, d.num_eval_samples,
                                            truncate=d.truncate_documents)
        elif cfg.objective == "dpo":  # whole pairs in rows (Note [Packed preference pairs])
            train_rows, eval_rows, warmup_rows = self._preference_rows()
            self.loader = DistributedRowLoader(train_rows, d.batch_size, dp_rank, dp_size, seed=cfg.seed,
                                               shuffle=not warmup_rows)
        else:
            warmup_rows = 0
            if d.dataset == PASSKEY:  # generated from the seed: nothing to keep on disk
                common = dict(tokenizer=self.tokenizer, context_length=d.context_length, cp=dims.cp, seed=cfg.seed,
                              passkey_digits=cfg.passkey_key_digits())
                warmup_rows = self._passkey_warmup_rows(passkey_warmup_stages(d.context_length))
                train_rows = build_rows(d.dataset, split="train", num_samples=d.num_passkey_samples,
                                        passkey_warmup_rows=warmup_rows, **common)
                eval_rows = build_rows(d.dataset, split="eval", num_samples=d.num_eval_samples, **common)
            else:  # tokenized and packed once, read from disk (Note [Prepared rows])
                train_rows, eval_rows = load_prepared_rows(
                    spec, self.tokenizer, d.context_length, dims.cp, d.data_cache_dir, d.data_cache_shared,
                    d.num_proc, say=self._say, truncate=d.truncate_documents,
                )
            # a warm-up is an order: the rows are independent draws, so nothing is lost by not shuffling
            self.loader = DistributedRowLoader(train_rows, d.batch_size, dp_rank, dp_size, seed=cfg.seed,
                                               shuffle=not warmup_rows)
        self.eval_batches = self._eval_batches(eval_rows, dp_rank, dp_size)
        if d.streaming:  # a stream's length is unknown: --max_steps is required (config.validate)
            self.total_steps = cfg.max_steps
        else:
            micro_per_epoch = self.loader.steps_per_epoch
            steps_per_epoch = max(1, micro_per_epoch // cfg.optim.gradient_accumulation_steps)
            self.total_steps = cfg.max_steps or steps_per_epoch * cfg.num_epochs
        cfg.save_every = cfg.resolved_save_every(self.total_steps)
        if not cfg.is_demo():  # Note [Defaults by run] in llama_cp/config.py: what this run resolved to
            length = f"--max_steps {cfg.max_steps}" if cfg.max_steps else f"--num_epochs {cfg.num_epochs}"
            saves = f"every {cfg.save_every} steps" if cfg.save_every else "at the end"
            self._say(f"{self.total_steps} steps ({length}), --lr {cfg.optim.lr:g}, activation checkpointing "
                      f"{'on' if cfg.model.activation_checkpointing else 'off'}, checkpoints {saves} "
                      "(Note [Defaults by run] in llama_cp/config.py)")

    def _passkey_warmup_rows(self, stages) -> int:
        """The passkey rows that pack shorter documents (Note [Passkey length warm-up]): a share of the
        rows the run will read; none without warm-up ``stages`` or without document masks."""
        cfg, d = self.cfg, self.cfg.data
        if not stages or not d.document_mask:
            return 0
        rows_per_step = d.batch_size * self.dims.dp * cfg.optim.gradient_accumulation_steps
        read = min(d.num_passkey_samples, cfg.max_steps * rows_per_step) if cfg.max_steps else d.num_passkey_samples
        return round(d.passkey_warmup * read)

    def _preference_rows(self):
        """(train, eval, warm-up rows) of pairs: the built-in passkey pairs, generated from the seed
        (the first rows of the length warm-up pack 4, then 2 pairs of shorter documents: Note
        [Passkey length warm-up]), or the prepared pairs of a file or hub --dataset; each a
        ``PreferenceRows``."""
        from llama_cp.config import PASSKEY
        from llama_cp.data.mixture import DataSpec
        from llama_cp.data.packing import _pad_id
        from llama_cp.data.passkey import passkey_warmup_stages
        from llama_cp.data.preference import PreferenceRows, pack_pairs, passkey_pairs
        from llama_cp.data.prepared import load_prepared_rows

        cfg, d = self.cfg, self.cfg.data
        if d.dataset != PASSKEY:
            return *load_prepared_rows(DataSpec.of(d, cfg.seed), self.tokenizer, d.context_length, self.dims.cp,
                                       d.data_cache_dir, d.data_cache_shared, d.num_proc, say=self._say,
                                       truncate=d.truncate_documents, objective="dpo"), 0
        # a warm-up's share of the rows the run reads, as for the SFT task; its stages hold 4 and 2 pairs a row
        stages = [parts // 2 for parts in passkey_warmup_stages(d.context_length) if parts > 2]
        warmup = self._passkey_warmup_rows(stages)
        per_row = [stages[i * len(stages) // warmup] if i < warmup else 1 for i in range(d.num_passkey_samples)]
        rows = []
        for split, layout in (("train", per_row), ("eval", [1] * d.num_eval_samples)):
            pairs = passkey_pairs(len(layout), d.context_length, self.tokenizer, split, cfg.seed,
                                  cfg.passkey_key_digits(), layout)
            rows.append(PreferenceRows(pack_pairs(pairs, d.context_length, self.dims.cp, _pad_id(self.tokenizer))))
        return rows[0], rows[1], warmup

    def _build_references(self):
        """DPO's reference sums of every train and eval row for a full fine-tune, {"train", "eval"}
        (Note [Reference log-probabilities computed once] in llama_cp/train/reference.py); None when
        the step needs none stored (SFT, SimPO, ORPO, or the adapters-off pass of --use_peft)."""
        cfg = self.cfg
        if cfg.objective == "dpo" and cfg.dpo_loss == "sigmoid" and cfg.model.model_name == "embedded":
            self._say("--dpo_loss sigmoid keeps the model near its reference, and the embedded model's reference is "
                      "random weights that know nothing of the task: the built-in preference task learns from scratch "
                      "with --dpo_loss orpo (docs/recipe.md)")
        if cfg.objective != "dpo" or cfg.dpo_loss != "sigmoid" or cfg.peft.use_peft:
            if cfg.objective == "dpo" and cfg.dpo_loss == "sigmoid":
                self._say("DPO's reference model: the base model with the LoRA adapters switched off (one more "
                          "forward per micro-batch, no gradient)")
            return None
        from pathlib import Path

        from llama_cp.train.reference import compute_reference, load_reference, reference_key, save_reference

        dp = submesh(self.mesh, "dp")
        # the eval reads --num_eval_samples rows: computed at every start, only on them (the others stay empty)
        sources = {"train": (self.loader.rows, None),
                   "eval": (self.eval_batches.rows, self._eval_rows) if self.eval_batches else (None, None)}
        prepared = getattr(self.loader.rows.rows, "path", None)  # a PreparedRows file, or generated rows
        directory = Path(prepared).parent / "reference" if prepared else None
        m = cfg.model
        key = reference_key(self.model_path, cfg.seed, {"rope_theta": m.rope_theta, "rope_scaling": m.rope_scaling,
                            "dtype": m.dtype, "device": self.device_type}, str(directory))
        references = {}
        for split, (rows, indices) in sources.items():
            if rows is None:
                continue
            path = directory / f"{key}-{split}.npz" if directory and split == "train" else None
            stored = load_reference(path, len(rows)) if path else None
            # read only where every rank found it (a node without it computes, and so must all: collectives)
            found = torch.tensor([float(stored is not None)], device=self.device)
            dist.all_reduce(found, op=dist.ReduceOp.MIN)
            if found.item():
                self._say(f"DPO's reference log-probabilities of the {split} rows: read from {path}")
                references[split] = stored
                continue
            references[split] = compute_reference(
                self.model, rows, self.cfg.data.batch_size, dp.get_group(), dp.get_local_rank(), dp.size(),
                self._to_device, self.mesh["cp"], desc=f"reference {split}", progress=self.rank == 0 and sys.stderr.isatty(),
                indices=indices)
            where = "computed from the initial weights"
            if path is not None and int(os.environ.get("LOCAL_RANK", self.rank)) == 0:
                try:
                    save_reference(path, references[split])
                    where += f", stored in {path}"
                except OSError as error:  # e.g. a read-only shared cache: the run goes on, the next one computes
                    print(f"rank {self.rank}: DPO's reference log-probabilities not stored in {path}: {error}",
                          file=sys.stderr)
            count = len(rows) if indices is None else len(indices)
            self._say(f"DPO's reference log-probabilities of the {count} {split} rows: {where} (Note [Reference "
                      "log-probabilities computed once])")
        dist.barrier()
        return references

    def _pair_batch(self, batch: dict[str, torch.Tensor], split: str) -> dict[str, torch.Tensor]:
        """A preference batch numbered as one (``batch_sequences``), with its rows' stored reference sums."""
        from llama_cp.data.preference import batch_sequences

        batch = batch_sequences(batch)
        return self.references[split].add_to(batch) if self.references else batch

    def _eval_batches(self, eval_rows, dp_rank: int, dp_size: int):
        """This rank's share of --num_eval_samples eval rows drawn with --seed, in whole global batches
        (every rank must run the same number of eval forwards: FSDP collectives); None when the
        data has no eval set (--eval_fraction 0, no eval split, no --eval_dataset)."""
        from llama_cp.config import PASSKEY
        from llama_cp.data.row_files import RowBatches

        d = self.cfg.data
        if len(eval_rows) == 0:
            self._say("no eval set: --eval_fraction 0, no eval split and no --eval_dataset, so nothing is evaluated")
            return None
        per_step = d.batch_size * dp_size
        usable = min(len(eval_rows), d.num_eval_samples) // per_step * per_step
        if usable == 0:
            raise ValueError(
                f"{min(len(eval_rows), d.num_eval_samples)} eval rows are fewer than one global batch ({per_step}); "
                "raise --num_eval_samples or lower --batch_size" + (" (or give more eval data)" if
                                                                   len(eval_rows) < per_step else "")
            )
        # rows drawn with the seed, not the first ones: a mixture's eval rows come source after source,
        # and an eval split may be sorted; the same rows at every eval and on every rank
        chosen = sorted(np.random.default_rng(self.cfg.seed).choice(len(eval_rows), usable, replace=False).tolist())
        if d.dataset != PASSKEY:
            where = (f"--eval_dataset {d.eval_dataset!r}" if d.eval_dataset else
                     f"each source's validation/test split, else {d.eval_fraction:g} of its documents held out "
                     f"at random (--eval_fraction, --seed {self.cfg.seed})")
            self._say(f"each eval reads {usable} of {len(eval_rows)} eval rows of {d.context_length} tokens "
                      f"(--num_eval_samples {d.num_eval_samples}, drawn with --seed), from {where}")
        self._eval_rows = chosen  # every dp rank's (a DPO reference is computed for all of them)
        return RowBatches(eval_rows, chosen[dp_rank::dp_size], d.batch_size)

    def _start_schedule(self, step: int) -> None:
        """The lr schedule (and weight decay) of this run's flags, at ``step``: a resumed optimizer
        keeps its moments but takes --lr and --weight_decay from this run (``llama_cp.optim.schedule``)."""
        self.scheduler = start_schedule(self.optimizer, self.cfg.optim, self.total_steps, step)

    def _lr_factor(self, step: int) -> float:
        """The fraction of --lr that step ``step`` uses (``llama_cp.optim.schedule.lr_factor``)."""
        return lr_factor(step, self.total_steps, self.cfg.optim)

    # ------------------------------------------------------------ loop
    def _to_device(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        layout = "documents" if self.cp_strategy == "allgather" else "zigzag"
        local = shard_batch(batch, self.mesh["cp"], layout=layout)
        return {k: v.to(self.device) for k, v in local.items()}

    def _next_micro_batches(self) -> list[dict[str, torch.Tensor]]:
        batches = []
        while len(batches) < self.cfg.optim.gradient_accumulation_steps:
            try:
                batches.append(next(self._iterator))
            except StopIteration:  # end of an epoch: the loader moves on to the next one
                self._iterator = iter(self.loader)
        self._step_pairs = sum(self.flops.pairs(b["position_ids"], self.cfg.data.document_mask) for b in batches)
        if self.cfg.objective == "dpo":
            from llama_cp.data.preference import PAIR_COUNT

            self._preference_pairs = sum(int(b[PAIR_COUNT].sum()) for b in batches)  # this dp rank's
            batches = [self._pair_batch(b, "train") for b in batches]
        return [self._to_device(b) for b in batches]

    def train_step(self) -> dict[str, float]:
        """One optimizer step. A step whose loss or gradient norm is not finite changes no weight
        (its row says ``"skipped": true``); the data and the schedule move on."""
        cfg = self.cfg
        start = time.perf_counter()
        micro = self._next_micro_batches()
        lr = self.scheduler.get_last_lr()[0]
        if cfg.objective == "dpo":
            total, extra = self._preference_forward_backward(micro)
        else:
            num_tokens = count_valid_tokens(m["labels"] for m in micro)
            total, extra = self._forward_backward(micro, num_tokens), {}
            dist.all_reduce(total)
        grad_norm = clip_gradients(self.model, max_grad_norm=cfg.optim.max_grad_norm)
        finite = bool(torch.isfinite(total)) and bool(torch.isfinite(grad_norm))  # the same on every rank
        if finite:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        seconds = time.perf_counter() - start
        global_tokens = cfg.data.context_length * cfg.data.batch_size * len(micro) * self.dims.dp
        # this rank's share of its cp group's rows, summed over ranks: the step's model FLOPs (Note [Model FLOPs])
        step_flops = self.flops.step(global_tokens // self.dims.dp, self._step_pairs) / self.dims.cp
        step_flops = torch.tensor([step_flops], dtype=torch.float64, device=self.device)
        dist.all_reduce(step_flops)
        world = dist.get_world_size()
        self._run_totals.append((seconds, global_tokens, step_flops.item()))
        row = {
            "loss": total.item(),
            **extra,
            "lr": lr,
            "grad_norm": grad_norm.item(),
            "tokens_per_sec": global_tokens / seconds,
            **throughput(tokens=global_tokens, flops=step_flops.item(), seconds=seconds, world_size=world,
                         peak=self.peak_flops),
        }
        return row if finite else {**row, "skipped": True}

    def _forward_backward(self, micro: list[dict[str, torch.Tensor]], num_tokens: int) -> torch.Tensor:
        return forward_backward(self.model, micro, num_tokens, offload=self.cfg.model.activation_offload)

    def _preference_forward_backward(self, micro: list[dict[str, torch.Tensor]]) -> tuple[torch.Tensor, dict[str, float]]:
        """A DPO step's loss (the mean over the step's pairs) and TRL's metrics, means over the same
        pairs; the step's pairs counted over dp (each pair once, not once per cp rank)."""
        from llama_cp.optim.step import preference_forward_backward

        cfg = self.cfg
        pairs = self._over_dp(torch.tensor([float(self._preference_pairs)], dtype=torch.float64, device=self.device))
        _, sums = preference_forward_backward(
            self.model, micro, int(pairs.item()), kind=cfg.dpo_loss, beta=cfg.dpo_beta, gamma=cfg.simpo_gamma,
            cp_group=self.mesh["cp"], offload=cfg.model.activation_offload)
        means = self._pair_means(sums, pairs.item())
        loss = torch.tensor(means.pop("loss"), dtype=torch.float64, device=self.device)
        self._preference_metrics = sorted(means)
        return loss, means

    def _pair_means(self, sums: dict[str, torch.Tensor], pairs: float) -> dict[str, float]:
        """Each metric's mean over ``pairs`` (every dp rank's) from this dp rank's ``sums``: one all-reduce."""
        names = sorted(sums)
        reduced = self._over_dp(torch.stack([sums[name] for name in names]))
        return {name: value / max(pairs, 1) for name, value in zip(names, reduced.tolist())}

    def _over_dp(self, values: torch.Tensor) -> torch.Tensor:
        """The sum over dp ranks of a value every rank of a cp group holds alike (an all-reduce over
        the world, divided by cp: the world's group is the one every step already uses)."""
        dist.all_reduce(values)
        return values / self.dims.cp

    def _data_position(self, step: int) -> dict[str, float]:
        """``tokens_seen``: the tokens of the first ``step`` steps (all ranks, padding included);
        ``epoch``: passes over the training rows so far (a stream: the passes completed)."""
        d = self.cfg.data
        per_step = d.context_length * d.batch_size * self.cfg.optim.gradient_accumulation_steps * self.dims.dp
        if d.streaming:
            epoch = float(self.loader.epoch)
        else:
            epoch = self.loader.epoch + self.loader.batch_index / self.loader.steps_per_epoch
        return {"tokens_seen": step * per_step, "epoch": round(epoch, 6)}

    def _max_over_ranks(self, value: int) -> int:
        """The busiest rank's ``value`` (a peak from :class:`PeakMemory`); a collective."""
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Held-out loss, and for the passkey task the exact-match accuracy of the answer (from the
        loss's own logit chunks: no full logits either way)."""
        if self.eval_batches is None:
            return {}
        if self.cfg.objective == "dpo":
            return self._evaluate_preference()
        passkey = self.cfg.data.dataset == "passkey"
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        correct_rows = torch.zeros((), dtype=torch.float64, device=self.device)
        labels = []
        for batch in self.eval_batches:
            local = self._to_device(batch)
            loss = causal_lm_loss_sum(self.model, local, return_correct=passkey)
            labels.append(local["labels"])
            if not passkey:
                loss_sum += loss.double()
                continue
            loss, correct = loss
            loss_sum += loss.double()
            # a row is right when all its answer tokens are, on every cp rank
            wrong = (~correct).sum(dim=1).to(torch.float64)
            dist.all_reduce(wrong, group=self.mesh["cp"].get_group())
            correct_rows += (wrong == 0).sum()
        dist.all_reduce(loss_sum)
        dp = submesh(self.mesh, "dp")
        dist.all_reduce(correct_rows, group=dp.get_group())
        rows = sum(b["input_ids"].shape[0] for b in self.eval_batches) * dp.size()
        result = {"eval_loss": loss_sum.item() / max(count_valid_tokens(labels), 1)}
        if passkey:
            result["passkey_acc"] = correct_rows.item() / rows
        return result

    def _evaluate_preference(self) -> dict[str, float]:
        """The preference loss and TRL's metrics on the eval pairs, as ``eval_loss``, ``eval_rewards/...``."""
        from llama_cp.data.preference import PAIR_COUNT
        from llama_cp.model.preference import preference_losses

        cfg = self.cfg
        sums: dict[str, torch.Tensor] = {}
        pairs = 0
        for batch in self.eval_batches:
            pairs += int(batch[PAIR_COUNT].sum())
            local = self._to_device(self._pair_batch(batch, "eval"))
            losses, metrics = preference_losses(self.model, local, kind=cfg.dpo_loss, beta=cfg.dpo_beta,
                                                gamma=cfg.simpo_gamma, cp_group=self.mesh["cp"],
                                                reference=local.get("reference_logps"))
            for name, values in {"loss": losses, **metrics}.items():
                sums[name] = sums.get(name, 0) + values.double().sum()
        pairs = self._over_dp(torch.tensor([float(pairs)], dtype=torch.float64, device=self.device)).item()
        return {f"eval_{name}": value for name, value in self._pair_means(sums, pairs).items()}

    def fit(self) -> dict[str, Any]:
        """Train to ``max_steps`` (or ``num_epochs``), evaluate, checkpoint and export. Returns the
        last metrics row (with the final eval)."""
        self._check_before_start()
        self._choose_memory()  # before the claim: config.yaml records the levers the run trains with
        claim = OutputDirClaim(self.cfg, _global_rank())  # rank 0 notes what output_dir holds before the run
        self._where = "while setting up"
        try:
            claim.claim(self._say)  # inside: a refused run releases the output_dir's lock at once
            return self._fit()
        except BaseException as error:
            if self._where == "while setting up":
                claim.leave_as_found()
            failed = collective_failure(error, self.cfg, self._where, getattr(self, "_local_peers", []))
            if failed is not None:  # Note [Stuck ranks] in llama_cp/train/failures.py
                raise failed from error
            raise
        finally:
            claim.release()  # releases the output_dir for the next run (also in this process)

    def _fit(self) -> dict[str, Any]:
        from llama_cp.config import PASSKEY

        self.setup()
        cfg = self.cfg
        step = self._resume()
        self._iterator = iter(self.loader)
        metrics_path = os.path.join(cfg.output_dir, "metrics.jsonl")
        if self.rank == 0:
            truncate_metrics(metrics_path, step)
        self.reporter = self._build_reporter(step)
        # the passkey task's accuracy before any training: the baseline of the line printed at the end
        before = self.evaluate() if (cfg.data.dataset == PASSKEY or cfg.objective == "dpo") and step == 0 else None
        # a bar only on a terminal: in a log file (CI, SLURM, `2> file`) its carriage returns make a partial
        # line per step; there the metrics row printed every --log_every steps is the progress
        progress = tqdm(total=self.total_steps, initial=step, desc="train", unit="step",
                        disable=self.rank != 0 or not sys.stderr.isatty())
        signals = StopSignals()
        signals.catch()
        try:
            row: dict[str, Any] = {}
            nonfinite: list[int] = []  # the current run of skipped steps
            saved_step = step if step > 0 else None
            steps_peak = 0  # the largest step peak since the last row that has one
            window: dict[str, list[float]] = {}  # loss (and DPO's metrics) of the steps since the last row: their means
            while step < self.total_steps:
                self._where = f"in step {step + 1}"
                signals.stop_if_signalled(step, saved_step, self.device, self._save, cfg.output_dir)
                self.peak_memory.reset()  # Note [Peak memory in metrics]
                row = {"step": step + 1, **self.train_step()}
                steps_peak = max(steps_peak, self.peak_memory.read())
                step += 1
                progress.update(1)
                progress.set_postfix(loss=f"{row['loss']:.4f}", tok_s=f"{row['tokens_per_sec']:.0f}",
                                     tok_s_gpu=f"{row['tokens_per_sec_per_gpu']:.0f}",
                                     tflops_gpu=f"{row['model_tflops_per_gpu']:.3g}",
                                     **({"mfu": f"{row['mfu']:.1%}"} if "mfu" in row else {}))
                nonfinite = nonfinite + [step] if row.get("skipped") else []
                if nonfinite:  # a skipped step is logged, never evaluated or saved
                    self._log(metrics_path, row)
                    if len(nonfinite) >= cfg.max_nonfinite_steps:
                        stop_nonfinite(nonfinite, cfg, self.rank)
                    continue
                last = step == self.total_steps
                for name in ("loss", *getattr(self, "_preference_metrics", ())):
                    window.setdefault(name, []).append(row[name])
                if (cfg.eval_every and step % cfg.eval_every == 0) or last:
                    row.update(self.evaluate())
                if step % cfg.log_every == 0 or last or "eval_loss" in row:
                    row["peak_memory_bytes"] = self._max_over_ranks(steps_peak)  # a collective: only for written rows
                    row.update({name: sum(values) / len(values) for name, values in window.items()},
                               **self._data_position(step))
                    steps_peak, window = 0, {}
                    self._log(metrics_path, row)
                if (cfg.save_every and step % cfg.save_every == 0) or last:
                    self._save(step)
                    saved_step = step
        finally:
            progress.close()  # also on an error, so the bar does not garble its message
            self.reporter.close()
            signals.restore()
        self._say_throughput()
        self._where = "while exporting final/"
        self.export(os.path.join(cfg.output_dir, "final"))
        if self.rank == 0:
            plot_losses(metrics_path, os.path.join(cfg.output_dir, "loss.png"))
        if before is not None and "eval_rewards/accuracies" in row:
            pairs = "pairs" if cfg.data.dataset != PASSKEY else "passkey pairs"
            self._say(f"reward accuracy (chosen over rejected) on the held-out {pairs}: "
                      f"{before['eval_rewards/accuracies']:.2f} before training -> {row['eval_rewards/accuracies']:.2f} after")
        if before is not None and "passkey_acc" in row:
            rows = sum(b["input_ids"].shape[0] for b in self.eval_batches) * submesh(self.mesh, "dp").size()
            self._say(f"passkey accuracy on {rows} held-out rows of {cfg.data.context_length} tokens: "
                      f"{before['passkey_acc']:.2f} before training -> {row['passkey_acc']:.2f} after")
        return row

    def _say_throughput(self) -> None:
        """The run's summary line: tokens/s/GPU, model TFLOP/s/GPU and MFU over this run's steps,
        the first left out when there are more (it warms up kernels and the allocator)."""
        steps = self._run_totals[1:] or self._run_totals
        if not steps:
            return
        seconds, tokens, flops = (sum(column) for column in zip(*steps))
        summary = throughput(tokens=tokens, flops=flops, seconds=seconds, world_size=dist.get_world_size(),
                             peak=self.peak_flops)
        mfu = f", MFU {summary['mfu']:.1%} of {self.peak_flops / 1e12:g} TFLOP/s" if "mfu" in summary else ""
        plural = "s" if len(steps) != 1 else ""
        self._say(f"throughput over {len(steps)} step{plural}: {summary['tokens_per_sec_per_gpu']:.1f} tokens/s/GPU, "
                  f"{summary['model_tflops_per_gpu']:.4g} model TFLOP/s/GPU{mfu}")

    def _check_before_start(self) -> None:
        """What can be checked before any process group or model exists: a local model
        directory has a tokenizer, --rope_scaling reaches --context_length, an explicit
        --attention_backend can run here, and the parallel rules, every broken one in one
        message, now that the number of processes is known (``ParallelConfig.check``)."""
        from transformers import AutoConfig

        from llama_cp.model.build import check_attention_backend
        from llama_cp.modules.causal_lm import apply_rope_settings, check_tokenizer_files, embedded_llama_config

        name = os.path.expanduser(self.cfg.model.model_name)
        local = self.cfg.model.model_name != "embedded" and os.path.isdir(name)
        if local:
            check_tokenizer_files(name)
        if self.cfg.model.model_name == "embedded" or local:  # a hub id's config comes with its download
            config = AutoConfig.from_pretrained(name) if local else embedded_llama_config()
            model = self.cfg.model
            apply_rope_settings(config, model.rope_theta, model.rope_scaling, self.cfg.data.context_length)
            check_attention_backend(self.cfg, config, machine_device_type())
        world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
        self.cfg.parallel.check(self.cfg.data.context_length, world)

    def _resume(self) -> int:
        """Load the newest intact checkpoint when --resume asks for it (``llama_cp.train.resume``) and
        rebuild the schedule at its step; returns the step to go on from."""
        path = resume_checkpoint(self.cfg, self._say)
        if path is None:
            return 0
        step = load_resumed_state(path, self.model, self.optimizer, self.loader)
        self._start_schedule(step)  # from this run's flags (Note [Changing settings on resume])
        self._say(f"resumed from step {step} ({path})")
        return step

    def _say(self, message: str) -> None:
        if _global_rank() == 0:
            tqdm.write(message)

    def _save(self, step: int) -> str:
        from llama_cp.train.checkpoint import save_checkpoint

        return save_checkpoint(
            self.cfg.output_dir, step, self.model, self.optimizer, scheduler=self.scheduler,
            extra={"loader": self.loader.state_dict()}, config=self.cfg.to_dict(), keep_last=self.cfg.keep_last,
        )

    def _build_reporter(self, step: int):
        """TensorBoard / W&B (``--report_to``) on rank 0, and ``run_info.json`` (the resolved
        config, versions and layout of the run, and its start-up peak memory) beside ``config.yaml``."""
        from llama_cp.train.reporting import Reporter, run_info

        load_peak = self._max_over_ranks(self.peak_memory.read())  # Note [Peak memory in metrics]
        info = run_info(self.cfg.to_dict(), world_size=dist.get_world_size(), device_type=self.device_type,
                        dims={"dp_replicate": self.dims.dp_replicate, "dp_shard": self.dims.dp_shard,
                              "cp": self.dims.cp}, resumed_from_step=step, load_peak_memory_bytes=load_peak,
                        model_flops={"per_token": self.flops.per_token, "per_attention_pair": self.flops.per_pair,
                                     "peak_flops_per_gpu": self.peak_flops}, memory=self.memory_choice)
        if self.rank == 0:
            write_atomically(os.path.join(self.cfg.output_dir, "run_info.json"), json.dumps(info, indent=1))
        report_to = [name for name in self.cfg.report_to if name != "none"]
        return Reporter(self.cfg.output_dir, report_to, run_info=info, start_step=step, enabled=self.rank == 0)

    def _log(self, path: str, row: dict[str, Any]) -> None:
        if self.rank == 0:
            self.reporter.log(row, row["step"])
            with open(path, "a") as f:
                f.write(json.dumps(row) + "\n")
            tqdm.write(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))

    def export(self, path: str) -> None:
        """``final/``: an HF model directory in --export_dtype (full fine-tune) or a peft adapter
        (LoRA), with the tokenizer; with --merge_lora also ``final_merged/``, the adapter merged
        into the base model (``llama_cp.train.export``)."""
        from llama_cp.train.export import align_special_tokens, export_dtype, export_pretrained

        cfg = self.cfg
        targets = [(path, False)] + ([(path.rstrip(os.sep) + "_merged", True)] if cfg.merge_lora else [])
        if self.rank == 0:
            import shutil

            for target, _ in targets:
                if os.path.exists(target):
                    shutil.rmtree(target)  # the previous export of this output_dir
        dist.barrier()
        changed = align_special_tokens(self.model, self.tokenizer)
        if changed:
            self._say(f"exported with the tokenizer's special-token ids: {', '.join(changed)}")
        dtype = export_dtype(cfg.export_dtype, self.model_path)
        name = cfg.model.model_name
        local = name != "embedded" and os.path.isdir(os.path.expanduser(name))
        base = os.path.abspath(os.path.expanduser(name)) if local else name
        if hasattr(self.model, "peft_config") and name != "embedded":
            for adapter in self.model.peft_config.values():  # where PeftModel.from_pretrained users find the base
                adapter.base_model_name_or_path = base
        info = {"model_name": base, "seed": cfg.seed, "rope_theta": cfg.model.rope_theta,
                "rope_scaling": cfg.model.rope_scaling, "context_length": cfg.data.context_length}
        for target, merge in targets:
            export_pretrained(self.model, target, self.tokenizer, dtype=dtype, merge_lora=merge, info=info)
        rope = " ".join(f"--{k} {v}" for k, v in (("rope_theta", cfg.model.rope_theta),
                                                   ("rope_scaling", cfg.model.rope_scaling)) if v not in (0, "none"))
        if rope and hasattr(self.model, "peft_config"):  # peft loads an adapter onto the base's own config
            merged = f"; {targets[-1][0]} carries them" if cfg.merge_lora else "; --merge_lora writes a model that carries them"
            self._say(f"{path} is an adapter trained with {rope}: the base model's config must be given the same "
                      f"settings before loading it (README.md there){merged}")


def _global_rank() -> int:
    """This process's rank, also before ``init_distributed`` (from torchrun's RANK)."""
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))


