"""The output directory of a run: claiming it (one run at a time, under a lock; an earlier
run's artefacts refused or cleared; a --resume's settings compared with its checkpoints'),
its resolved config, its metrics rows and the loss plot. Files are written to a temporary
name and renamed.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from typing import Any

import yaml

from llama_cp.config import TrainConfig
from llama_cp.files import write_text
from llama_cp.train.checkpoint_files import CHECKPOINTS_DIR, checkpoint_config, complete_checkpoints, yaml_dump


# Note [Changing settings on resume]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Every checkpoint records the run's config (checkpoint.CONFIG_FILE). A --resume
# compares it with its own flags before anything is built, and a setting either
#
#   takes effect from the resumed step on   the learning rate is a pure function of
#                                           (step, --lr, --warmup_steps, --lr_scheduler,
#                                           --min_lr_ratio, max steps): the trainer rebuilds
#                                           the schedule at the resumed step instead of
#                                           restoring the old one, and writes --weight_decay
#                                           into the loaded optimizer's param groups;
#                                           --max_grad_norm is read every step; memory levers,
#                                           dtype and the parallel layout compute the same step;
#   or is refused, in one line              what a step trains on or what the checkpoint
#                                           holds would change under the run (RESUME_REFUSES).
#
# A setting in neither table is refused too, so a new flag is safe until it is placed.

#: Settings a --resume may change; they take effect from the resumed step on.
RESUME_MAY_CHANGE = {
    # driving the run
    "resume", "overwrite", "allow_unverified_checkpoint", "max_steps", "num_epochs", "eval_every", "save_every",
    "keep_last", "log_every", "max_nonfinite_steps", "output_dir", "collective_timeout", "report_to",
    "num_eval_samples", "data_cache_dir", "data_cache_shared", "num_proc", "peak_tflops", "eval_needle",
    "eval_perplexity", "export_dtype", "merge_lora", "export_gguf",
    # the update
    "lr", "warmup_steps", "lr_scheduler", "min_lr_ratio", "weight_decay", "max_grad_norm", "lora_dropout",
    "dpo_beta", "simpo_gamma",
    # how the same step is computed
    "dtype", "frozen_dtype", "activation_checkpointing", "activation_offload", "offload_checkpoints", "offload_params",
    "loss_chunk_size", "compile", "mlp_tile_size", "norm_tile_size", "attention_block_size", "dp_replicate", "dp_shard", "cp",
    "cp_strategy",
    # which levers a run takes (--memory auto may choose others on other GPUs): each is exact
    "memory", "gpu_memory_gb", "headroom",
}

_DATA = "the data order and what one step trains on would change mid-run"
_STATE = "the checkpoint holds another model or optimizer state"
#: Settings a --resume may not change, and why.
RESUME_REFUSES = {
    "dataset": _DATA, "context_length": _DATA, "batch_size": _DATA, "gradient_accumulation_steps": _DATA,
    "seed": _DATA, "num_passkey_samples": _DATA, "document_mask": _DATA, "streaming": _DATA,
    "truncate_documents": _DATA, "chat_template": _DATA, "dataset_columns": _DATA, "eval_dataset": _DATA,
    "eval_fraction": _DATA, "on_bad_row": _DATA, "objective": _DATA,
    "dpo_loss": "the loss would change mid-run (and with it whether a reference model is used)",
    "model_name": _STATE, "use_peft": _STATE, "lora_r": _STATE, "lora_alpha": _STATE,
    "lora_target_modules": _STATE, "quantization": _STATE, "optimizer": _STATE,
    "lora_modules_to_save": _STATE, "use_rslora": _STATE, "use_dora": _STATE,
    "rope_theta": _STATE, "rope_scaling": _STATE,
}


def _shown(value: Any) -> str:
    """A value as it is written on the command line."""
    return ",".join(map(str, value)) if isinstance(value, list) else str(value)


def check_resume_settings(saved: dict[str, Any], cfg: TrainConfig, where: str) -> list[str]:
    """Compare the config ``saved`` (of the checkpoints in ``where``) with ``cfg`` (Note
    [Changing settings on resume]): ValueError, one line, when a setting changed that a
    resume may not change; else ``name: old -> new`` of every setting that changed and
    takes effect (run control excepted)."""
    old, new = TrainConfig.flatten(saved), TrainConfig.flatten(yaml.safe_load(yaml_dump(cfg.to_dict())))
    changed = [name for name in new if name in old and old[name] != new[name]]
    refused = [name for name in changed if name not in RESUME_MAY_CHANGE]
    if refused:
        reasons = sorted({RESUME_REFUSES.get(name, "it is not one a resume may change") for name in refused})
        raise ValueError(
            "--resume cannot change "
            + ", ".join(f"--{name} ({_shown(old[name])} -> {_shown(new[name])})" for name in refused)
            + f": {'; '.join(reasons)}. Resume with "
            + " ".join(f"--{name} {_shown(old[name])}" for name in refused)
            + f" as the checkpoints in {where} were trained, or start a new run (--overwrite or another --output_dir)"
        )
    quiet = {"resume", "overwrite", "allow_unverified_checkpoint", "output_dir"}
    return [f"{name}: {old[name]!r} -> {new[name]!r}" for name in changed if name not in quiet]


def lock_output_dir(path: str):
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


class OutputDirClaim:
    """One run's hold on its output_dir: :meth:`claim` it, :meth:`leave_as_found` when the run
    fails while setting up, :meth:`release` at the end. Made before the claim: rank 0 records
    what the directory held then (``found``)."""

    def __init__(self, cfg: TrainConfig, rank: int):
        self.cfg, self.rank = cfg, rank
        self.lock = None  # rank 0's lock_output_dir while the run holds the directory
        self.found = self._before() if rank == 0 else None

    def _before(self) -> dict[str, Any]:
        """Whether output_dir and its .lock existed, and the text of its config.yaml (None: none)."""
        out = self.cfg.output_dir
        config = os.path.join(out, "config.yaml")
        text = None
        if os.path.isfile(config):
            with open(config) as f:
                text = f.read()
        return {"dir": os.path.isdir(out), "lock": os.path.exists(os.path.join(out, ".lock")), "config": text}

    def claim(self, say: Callable[[str], None]) -> None:
        """One run per output_dir: refuse an earlier run's artefacts unless --resume or
        --overwrite (which deletes them), hold a lock for the run (rank 0), compare a --resume's
        settings with those of the newest checkpoint (Note [Changing settings on resume]; its
        changes are passed to ``say``), save the resolved config."""
        from llama_cp.train.reporting import TENSORBOARD_DIR, WANDB_ID_FILE

        cfg, rank = self.cfg, self.rank
        out = cfg.output_dir
        if rank == 0:
            try:
                os.makedirs(out, exist_ok=True)
                self.lock = lock_output_dir(out)
            except OSError as error:  # read-only filesystem, no permission: found now, not at the first save
                raise PermissionError(
                    f"--output_dir {out} is not writable ({error.strerror or error}); choose another --output_dir"
                ) from None
        found = complete_checkpoints(out)
        if cfg.resume == "false":
            earlier = [f"checkpoints up to step {found[-1][0]}"] if found else []
            earlier += [name for name in ("final/", "metrics.jsonl", TENSORBOARD_DIR + "/", "loss.png")
                        if os.path.exists(os.path.join(out, name))]
            if earlier and not cfg.overwrite:
                raise ValueError(
                    f"--output_dir {out} holds an earlier run ({', '.join(earlier)}); pass --resume to continue it, "
                    "--overwrite to start over (deletes them), or choose another --output_dir"
                )
            if earlier and rank == 0:
                import shutil

                for name in (CHECKPOINTS_DIR, "final", TENSORBOARD_DIR):
                    shutil.rmtree(os.path.join(out, name), ignore_errors=True)
                for name in ("metrics.jsonl", "loss.png", "run_info.json", WANDB_ID_FILE):
                    if os.path.exists(os.path.join(out, name)):
                        os.remove(os.path.join(out, name))
        else:
            # the newest recorded config; every rank compares (a checkpoint never changes), so all refuse together
            saved = next((c for c in (checkpoint_config(path) for _, path in reversed(found)) if c is not None), None)
            for line in check_resume_settings(saved, cfg, os.path.join(out, CHECKPOINTS_DIR)) if saved else []:
                say(f"--resume with a changed setting, in effect from the resumed step on: {line}")
        if rank == 0:
            write_text(os.path.join(out, "config.yaml"), yaml_dump(cfg.to_dict()))

    def leave_as_found(self) -> None:
        """A run that fails before its first step (bad data, model or flags found while setting
        up) takes back what it wrote into output_dir: config.yaml, .lock, the directory itself.
        Rank 0 only; a failure to do so is ignored (the error being raised is the one to report)."""
        found = self.found
        if found is None:
            return
        try:
            out = self.cfg.output_dir
            config = os.path.join(out, "config.yaml")
            if found["config"] is None:
                if os.path.exists(config):
                    os.remove(config)
            elif os.path.isfile(config):
                write_text(config, found["config"])
            if not found["lock"] and os.path.exists(os.path.join(out, ".lock")):
                os.remove(os.path.join(out, ".lock"))
            if not found["dir"]:
                try:
                    os.rmdir(out)  # only when nothing else is in it
                except OSError:
                    pass
        except OSError:
            pass

    def release(self) -> None:
        """Release the output_dir for the next run (also in this process)."""
        if self.lock is not None:
            self.lock.close()
            self.lock = None


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
    write_text(path, "".join(kept))


def plot_losses(metrics_path: str, png_path: str) -> dict[str, list]:
    """Training (and eval) loss against step, from metrics.jsonl; skipped (non-finite) steps
    are marked with a red x on the bottom edge and break the line. Returns what was drawn:
    ``{"train": [(step, loss)], "eval": [(step, loss)], "skipped": [step]}``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(metrics_path) as f:
        rows = [json.loads(line) for line in f]
    # a row's loss is null where none of its steps had a scored token: not drawn, not a skipped step
    finite = lambda r: not r.get("skipped") and r["loss"] is not None and math.isfinite(r["loss"])  # noqa: E731
    drawn = {
        "train": [(r["step"], r["loss"]) for r in rows if finite(r)],
        "eval": [(r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r],
        "skipped": [r["step"] for r in rows if r.get("skipped")],
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
