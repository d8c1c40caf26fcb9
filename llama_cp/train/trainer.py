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
from llama_cp.files import write_text
from llama_cp.flags.defaults import said_defaults
from llama_cp.model.build import model_path
from llama_cp.model.flops import model_flops, peak_flops, throughput
from llama_cp.model.loss import check_token_ids, token_rows
from llama_cp.optim.optimizers import build_optimizer
from llama_cp.optim.schedule import lr_factor, start_schedule
from llama_cp.optim.step import clip_gradients
from llama_cp.parallel.mesh import init_distributed, local_peers, machine_device_type, submesh
from llama_cp.parallel.sharding import layout_for, shard_batch
from llama_cp.train.failures import StopSignals, collective_failure, stop_nonfinite
from llama_cp.train.objective import build_objective
from llama_cp.train.reporting import PeakMemory, throughput_line
from llama_cp.train.resume import load_resumed_state, resume_checkpoint
from llama_cp.train.run_dir import OutputDirClaim, plot_losses, truncate_metrics


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
        self._token_rows = token_rows(self.model)  # each host batch is checked against them (_to_device)
        from llama_cp.model.build import cp_strategy

        self.cp_strategy, ulysses_degree = cp_strategy(cfg, self.model.config)
        if cfg.parallel.cp_strategy == "auto" and cfg.parallel.cp > 1:
            extra = f" --ulysses_degree {ulysses_degree}" if ulysses_degree else ""
            self._say(f"--cp_strategy auto: {self.cp_strategy}{extra} (Note [Choosing a strategy])")
        self._start_flops_count()
        self.optimizer = self._build_optimizer()
        self.objective = build_objective(self)  # Note [Objectives as parts] in llama_cp/train/objective.py
        self._build_data()  # the schedule needs total_steps
        if cfg.eval_perplexity:  # chosen now: documents too short are refused before the first step
            from llama_cp.eval.trained import perplexity_documents

            self.perplexity_documents = perplexity_documents(self)
        self.objective.start()  # DPO's references: from the initial weights, before any checkpoint is loaded
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
        """The run's model; said when its rows are longer than its positions (Note [Positions past the model's])."""
        from llama_cp.model.build import build_model, lora_target_changes
        from llama_cp.train.export import check_mergeable
        from llama_cp.modules.causal_lm import base_causal_lm, positions_past_config

        model = build_model(self.cfg, self.mesh, self.device, self.model_path)
        if self.cfg.peft.use_peft:  # Note [peft's MoE target conversion]
            p = self.cfg.peft
            if line := lora_target_changes(model, p.lora_target_modules, p.lora_target_parameters):
                self._say(line)
            if self.cfg.merge_lora:  # before training, not at the export after it
                check_mergeable(model)
        m = self.cfg.model
        if line := positions_past_config(base_causal_lm(model).config, self.cfg.data.context_length, m.rope_theta,
                                         m.rope_scaling):
            self._say(line)
        return model

    def _start_flops_count(self) -> None:
        """The model FLOPs per token and per attention pair, and the GPU's peak (Note [Model FLOPs])."""
        from llama_cp.modules.causal_lm import base_causal_lm

        from llama_cp.model.build import adapted_linears

        p = self.cfg.peft  # the layers peft adapted: Note [peft's MoE target conversion]
        self.flops = model_flops(base_causal_lm(self.model).config, lora_r=p.lora_r if p.use_peft else 0,
                                 lora_targets=adapted_linears(self.model) if p.use_peft else (),
                                 modules_to_save=p.lora_modules_to_save)
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
        cfg, d = self.cfg, self.cfg.data
        dp = submesh(self.mesh, "dp")
        dp_rank, dp_size = dp.get_local_rank(), dp.size()
        self.loader, eval_rows = self.objective.build_loader(dp_rank, dp_size)
        self.eval_batches = self._eval_batches(eval_rows, dp_rank, dp_size)
        if d.streaming:  # a stream's length is unknown: --max_steps is required (config.validate)
            self.total_steps = cfg.max_steps
        else:
            micro_per_epoch = self.loader.steps_per_epoch
            steps_per_epoch = max(1, micro_per_epoch // cfg.optim.gradient_accumulation_steps)
            self.total_steps = cfg.max_steps or steps_per_epoch * cfg.num_epochs
        cfg.save_every = cfg.resolved_save_every(self.total_steps)
        if not cfg.is_demo():  # Note [Defaults by run] in llama_cp/flags/defaults.py: what this run resolved to
            self._say(said_defaults(cfg, self.total_steps))

    def _passkey_warmup_rows(self, stages) -> int:
        """The passkey rows that pack shorter documents (Note [Passkey length warm-up]): a share of the
        rows the run will read; none without warm-up ``stages`` or without document masks."""
        cfg, d = self.cfg, self.cfg.data
        if not stages or not d.document_mask:
            return 0
        rows_per_step = d.batch_size * self.dims.dp * cfg.optim.gradient_accumulation_steps
        read = min(d.num_passkey_samples, cfg.max_steps * rows_per_step) if cfg.max_steps else d.num_passkey_samples
        return round(d.passkey_warmup * read)

    def _eval_batches(self, eval_rows, dp_rank: int, dp_size: int):
        """This rank's share of --num_eval_samples eval rows drawn with --seed, in whole global batches
        (every rank must run the same number of eval forwards: FSDP collectives); None when the
        data has no eval set (--eval_fraction 0, no eval split, no --eval_dataset)."""
        from llama_cp.data.grammar import PASSKEY
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
        check_token_ids(batch, *self._token_rows)
        layout = layout_for(self.cp_strategy)
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
        return [self._to_device(b) for b in self.objective.batches(batches)]

    def train_step(self) -> dict[str, float]:
        """One optimizer step. A step whose loss or gradient norm is not finite changes no weight
        (its row says ``"skipped": true``), nor does one with no scored token on any rank (``"no_scored_tokens":
        true``: zero gradients, whose AdamW step would still move the weights); the data and the schedule move on."""
        cfg = self.cfg
        start = time.perf_counter()
        micro = self._next_micro_batches()
        lr = self.scheduler.get_last_lr()[0]
        total, extra = self.objective.forward_backward(micro)
        grad_norm = clip_gradients(self.model, max_grad_norm=cfg.optim.max_grad_norm)
        finite = bool(torch.isfinite(total)) and bool(torch.isfinite(grad_norm))  # the same on every rank
        if finite and not extra.get("no_scored_tokens"):
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
        """The objective's held-out metrics (``eval_loss``, ...); none without an eval set."""
        return {} if self.eval_batches is None else self.objective.evaluate()

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
        self.setup()
        cfg = self.cfg
        step = self._resume()
        self._iterator = iter(self.loader)
        metrics_path = os.path.join(cfg.output_dir, "metrics.jsonl")
        if self.rank == 0:
            truncate_metrics(metrics_path, step)
        self.reporter = self._build_reporter(step)
        # the baseline of the line printed at the end (the passkey task's accuracy, DPO's reward accuracy)
        before = self.evaluate() if self.objective.evaluates_before_training and step == 0 else None
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
                if not row.get("no_scored_tokens"):  # a step with nothing scored has no loss to average
                    for name in ("loss", *self.objective.metric_names):
                        window.setdefault(name, []).append(row[name])
                if (cfg.eval_every and step % cfg.eval_every == 0) or last:
                    row.update(self.evaluate())
                if step % cfg.log_every == 0 or last or "eval_loss" in row:
                    row["peak_memory_bytes"] = self._max_over_ranks(steps_peak)  # a collective: only for written rows
                    row.update({name: None for name in ("loss", *self.objective.metric_names)},  # none scored
                               **{name: sum(values) / len(values) for name, values in window.items()},
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
        line = throughput_line(self._run_totals, dist.get_world_size(), self.peak_flops)
        if line:
            self._say(line)
        self._where = "while exporting final/"
        self.export(os.path.join(cfg.output_dir, "final"))
        if self.rank == 0:
            plot_losses(metrics_path, os.path.join(cfg.output_dir, "loss.png"))
        summary = self.objective.summary(before, row) if before is not None else None
        if summary:
            self._say(summary)
        return row

    def _check_before_start(self) -> None:
        """What can be checked before any process group or model exists: a local model
        directory has a tokenizer, --rope_scaling reaches --context_length, an explicit
        --attention_backend can run here, and the parallel rules, every broken one in one
        message, now that the number of processes is known (``ParallelConfig.check``)."""
        from llama_cp.model.build import check_attention_backend, check_strategy_heads
        from llama_cp.modules.checkpoints import checkpoint_config
        from llama_cp.modules.families import check_family
        from llama_cp.modules.causal_lm import apply_rope_settings, check_tokenizer_files, embedded_llama_config
        from llama_cp.modules.gguf import gguf_config, gguf_path

        name = os.path.expanduser(self.cfg.model.model_name)
        local = self.cfg.model.model_name != "embedded" and os.path.isdir(name)
        gguf_file = gguf_path(self.cfg.model.model_name)  # its tokenizer is in the file
        if local:
            check_tokenizer_files(name)
        if self.cfg.model.model_name == "embedded" or local or gguf_file:  # a hub id's config comes with its download
            config = (checkpoint_config(name) if local else gguf_config(gguf_file) if gguf_file
                      else embedded_llama_config())
            check_family(config)
            model = self.cfg.model
            apply_rope_settings(config, model.rope_theta, model.rope_scaling, self.cfg.data.context_length)
            check_attention_backend(self.cfg, config, machine_device_type())
            check_strategy_heads(self.cfg, config)
            if self.cfg.export_gguf != "none":  # refused now, not after the run
                from llama_cp.train.gguf_export import check_gguf_family

                check_gguf_family(config, "--export_gguf")
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
        from llama_cp.modules.gguf import model_source
        from llama_cp.train.reporting import Reporter, run_info

        load_peak = self._max_over_ranks(self.peak_memory.read())  # Note [Peak memory in metrics]
        info = run_info(self.cfg.to_dict(), world_size=dist.get_world_size(), device_type=self.device_type,
                        dims={"dp_replicate": self.dims.dp_replicate, "dp_shard": self.dims.dp_shard,
                              "cp": self.dims.cp}, resumed_from_step=step, load_peak_memory_bytes=load_peak,
                        model_flops={"per_token": self.flops.per_token, "per_attention_pair": self.flops.per_pair,
                                     "peak_flops_per_gpu": self.peak_flops}, memory=self.memory_choice,
                        **model_source(self.cfg.model.model_name))
        if self.rank == 0:
            write_text(os.path.join(self.cfg.output_dir, "run_info.json"), json.dumps(info, indent=1))
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
        into the base model; with --export_gguf also ``final_gguf/`` (``llama_cp.train.export.export_run``)."""
        from llama_cp.train.export import export_run

        export_run(self.model, self.tokenizer, self.cfg, path, self.model_path, say=self._say)


def _global_rank() -> int:
    """This process's rank, also before ``init_distributed`` (from torchrun's RANK)."""
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))


