"""DPO's reference log-probabilities for a full fine-tune: computed once, before training, from the
initial weights, and kept (TRL's ``precompute_ref_log_probs``). With --use_peft there is nothing to
keep: the reference is the same model with its adapters switched off (``adapters_off_logps``).

Note [Reference log-probabilities computed once]
================================================

DPO compares the policy with the model it started from. A full fine-tune changes every weight, so
the reference would be a second copy of the model, as large as the one being trained. Instead
the reference's per-sequence sums, two floats per pair, are computed in one forward pass over
every training and eval row before the first step (the model still holds its initial weights,
also in a resumed run: setup builds it before the checkpoint is loaded) and stored:

    <prepared rows directory>/reference/<key>.npz     values (S,) float64: each sequence's sum,
                                                      in row order; offsets (R + 1,): row r's
                                                      sequences are values[offsets[r]:offsets[r+1]]

<key> is a hash of what the sums depend on: the model (its directory's weight files by name, size
and modification time, or the embedded model's seed), RoPE settings, compute dtype and the
prepared rows' directory; not the parallel layout or the attention kernel, which change them by
rounding only. Computing them is one forward (no gradient) over every training pair. A later run
on the same data and model (another --lr, a resume, a restart after a crash) reads them instead
of computing them; the file is written under a temporary name and renamed, so a half-written
one never loads. The built-in passkey task's rows
are generated at start and have no directory: their reference is computed at every start
(a few seconds).

Each dp rank computes its share of the rows (a cp group together), padded to whole batches so that
every rank runs the same forwards (FSDP's collectives), and the shares are gathered over dp. The
stored file is read only when every rank finds it (nodes without shared storage each keep their
own; one that lacks it makes all compute), and a rank that cannot write it says so and goes on. The
sums are those of ``policy_logps`` in training, so a pair's reference and policy agree exactly at
step 0 (rewards 0, loss log 2), as TRL's precomputed reference does.
"""

from __future__ import annotations

import hashlib
import json
import os
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

from llama_cp.data.preference import PAIR_COUNT, REFERENCE_LOGPS, ROW_INDEX, batch_sequences
from llama_cp.model.preference import policy_logps


class ReferenceLogps:
    """The reference sums of one split's rows (Note [Reference log-probabilities computed once])."""

    def __init__(self, values: np.ndarray, offsets: np.ndarray):
        self.values, self.offsets = values, offsets

    def for_rows(self, row_index: torch.Tensor) -> torch.Tensor:
        """(2P,) float64: the sums of the rows ``row_index`` (B,), in batch order (as ``batch_sequences``
        numbers them)."""
        rows = row_index.reshape(-1).tolist()
        missing = [r for r in rows if self.offsets[r] == self.offsets[r + 1]]
        if missing:  # a row outside those computed: its pairs would be scored against nothing
            raise RuntimeError(f"no reference log-probabilities for rows {missing[:5]} (computed for other rows)")
        return torch.from_numpy(np.concatenate([self.values[self.offsets[r]:self.offsets[r + 1]] for r in rows]))

    def add_to(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``batch`` with its rows' ``reference_logps``."""
        return {**batch, REFERENCE_LOGPS: self.for_rows(batch[ROW_INDEX])}


def reference_key(model_path: str | None, seed: int, settings: dict[str, Any], rows_directory: str | None) -> str:
    """The hash naming a stored reference: the model's weights (files by name, size, mtime; the
    embedded model by its seed), the settings that change its outputs, and the rows."""
    path = Path(model_path) if model_path else None  # None: the embedded model
    if path is not None and path.is_dir():
        files = sorted(f for f in path.iterdir() if f.is_file() and f.suffix in (".safetensors", ".bin", ".json"))
        model = [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files]
    else:
        model = [str(model_path), seed]
    key = {"model": model, "settings": settings, "rows": str(rows_directory)}
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:24]


def compute_reference(
    model: torch.nn.Module, rows: Sequence, batch_size: int, dp_group, dp_rank: int, dp_size: int,
    to_device: Callable[[dict], dict], cp_group, desc: str, progress: bool, indices: Sequence[int] | None = None,
) -> ReferenceLogps:
    """The sums of the rows ``indices`` (default: all) of ``rows`` (``PreferenceRows``) under
    ``model`` as it is now, on every rank: each dp rank's share in batches of ``batch_size`` (the
    last padded with the first row, dropped), sharded over cp by ``to_device``, gathered over
    ``dp_group``. Rows not in ``indices`` have no sums."""
    wanted = list(range(len(rows))) if indices is None else list(indices)
    per_step = batch_size * dp_size
    steps = -(-len(wanted) // per_step)
    mine: dict[int, list[float]] = {}
    with torch.no_grad():  # the training mode as in a step: the sums equal the policy's at step 0
        for step in tqdm(range(steps), desc=desc, unit="batch", disable=not progress):
            first = step * per_step + dp_rank * batch_size
            places = list(range(first, first + batch_size))
            read = [rows[wanted[i] if i < len(wanted) else wanted[0]] for i in places]
            batch = batch_sequences({key: torch.stack([row[key] for row in read]) for key in read[0]})
            sums = policy_logps(model, to_device(batch), cp_group).double().cpu()
            start = 0
            for place, row in zip(places, read):
                count = 2 * int(row[PAIR_COUNT])
                if place < len(wanted):
                    mine[wanted[place]] = sums[start:start + count].tolist()
                start += count
    shares: list = [None] * dp_size
    if dp_size > 1:
        dist.all_gather_object(shares, mine, group=dp_group)
    else:
        shares = [mine]
    merged = {index: values for share in shares for index, values in share.items()}
    counts = [len(merged.get(index, ())) for index in range(len(rows))]
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    values = np.array([value for index in range(len(rows)) for value in merged.get(index, ())], dtype=np.float64)
    return ReferenceLogps(values, offsets)


def load_reference(path: Path, rows: int) -> ReferenceLogps | None:
    """The stored sums at ``path`` when they are there and cover ``rows`` rows, else None."""
    try:
        with np.load(path) as stored:
            values, offsets = stored["values"], stored["offsets"]
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile):  # absent, or damaged: computed anew
        return None
    if len(offsets) != rows + 1 or offsets[-1] != len(values):
        return None
    return ReferenceLogps(values, offsets)


def save_reference(path: Path, reference: ReferenceLogps) -> None:
    """Write under a temporary name, then rename (several nodes may write the same file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}-{os.urandom(4).hex()}.npz")
    np.savez(temporary, values=reference.values, offsets=reference.offsets)
    os.replace(temporary, path)
