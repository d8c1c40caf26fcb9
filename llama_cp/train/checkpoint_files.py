"""The files of a checkpoint directory: where each step's checkpoint lives, which ones are
complete, the run's config they record, and whether their files are intact (the manifest).

The layout and how a checkpoint becomes complete: ``llama_cp/train/checkpoint.py`` (Note
[Atomic checkpoints]).

Note [Verified checkpoints]: a whole checkpoint can still be damaged later (a
truncated copy, a deleted file, flipped bits on a disk). Before the marker,
the ranks hash the files (each a share of them) into ``MANIFEST.json``;
``verify_checkpoint`` checks every file's size and sha256 against it (again
shared over the ranks), and ``resumable_checkpoint`` takes the newest
checkpoint that verifies, reporting the ones it skipped and why. A file the
manifest does not list fails verification too (nothing unverified is read), and
a checkpoint without a manifest is refused unless the caller allows unverified
checkpoints (``--allow_unverified_checkpoint``). The manifest detects damage,
not an attacker: whoever can write a checkpoint can write its manifest, and
``dcp.load`` unpickles ``.metadata``, so a checkpoint is trusted input (resume
only from checkpoints you or your jobs wrote).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from typing import Any

import torch.distributed as dist

CHECKPOINTS_DIR = "checkpoints"
COMPLETE_MARKER = "COMPLETE"
CONFIG_FILE = "config.yaml"
MANIFEST_FILE = "MANIFEST.json"
TRAINER_STATE_FILE = "trainer_state.pt"
TMP_PREFIX = ".tmp-"
_STEP_DIR = re.compile(r"step_(\d+)")


def checkpoint_dir(output_dir: str, step: int) -> str:
    """Where the checkpoint of ``step`` lives: ``output_dir/checkpoints/step_{step:08d}``."""
    return os.path.join(output_dir, CHECKPOINTS_DIR, f"step_{step:08d}")


def is_complete(path: str) -> bool:
    """Whether ``path`` is a finished checkpoint (Note [Atomic checkpoints] in llama_cp/train/checkpoint.py)."""
    return os.path.isfile(os.path.join(path, COMPLETE_MARKER))


def step_directories(output_dir: str) -> list[tuple[int, str]]:
    """``(step, path)`` of every ``step_N`` directory under ``output_dir``, complete or not, oldest first."""
    root = os.path.join(output_dir, CHECKPOINTS_DIR)
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        match = _STEP_DIR.fullmatch(name)  # ".tmp-step_..." does not match
        if match and os.path.isdir(os.path.join(root, name)):
            found.append((int(match.group(1)), os.path.join(root, name)))
    return sorted(found)


def complete_checkpoints(output_dir: str) -> list[tuple[int, str]]:
    """``(step, path)`` of every complete checkpoint under ``output_dir``, oldest first."""
    return [(step, path) for step, path in step_directories(output_dir) if is_complete(path)]


def checkpoint_config(path: str) -> dict[str, Any] | None:
    """The config (nested dict) the run that wrote checkpoint ``path`` had, or None when the
    checkpoint does not record it (written before checkpoints did) or it is unreadable."""
    import yaml

    try:
        with open(os.path.join(path, CONFIG_FILE)) as f:
            config = yaml.safe_load(f)
    except (OSError, yaml.YAMLError):
        return None
    return config if isinstance(config, dict) else None


def yaml_dump(values: dict[str, Any]) -> str:
    """``values`` as YAML in their own order, tuples as lists: the text of a config.yaml."""
    import yaml

    return yaml.safe_dump(json.loads(json.dumps(values)), sort_keys=False)  # tuples -> lists


def latest_checkpoint(output_dir: str) -> str | None:
    """The complete checkpoint with the highest step under ``output_dir``, or None."""
    found = complete_checkpoints(output_dir)
    return found[-1][1] if found else None


def remove_checkpoint(path: str) -> None:
    """Delete a checkpoint, marker first, so a partial deletion never looks complete."""
    marker = os.path.join(path, COMPLETE_MARKER)
    if os.path.exists(marker):
        os.remove(marker)
    shutil.rmtree(path)


# ---------------------------------------------------------------- manifest
def _file_digest(path: str) -> dict[str, Any]:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 24):  # 16 MiB at a time (hashlib.file_digest needs Python 3.11)
            digest.update(block)
    return {"bytes": os.path.getsize(path), "sha256": digest.hexdigest()}


def _share(names: list[str]) -> list[str]:
    """This rank's share of ``names`` (the same sorted list on every rank)."""
    return names[dist.get_rank() :: dist.get_world_size()]


def write_manifest(path: str) -> None:
    """Every rank hashes its share of the checkpoint's files; rank 0 writes ``MANIFEST.json``
    (Note [Verified checkpoints])."""
    names = sorted(name for name in os.listdir(path) if name not in (MANIFEST_FILE, COMPLETE_MARKER))
    mine = {name: _file_digest(os.path.join(path, name)) for name in _share(names)}
    shares: list[dict] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(shares, mine)
    if dist.get_rank() == 0:
        files = {name: entry for share in shares for name, entry in share.items()}
        with open(os.path.join(path, MANIFEST_FILE), "w") as f:
            json.dump({"files": dict(sorted(files.items()))}, f, indent=1)
            f.flush()
            os.fsync(f.fileno())


class UnverifiedCheckpoint(ValueError):
    """The checkpoint to resume from has no manifest, and unverified checkpoints are not allowed."""

    same_on_every_rank = True


def verify_checkpoint(path: str) -> str | None:
    """None if every file of the complete checkpoint ``path`` has the size and sha256 its
    manifest records and no other file is there, else why not (the same answer on every
    rank; call on every rank). A checkpoint without a manifest passes here (only its marker
    is checked): ``resumable_checkpoint`` decides whether it may be loaded."""
    problem = None
    if not is_complete(path):
        problem = f"no {COMPLETE_MARKER} marker (its save was interrupted, or it is being deleted)"
    elif os.path.isfile(os.path.join(path, MANIFEST_FILE)):
        try:
            with open(os.path.join(path, MANIFEST_FILE)) as f:
                files = json.load(f)["files"]
        except (OSError, ValueError, KeyError) as error:
            files, problem = {}, f"unreadable {MANIFEST_FILE} ({error})"
        unlisted = sorted(set(os.listdir(path)) - set(files) - {MANIFEST_FILE, COMPLETE_MARKER})
        if unlisted and not problem:
            problem = f"it holds files its {MANIFEST_FILE} does not list ({', '.join(unlisted[:5])})"
        for name in _share(sorted(files)) if not problem else []:
            file = os.path.join(path, name)
            if not os.path.isfile(file):
                problem = f"{name} is missing"
            elif os.path.getsize(file) != files[name]["bytes"]:
                problem = f"{name} has {os.path.getsize(file)} bytes, the manifest says {files[name]['bytes']} (truncated?)"
            elif _file_digest(file)["sha256"] != files[name]["sha256"]:
                problem = f"{name} does not match its sha256 in the manifest (corrupted)"
            if problem:
                break
    problems: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(problems, problem)
    return next((p for p in problems if p), None)


def resumable_checkpoint(
    output_dir: str, *, allow_unverified: bool = False
) -> tuple[str | None, list[tuple[str, str]]]:
    """The newest checkpoint under ``output_dir`` that verifies (``verify_checkpoint``), and the
    ``(path, reason)`` of every newer ``step_N`` directory skipped (damaged, or without its
    ``COMPLETE`` marker); call on every rank. The newest whole checkpoint without a manifest
    raises :class:`UnverifiedCheckpoint` unless ``allow_unverified``."""
    skipped = []
    for _, path in reversed(step_directories(output_dir)):
        problem = verify_checkpoint(path)
        if problem is None:
            if not allow_unverified and not os.path.isfile(os.path.join(path, MANIFEST_FILE)):
                raise UnverifiedCheckpoint(
                    f"--resume: checkpoint {path} has no {MANIFEST_FILE}, so its files cannot be verified (written "
                    "before manifests existed, or the manifest was deleted); pass --allow_unverified_checkpoint to "
                    "load it anyway, or delete it to resume from an older checkpoint"
                )
            return path, skipped
        skipped.append((path, problem))
    return None, skipped

