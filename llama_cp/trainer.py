"""The training loop shared by ``recipes/finetune_longctx.py`` and notebooks.

    from llama_cp import Trainer, TrainConfig
    Trainer(TrainConfig.from_flags(context_length=8192, cp=2)).fit()

One optimizer step: ``gradient_accumulation_steps`` micro-batches per
data-parallel rank, each sharded over the cp group; the loss of every
micro-batch is its summed token loss divided by the valid tokens of the whole
step (all ranks, all micro-batches), so FSDP's gradient sum is the
single-process gradient of the mean loss (see ``llama_cp.loss``).
"""

from __future__ import annotations

import json
import math
import os
import resource
import signal
import threading
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist
from tqdm import tqdm

from llama_cp.config import TrainConfig
from llama_cp.cp_attention import apply_context_parallel
from llama_cp.fsdp_wrap import activation_offload, export_pretrained, load_full_weights, shard_model
from llama_cp.loss import causal_lm_loss_sum, count_valid_tokens, enable_chunked_loss
from llama_cp.mesh import init_distributed, submesh
from llama_cp.optim import build_optimizer
from llama_cp.sharding import shard_batch


#: Signals that stop training gracefully: finish the step, save, exit (Note [Stopping on a signal]).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class TrainingStopped(RuntimeError):
    """Training stopped on purpose (a stop signal, a run of non-finite steps); raised on every rank."""

    same_on_every_rank = True


class CollectiveFailed(RuntimeError):
    """A collective timed out or lost a peer: another rank is stuck or gone (Note [Stuck ranks])."""


# Note [Stuck ranks]
# ~~~~~~~~~~~~~~~~~~
# A rank that stops answering (SIGSTOP, hung storage, a dead node) leaves the others
# blocked in their next collective. --collective_timeout bounds that wait (it is the
# process group's timeout, inherited by the mesh's groups); the rank that gives up
# raises CollectiveFailed, naming itself and the step it was in, and exits, and
# torchrun then ends the job. With gloo the failing collective raises; with NCCL its
# watchdog aborts the process after the same timeout with NCCL's own report.


# Note [Stopping on a signal]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Clusters stop jobs with SIGTERM (SLURM at pre-emption or the time limit, k8s on
# eviction; torchrun forwards it to its workers and waits 30 s before SIGKILL), and
# SLURM can send SIGUSR1 ahead of time (``#SBATCH --signal=USR1@300``). The handler
# only records the signal. Before each step the ranks agree (an all-reduce MAX of
# the signal number: one rank's signal stops them all at the same step); then they
# save the current step, unless it is saved already, and raise TrainingStopped:
# "stopped by SIGTERM after step N: saved ...; resume with --resume".


class Trainer:
    """Builds everything from a :class:`TrainConfig` and trains with :meth:`fit`."""

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg

    # ------------------------------------------------------------ setup
    def setup(self) -> None:
        cfg = self.cfg
        self.device_type = init_distributed(timeout_s=cfg.collective_timeout)
        self.rank = dist.get_rank()
        self.device = (
            torch.device("cuda", torch.cuda.current_device()) if self.device_type == "cuda" else torch.device("cpu")
        )
        self.dims = cfg.parallel.dims()
        self.mesh = self.dims.build_mesh(self.device_type)
        self.model_path = _model_path(cfg.model.model_name)
        self.tokenizer = self._build_tokenizer()
        self.model = self._build_model()
        self.optimizer = self._build_optimizer()
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor)
        self._build_data()
        os.makedirs(cfg.output_dir, exist_ok=True)

    def _build_tokenizer(self):
        from transformers import AutoTokenizer

        from llama_cp.tokenizer import byte_tokenizer

        from llama_cp.models import check_tokenizer_files

        if self.model_path is None:
            return byte_tokenizer()
        check_tokenizer_files(self.model_path)
        return AutoTokenizer.from_pretrained(self.model_path)

    def _param_dtype(self) -> torch.dtype | None | str:
        return {"auto": "auto", "float32": None, "bfloat16": torch.bfloat16}[self.cfg.model.dtype]

    def _build_model(self):
        from transformers import AutoConfig

        from llama_cp.models import build_causal_lm, embedded_llama_config

        cfg = self.cfg
        torch.manual_seed(cfg.seed)
        path = self.model_path
        if path is None:
            # small enough to build on every rank; identical there thanks to the seed
            model = build_causal_lm(embedded_llama_config()).to(self.device)
        else:
            model = build_causal_lm(AutoConfig.from_pretrained(path), device="meta")  # no rank holds it all
        model = parallelize_model(model, cfg, self.mesh, param_dtype=self._param_dtype())
        if path is not None:
            load_full_weights(model, path, device=self.device)
        return model

    def _build_optimizer(self) -> torch.optim.Optimizer:
        o = self.cfg.optim
        return build_optimizer(o.optimizer, self.model.parameters(), lr=o.lr, weight_decay=o.weight_decay)

    def _build_data(self) -> None:
        from llama_cp.data import DistributedRowLoader, build_rows

        cfg, dims = self.cfg, self.dims
        common = dict(tokenizer=self.tokenizer, context_length=cfg.data.context_length, cp=dims.cp, seed=cfg.seed)
        train_rows = build_rows(cfg.data.dataset, split="train", num_samples=cfg.data.num_passkey_samples, **common)
        eval_rows = build_rows(cfg.data.dataset, split="eval", num_samples=cfg.data.num_eval_samples, **common)
        dp = submesh(self.mesh, "dp")
        dp_rank, dp_size = dp.get_local_rank(), dp.size()
        self.loader = DistributedRowLoader(train_rows, cfg.data.batch_size, dp_rank, dp_size, seed=cfg.seed)
        # every rank must run the same number of eval forwards (FSDP collectives): whole global batches only
        per_step = cfg.data.batch_size * dp_size
        usable = len(eval_rows) // per_step * per_step
        if usable == 0:
            raise ValueError(
                f"{len(eval_rows)} eval rows are fewer than one global batch ({per_step}); "
                "raise --num_eval_samples or lower --batch_size"
            )
        mine = eval_rows[:usable][dp_rank::dp_size]
        self.eval_batches = [
            {k: torch.stack([row[k] for row in mine[i : i + cfg.data.batch_size]]) for k in mine[0]}
            for i in range(0, len(mine), cfg.data.batch_size)
        ]
        micro_per_epoch = self.loader.steps_per_epoch
        steps_per_epoch = max(1, micro_per_epoch // cfg.optim.gradient_accumulation_steps)
        self.total_steps = cfg.max_steps or steps_per_epoch * cfg.num_epochs

    def _lr_factor(self, step: int) -> float:
        o = self.cfg.optim
        if step < o.warmup_steps:
            return (step + 1) / (o.warmup_steps + 1)
        progress = min(1.0, (step - o.warmup_steps) / max(1, self.total_steps - o.warmup_steps))
        floor = o.min_lr_ratio
        if o.lr_scheduler == "cosine":
            return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
        if o.lr_scheduler == "linear":
            return 1.0 - (1 - floor) * progress
        return 1.0

    # ------------------------------------------------------------ loop
    def _to_device(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        local = shard_batch(batch, self.mesh["cp"])
        return {k: v.to(self.device) for k, v in local.items()}

    def _next_micro_batches(self) -> list[dict[str, torch.Tensor]]:
        batches = []
        while len(batches) < self.cfg.optim.gradient_accumulation_steps:
            try:
                batches.append(next(self._iterator))
            except StopIteration:  # end of an epoch: the loader moves on to the next one
                self._iterator = iter(self.loader)
        return [self._to_device(b) for b in batches]

    def train_step(self) -> dict[str, float]:
        """One optimizer step. A step whose loss or gradient norm is not finite changes no weight
        (its row says ``"skipped": true``); the data and the schedule move on."""
        cfg = self.cfg
        start = time.perf_counter()
        micro = self._next_micro_batches()
        num_tokens = count_valid_tokens(m["labels"] for m in micro)
        lr = self.scheduler.get_last_lr()[0]
        total = self._forward_backward(micro, num_tokens)
        dist.all_reduce(total)
        grad_norm = clip_gradients(self.model, max_grad_norm=cfg.optim.max_grad_norm)
        finite = bool(torch.isfinite(total)) and bool(torch.isfinite(grad_norm))  # the same on every rank
        if finite:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        seconds = time.perf_counter() - start
        global_tokens = cfg.data.context_length * cfg.data.batch_size * len(micro) * self.dims.dp
        row = {
            "loss": total.item(),
            "lr": lr,
            "grad_norm": grad_norm.item(),
            "tokens_per_sec": global_tokens / seconds,
        }
        return row if finite else {**row, "skipped": True}

    def _forward_backward(self, micro: list[dict[str, torch.Tensor]], num_tokens: int) -> torch.Tensor:
        return forward_backward(self.model, micro, num_tokens, offload=self.cfg.model.activation_offload)

    def _peak_memory(self) -> int:
        """Peak memory of the busiest rank: CUDA allocator peak, or process peak RSS on CPU."""
        if self.device_type == "cuda":
            value = torch.cuda.max_memory_allocated()
        else:
            value = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Held-out loss, and for the passkey task the exact-match accuracy of the answer (from the
        loss's own logit chunks: no full logits either way)."""
        passkey = self.cfg.data.dataset == "passkey"
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        correct_rows = torch.zeros((), dtype=torch.float64, device=self.device)
        labels = []
        for batch in self.eval_batches:
            local = self._to_device(batch)
            loss = self.model(
                input_ids=local["input_ids"], position_ids=local["position_ids"], loss_labels=local["labels"],
                return_correct=passkey,
            )
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

    def fit(self) -> dict[str, Any]:
        """Train to ``max_steps`` (or ``num_epochs``), evaluate, checkpoint and export. Returns the
        last metrics row (with the final eval)."""
        self._check_before_start()
        self._claim_output_dir()
        self._where = "while setting up"
        try:
            return self._fit()
        except RuntimeError as error:
            if not getattr(error, "same_on_every_rank", False) and _is_collective_failure(error):
                raise CollectiveFailed(self._collective_failure_message(error)) from error
            raise
        finally:
            if getattr(self, "_lock", None) is not None:
                self._lock.close()  # releases the output_dir for the next run (also in this process)
                self._lock = None

    def _fit(self) -> dict[str, Any]:
        self.setup()
        cfg = self.cfg
        step = self._resume()
        self._iterator = iter(self.loader)
        metrics_path = os.path.join(cfg.output_dir, "metrics.jsonl")
        if self.rank == 0:
            truncate_metrics(metrics_path, step)
        self.reporter = self._build_reporter(step)
        progress = tqdm(total=self.total_steps, initial=step, disable=self.rank != 0, desc="train", unit="step")
        handlers = self._catch_stop_signals()
        try:
            row: dict[str, Any] = {}
            nonfinite: list[int] = []  # the current run of skipped steps
            saved_step = step if step > 0 else None
            while step < self.total_steps:
                self._where = f"in step {step + 1}"
                self._stop_if_signalled(step, saved_step)
                row = {"step": step + 1, **self.train_step()}
                step += 1
                progress.update(1)
                progress.set_postfix(loss=f"{row['loss']:.4f}", tok_s=f"{row['tokens_per_sec']:.0f}")
                nonfinite = nonfinite + [step] if row.get("skipped") else []
                if nonfinite:  # a skipped step is logged, never evaluated or saved
                    self._log(metrics_path, row)
                    if len(nonfinite) >= cfg.max_nonfinite_steps:
                        self._stop_nonfinite(nonfinite)
                    continue
                last = step == self.total_steps
                if (cfg.eval_every and step % cfg.eval_every == 0) or last:
                    row.update(self.evaluate())
                if step % cfg.log_every == 0 or last or "eval_loss" in row:
                    row["peak_memory_bytes"] = self._peak_memory()  # a collective: only for written rows
                    self._log(metrics_path, row)
                if (cfg.save_every and step % cfg.save_every == 0) or last:
                    self._save(step)
                    saved_step = step
        finally:
            progress.close()  # also on an error, so the bar does not garble its message
            self.reporter.close()
            for signum, handler in handlers.items():
                signal.signal(signum, handler)
        self._where = "while exporting final/"
        self.export(os.path.join(cfg.output_dir, "final"))
        if self.rank == 0:
            plot_losses(metrics_path, os.path.join(cfg.output_dir, "loss.png"))
        return row

    def _check_before_start(self) -> None:
        """What can be checked before any process group or model exists: a local model
        directory has a tokenizer, and the parallel degrees multiply to the number of
        processes (a single process, plain ``python -m`` or a notebook, asked for more is
        told how to launch them)."""
        from llama_cp.models import check_tokenizer_files

        name = os.path.expanduser(self.cfg.model.model_name)
        if self.cfg.model.model_name != "embedded" and os.path.isdir(name):
            check_tokenizer_files(name)
        world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
        p = self.cfg.parallel
        try:
            p.dims(world)
        except ValueError as error:
            if world > 1:
                raise ValueError(f"{error}: choose --dp_replicate, --dp_shard and --cp for {world} processes") from None
            needed = p.dp_replicate * max(p.dp_shard, 1) * p.cp
            raise ValueError(
                f"--cp {p.cp} --dp_shard {p.dp_shard} --dp_replicate {p.dp_replicate} need {needed} processes, "
                f"and this is one: launch with torchrun --nproc_per_node {needed} -m recipes.finetune_longctx ... "
                f"(or llama_cp.launcher.launch(cfg, nprocs={needed}) from a notebook)"
            ) from None

    def _collective_failure_message(self, error: BaseException) -> str:
        from llama_cp.checkpoint import latest_checkpoint

        saved = latest_checkpoint(self.cfg.output_dir)
        reason = " ".join(str(error).split())
        reason = reason[reason.rfind("] ") + 2:] if "] " in reason else reason  # drop gloo's source location
        return (
            f"gave up waiting for a collective {self._where} ({reason[:200]}): another rank is stuck "
            f"(stopped, hung I/O), died or lost its network; --collective_timeout is {self.cfg.collective_timeout:g} s. "
            + (f"The newest checkpoint is {saved}: resume with --resume once the faulty rank is gone"
               if saved else "No checkpoint was saved yet")
        )

    def _claim_output_dir(self) -> None:
        """One run per output_dir: refuse the checkpoints of an earlier run unless --resume or
        --overwrite, hold a lock for the run (rank 0), save the resolved config (warning on
        --resume about settings that changed)."""
        from llama_cp.checkpoint import CHECKPOINTS_DIR, complete_checkpoints

        cfg, rank = self.cfg, _global_rank()
        out = cfg.output_dir
        if rank == 0:
            try:
                os.makedirs(out, exist_ok=True)
                self._lock = _lock_output_dir(out)
            except OSError as error:  # read-only filesystem, no permission: found now, not at the first save
                raise PermissionError(
                    f"--output_dir {out} is not writable ({error.strerror or error}); choose another --output_dir"
                ) from None
        found = complete_checkpoints(out)
        if found and cfg.resume == "false":
            if not cfg.overwrite:
                raise ValueError(
                    f"--output_dir {out} holds the checkpoints of an earlier run (newest: step {found[-1][0]}); "
                    "pass --resume to continue it, --overwrite to start over (deletes its checkpoints, "
                    "metrics.jsonl and final/), or choose another --output_dir"
                )
            if rank == 0:
                import shutil

                from llama_cp.reporting import TENSORBOARD_DIR, WANDB_ID_FILE

                for name in (CHECKPOINTS_DIR, "final", TENSORBOARD_DIR):
                    shutil.rmtree(os.path.join(out, name), ignore_errors=True)
                for name in ("metrics.jsonl", "loss.png", "run_info.json", WANDB_ID_FILE):
                    if os.path.exists(os.path.join(out, name)):
                        os.remove(os.path.join(out, name))
        if rank == 0:
            saved = os.path.join(out, "config.yaml")
            if cfg.resume != "false" and os.path.exists(saved):
                for line in _changed_settings(saved, cfg):
                    self._say(f"warning: --resume with a changed setting: {line}")
            _write_atomically(saved, yaml_dump(cfg.to_dict()))

    def _resume(self) -> int:
        """Load the newest intact checkpoint when --resume asks for it; returns the step to go on from."""
        from llama_cp.checkpoint import load_checkpoint, resumable_checkpoint

        cfg = self.cfg
        if cfg.resume == "false":
            return 0
        path, skipped = resumable_checkpoint(cfg.output_dir)
        for bad, why in skipped:
            self._say(f"skipped checkpoint {bad}: {why}")
        if path is None:
            where = os.path.join(cfg.output_dir, "checkpoints")
            if cfg.resume == "true":
                raise FileNotFoundError(
                    f"--resume: no intact checkpoint under {where}"
                    f"{' (all ' + str(len(skipped)) + ' failed verification)' if skipped else ''}; "
                    "use --resume auto to start from step 0 when there is none"
                )
            self._say(f"--resume auto: no checkpoint under {where}, starting from step 0")
            return 0
        state = load_checkpoint(path, self.model, self.optimizer, scheduler=self.scheduler)
        self.loader.load_state_dict(state["extra"]["loader"])
        self._say(f"resumed from step {state['step']} ({path})")
        return state["step"]

    def _say(self, message: str) -> None:
        if _global_rank() == 0:
            tqdm.write(message)

    def _save(self, step: int) -> str:
        from llama_cp.checkpoint import save_checkpoint

        return save_checkpoint(
            self.cfg.output_dir, step, self.model, self.optimizer, scheduler=self.scheduler,
            extra={"loader": self.loader.state_dict()}, keep_last=self.cfg.keep_last,
        )

    def _catch_stop_signals(self) -> dict:
        """Record STOP_SIGNALS instead of dying on them (main thread only); returns the previous handlers."""
        self._signal = 0
        if threading.current_thread() is not threading.main_thread():
            return {}

        def record(signum, frame):
            self._signal = signum

        return {signum: signal.signal(signum, record) for signum in STOP_SIGNALS}

    def _stop_if_signalled(self, step: int, saved_step: int | None) -> None:
        """See Note [Stopping on a signal]; a collective, before every step."""
        received = torch.tensor([self._signal], dtype=torch.int64, device=self.device)
        dist.all_reduce(received, op=dist.ReduceOp.MAX)
        if not received.item():
            return
        name = signal.Signals(int(received.item())).name
        if step == 0:
            raise TrainingStopped(f"stopped by {name} before the first step: nothing to save")
        from llama_cp.checkpoint import checkpoint_dir

        path = self._save(step) if saved_step != step else checkpoint_dir(self.cfg.output_dir, step)
        raise TrainingStopped(f"stopped by {name} after step {step}: saved {path}; resume with --resume")

    def _stop_nonfinite(self, steps: list[int]) -> None:
        from llama_cp.checkpoint import latest_checkpoint

        saved = latest_checkpoint(self.cfg.output_dir)
        where = f"the newest checkpoint, {saved}, holds the last finite weights" if saved else "no checkpoint was saved"
        if self.rank == 0:  # the plot marks the skipped steps
            plot_losses(os.path.join(self.cfg.output_dir, "metrics.jsonl"), os.path.join(self.cfg.output_dir, "loss.png"))
        raise TrainingStopped(
            f"loss or gradient norm was NaN/inf at steps {steps[0]}-{steps[-1]} ({len(steps)} steps in a row, "
            f"--max_nonfinite_steps {self.cfg.max_nonfinite_steps}); those steps changed no weight, and training "
            f"stopped without saving or exporting; {where}. Lower --lr or --max_grad_norm, check the data, "
            "then resume with --resume"
        )

    def _build_reporter(self, step: int):
        """TensorBoard / W&B (``--report_to``) on rank 0, and ``run_info.json`` (the resolved
        config, versions and layout of the run) beside ``config.yaml``."""
        from llama_cp.reporting import Reporter, run_info

        info = run_info(self.cfg.to_dict(), world_size=dist.get_world_size(), device_type=self.device_type,
                        dims={"dp_replicate": self.dims.dp_replicate, "dp_shard": self.dims.dp_shard,
                              "cp": self.dims.cp}, resumed_from_step=step)
        if self.rank == 0:
            _write_atomically(os.path.join(self.cfg.output_dir, "run_info.json"), json.dumps(info, indent=1))
        report_to = [name for name in self.cfg.report_to if name != "none"]
        return Reporter(self.cfg.output_dir, report_to, run_info=info, start_step=step, enabled=self.rank == 0)

    def _log(self, path: str, row: dict[str, Any]) -> None:
        if self.rank == 0:
            self.reporter.log(row, row["step"])
            with open(path, "a") as f:
                f.write(json.dumps(row) + "\n")
            tqdm.write(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))

    def export(self, path: str) -> None:
        """``final/``: an HF model directory (full) or a peft adapter (LoRA), with the tokenizer."""
        if self.rank == 0 and os.path.exists(path):
            import shutil

            shutil.rmtree(path)  # the previous export of this output_dir
        dist.barrier()
        export_pretrained(self.model, path)
        if self.rank == 0:
            self.tokenizer.save_pretrained(path)


def parallelize_model(
    model: torch.nn.Module, cfg: TrainConfig, mesh, *, param_dtype: torch.dtype | None | str = "auto"
) -> torch.nn.Module:
    """Turn an HF causal LM (real or on the meta device) into the model the trainer runs, in
    this order: the base Linear layers in 4-bit NF4 (``--quantization 4bit``) -> LoRA adapters
    (peft, with ``--use_peft``) -> frozen weights in their storage dtype (``--frozen_dtype``)
    -> context-parallel attention over ``mesh["cp"]`` -> the chunked loss path -> tiled MLPs
    and norms (``--mlp_tile_size``, ``--norm_tile_size``) -> FSDP2 over ``dp_shard x cp`` (with
    activation checkpointing, and its inputs offloaded with ``--offload_checkpoints``).
    Returns the (possibly peft-wrapped) model."""
    from llama_cp.fsdp_wrap import cast_frozen_parameters, decoder_layers, resolve_param_dtype
    from llama_cp.tiling import apply_tiled_mlp, apply_tiled_norms

    if cfg.peft.quantization == "4bit":
        from llama_cp.quantize import quantize_model

        quantize_model(model)  # a meta model gets the shapes; load_full_weights quantizes the checkpoint
    param_dtype = resolve_param_dtype(param_dtype, mesh)
    if cfg.peft.use_peft:
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(
            r=cfg.peft.lora_r, lora_alpha=cfg.peft.lora_alpha, lora_dropout=cfg.peft.lora_dropout,
            target_modules=list(cfg.peft.lora_target_modules), task_type="CAUSAL_LM",
        )
        with warnings.catch_warnings():  # peft reads transformers' deprecated is_gradient_checkpointing
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            model = get_peft_model(model, lora)
    frozen_dtype = resolve_frozen_dtype(cfg, param_dtype)
    if frozen_dtype is not None and cast_frozen_parameters(model, frozen_dtype) and param_dtype is None:
        param_dtype = torch.float32  # compute in the trainable dtype: frozen weights are cast when gathered
    apply_context_parallel(
        model, mesh["cp"], strategy=cfg.parallel.cp_strategy, max_seq_len=cfg.data.context_length,
        document_mask=cfg.data.document_mask,
    )
    enable_chunked_loss(model, chunk_size=cfg.model.loss_chunk_size)
    if cfg.model.mlp_tile_size:
        apply_tiled_mlp(decoder_layers(model), cfg.model.mlp_tile_size)
    if cfg.model.norm_tile_size:
        apply_tiled_norms(model, decoder_layers(model), cfg.model.norm_tile_size)
    shard_model(
        model, mesh, param_dtype=param_dtype, activation_checkpointing=cfg.model.activation_checkpointing,
        offload_checkpoints=cfg.model.offload_checkpoints,
    )
    return model


def resolve_frozen_dtype(cfg: TrainConfig, compute_dtype: torch.dtype | None) -> torch.dtype | None:
    """The storage dtype of frozen weights (``--frozen_dtype``), None to keep float32: "auto" is
    bfloat16 for LoRA when the compute dtype is bf16."""
    choice = cfg.model.frozen_dtype
    if choice == "auto":
        return torch.bfloat16 if cfg.peft.use_peft and compute_dtype == torch.bfloat16 else None
    return {"float32": None, "bfloat16": torch.bfloat16}[choice]


def forward_backward(
    model: torch.nn.Module, micro_batches: list[dict[str, torch.Tensor]], num_tokens: int, *, offload: bool = False
) -> torch.Tensor:
    """Forward+backward of each (cp-sharded) micro-batch, its summed loss divided by
    ``num_tokens`` (the valid tokens of the whole step, all ranks). Returns this rank's share
    of the mean loss; gradients are accumulated (and reduce-scattered by FSDP)."""
    total = torch.zeros((), device=micro_batches[0]["input_ids"].device)
    for batch in micro_batches:
        with activation_offload(offload):
            loss = causal_lm_loss_sum(model, batch) / max(num_tokens, 1)
            loss.backward()
        total += loss.detach()
    return total


def clip_gradients(model: torch.nn.Module, *, max_grad_norm: float) -> torch.Tensor:
    """Clip the gradients to ``max_grad_norm`` (when > 0). Returns the global gradient norm
    before clipping (the same on every rank)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if max_grad_norm > 0:
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    else:
        grad_norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    return grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm


def apply_gradients(model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, max_grad_norm: float) -> torch.Tensor:
    """Clip (when ``max_grad_norm`` > 0), step, zero the gradients. Returns the global gradient
    norm before clipping."""
    grad_norm = clip_gradients(model, max_grad_norm=max_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm


def optimizer_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: list[dict[str, torch.Tensor]],
    num_tokens: int,
    *,
    max_grad_norm: float,
    offload: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step of this rank: :func:`forward_backward` then :func:`apply_gradients`.
    Returns (this rank's share of the mean loss, the gradient norm). The memory planner
    simulates exactly these two functions."""
    total = forward_backward(model, micro_batches, num_tokens, offload=offload)
    return total, apply_gradients(model, optimizer, max_grad_norm=max_grad_norm)


def _is_collective_failure(error: BaseException) -> bool:
    """Whether ``error`` is a collective that timed out or lost its peer (gloo raises
    RuntimeError, NCCL DistBackendError)."""
    text = str(error).lower()
    return isinstance(error, dist.DistBackendError) or any(
        marker in text for marker in ("timed out", "timeout", "connection closed by peer", "connection reset by peer")
    )


def _global_rank() -> int:
    """This process's rank, also before ``init_distributed`` (from torchrun's RANK)."""
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))


#: Settings that may change between a run and its --resume without a warning.
_RUN_CONTROL = {"resume", "overwrite", "max_steps", "num_epochs", "eval_every", "save_every", "keep_last",
                "log_every", "max_nonfinite_steps", "output_dir"}


def yaml_dump(values: dict[str, Any]) -> str:
    import yaml

    return yaml.safe_dump(json.loads(json.dumps(values)), sort_keys=False)  # tuples -> lists


def _changed_settings(saved_path: str, cfg: TrainConfig) -> list[str]:
    """``name: old -> new`` for every setting (outside ``_RUN_CONTROL``) that differs from the saved config."""
    import yaml

    with open(saved_path) as f:
        saved = yaml.safe_load(f) or {}
    now = yaml.safe_load(yaml_dump(cfg.to_dict()))
    flat = lambda d: {k: v for key, value in d.items() for k, v in (value.items() if isinstance(value, dict) else [(key, value)])}  # noqa: E731
    old, new = flat(saved), flat(now)
    return [f"{name}: {old.get(name)!r} -> {new[name]!r}" for name in new
            if name not in _RUN_CONTROL and old.get(name) != new[name]]


def _write_atomically(path: str, text: str) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def _lock_output_dir(path: str):
    """An exclusive lock on ``path/.lock`` held for the life of the returned file; ValueError
    naming the holder when another run has it."""
    import fcntl
    import socket

    lock = open(os.path.join(path, ".lock"), "a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "another process"
        lock.close()
        raise RuntimeError(
            f"--output_dir {path} is in use by another run ({holder}); wait for it to finish or choose "
            "another --output_dir"
        ) from None
    lock.seek(0)
    lock.truncate()
    lock.write(f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}")
    lock.flush()
    return lock


def truncate_metrics(path: str, step: int) -> None:
    """Keep only the rows of ``path`` (metrics.jsonl) up to ``step``: a run resumed from the
    checkpoint of step N rewrites the rows the crashed run logged after N (0: remove the file).
    Written to a temporary file and renamed, so a crash here never leaves a half file."""
    if not os.path.exists(path):
        return
    if step == 0:
        os.remove(path)
        return
    with open(path) as f:
        kept = [line for line in f if line.strip() and json.loads(line)["step"] <= step]
    _write_atomically(path, "".join(kept))


def plot_losses(metrics_path: str, png_path: str) -> dict[str, list]:
    """Training (and eval) loss against step, from metrics.jsonl; skipped (non-finite) steps
    are marked with a red x on the bottom edge and break the line. Returns what was drawn:
    ``{"train": [(step, loss)], "eval": [(step, loss)], "skipped": [step]}``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(metrics_path) as f:
        rows = [json.loads(line) for line in f]
    finite = lambda r: not r.get("skipped") and math.isfinite(r["loss"])  # noqa: E731
    drawn = {
        "train": [(r["step"], r["loss"]) for r in rows if finite(r)],
        "eval": [(r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r],
        "skipped": [r["step"] for r in rows if not finite(r)],
    }
    fig, ax = plt.subplots(figsize=(6, 4))
    # NaN where a step was skipped: the line breaks there instead of bridging the gap
    ax.plot([r["step"] for r in rows], [r["loss"] if finite(r) else math.nan for r in rows], label="train loss")
    if drawn["eval"]:
        ax.plot(*zip(*drawn["eval"]), "o-", label="eval loss")
    if drawn["skipped"]:
        ax.plot(drawn["skipped"], [0] * len(drawn["skipped"]), "x", color="red", markersize=8, clip_on=False,
                transform=ax.get_xaxis_transform(), label="skipped step (NaN/inf)")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return drawn


def _model_path(name: str) -> str | None:
    """The local directory of ``--model_name`` (None for "embedded"): the directory itself, or
    the hub snapshot of a hub id (downloaded when online, else from the local cache)."""
    if name == "embedded":
        return None
    if os.path.isdir(os.path.expanduser(name)):
        return os.path.expanduser(name)
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(name, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"])
    except Exception as error:  # noqa: BLE001 - offline, unknown id, gated repo: one message for all
        raise FileNotFoundError(
            f"--model_name {name!r} is not a local directory, and as a hub id it could not be fetched "
            f"({type(error).__name__}: {' '.join(str(error).split())[:300]}); pass the path of a local HF "
            "model directory"
        ) from error
