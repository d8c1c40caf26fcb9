"""The output directory of a run: one run at a time (a lock), its resolved config, its
metrics rows and the loss plot. Files are written to a temporary name and renamed.
"""

from __future__ import annotations

import json
import math
import os
import time
from typing import Any

from llama_cp.config import TrainConfig


def yaml_dump(values: dict[str, Any]) -> str:
    import yaml

    return yaml.safe_dump(json.loads(json.dumps(values)), sort_keys=False)  # tuples -> lists


#: Settings that may change between a run and its --resume without a warning.
RUN_CONTROL = {"resume", "overwrite", "max_steps", "num_epochs", "eval_every", "save_every", "keep_last",
               "log_every", "max_nonfinite_steps", "output_dir", "collective_timeout", "report_to"}


def changed_settings(saved_path: str, cfg: TrainConfig) -> list[str]:
    """``name: old -> new`` for every setting (outside ``RUN_CONTROL``) that differs from the saved config."""
    import yaml

    with open(saved_path) as f:
        saved = yaml.safe_load(f) or {}
    now = yaml.safe_load(yaml_dump(cfg.to_dict()))
    flat = lambda d: {k: v for key, value in d.items() for k, v in (value.items() if isinstance(value, dict) else [(key, value)])}  # noqa: E731
    old, new = flat(saved), flat(now)
    return [f"{name}: {old.get(name)!r} -> {new[name]!r}" for name in new
            if name not in RUN_CONTROL and old.get(name) != new[name]]


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
