"""The output directory of a run: one run at a time (a lock), its resolved config, its
metrics rows and the loss plot. Files are written to a temporary name and renamed.
"""

from __future__ import annotations

import json
import math
import os
import time
from typing import Any

import yaml

from llama_cp.config import TrainConfig


def yaml_dump(values: dict[str, Any]) -> str:
    return yaml.safe_dump(json.loads(json.dumps(values)), sort_keys=False)  # tuples -> lists


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
    # the update
    "lr", "warmup_steps", "lr_scheduler", "min_lr_ratio", "weight_decay", "max_grad_norm", "lora_dropout",
    # how the same step is computed
    "dtype", "frozen_dtype", "activation_checkpointing", "activation_offload", "offload_checkpoints",
    "loss_chunk_size", "mlp_tile_size", "norm_tile_size", "dp_replicate", "dp_shard", "cp", "cp_strategy",
}

_DATA = "the data order and what one step trains on would change mid-run"
_STATE = "the checkpoint holds another model or optimizer state"
#: Settings a --resume may not change, and why.
RESUME_REFUSES = {
    "dataset": _DATA, "context_length": _DATA, "batch_size": _DATA, "gradient_accumulation_steps": _DATA,
    "seed": _DATA, "num_passkey_samples": _DATA, "document_mask": _DATA, "streaming": _DATA,
    "truncate_documents": _DATA,
    "model_name": _STATE, "use_peft": _STATE, "lora_r": _STATE, "lora_alpha": _STATE,
    "lora_target_modules": _STATE, "quantization": _STATE, "optimizer": _STATE,
    "rope_theta": _STATE, "rope_scaling": _STATE,
}


def _flat(config: dict[str, Any]) -> dict[str, Any]:
    """The leaves of a nested config dict, by name (every leaf name is unique)."""
    leaves = (value.items() if isinstance(value, dict) else [(key, value)] for key, value in config.items())
    return {name: value for section in leaves for name, value in section}


def _shown(value: Any) -> str:
    """A value as it is written on the command line."""
    return ",".join(map(str, value)) if isinstance(value, list) else str(value)


def check_resume_settings(saved: dict[str, Any], cfg: TrainConfig, where: str) -> list[str]:
    """Compare the config ``saved`` (of the checkpoints in ``where``) with ``cfg`` (Note
    [Changing settings on resume]): ValueError, one line, when a setting changed that a
    resume may not change; else ``name: old -> new`` of every setting that changed and
    takes effect (run control excepted)."""
    old, new = _flat(saved), _flat(yaml.safe_load(yaml_dump(cfg.to_dict())))
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


def write_atomically(path: str, text: str) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


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
    write_atomically(path, "".join(kept))


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
