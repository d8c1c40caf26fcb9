"""Training checkpoints with ``torch.distributed.checkpoint`` (DCP): save, find the newest, resume.

One checkpoint per saved step, every rank writing only its own shards::

    output_dir/checkpoints/
      step_00000200/            complete: resume from here
        .metadata, __*_*.distcp     DCP: model (adapter only under peft) + optimizer, sharded
        trainer_state.pt            rank 0: step, scheduler state, ``extra`` (data position)
        config.yaml                 rank 0: the run's resolved config (what --resume compares with)
        rng_rank{r}.pt              rank r: python / numpy / torch (CPU, CUDA) RNG states
        MANIFEST.json               size and sha256 of every file above
        COMPLETE                    written last: the checkpoint is whole
      step_00000300/
      .tmp-step_00000400/       being written (or left by a crash): never read

Note [Atomic checkpoints]: every rank writes into ``.tmp-step_N``; after a
barrier (all files written) rank 0 writes ``COMPLETE`` and renames the
directory to ``step_N``. A rename within one directory is atomic, so a
``step_N`` directory is either absent or whole; ``latest_checkpoint`` also
requires the marker, and pruning removes the marker before the files, so an
interrupted deletion never looks complete either.

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

DCP loads in place into the model's (FSDP2-sharded) state, so a checkpoint can
be resumed on another sharding of the same model.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import re
import shutil
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from llama_cp.optim.optimizers import DECAYS


try:
    import numpy as np
except ImportError:  # numpy is optional: its RNG is saved only when it is installed
    np = None

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
    """Whether ``path`` is a finished checkpoint (see Note [Atomic checkpoints])."""
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


# ---------------------------------------------------------------- model + optimizer state
def _is_peft(model: nn.Module) -> bool:
    return hasattr(model, "peft_config")


def _state_dict_options(model: nn.Module) -> StateDictOptions:
    # Under peft only the trainable parameters (adapters and modules_to_save) are saved:
    # the frozen base weights come from the pretrained model, not from the checkpoint.
    # Loading that subset needs strict=False in load_state_dict; load_checkpoint checks
    # the subset itself, and dcp.load already fails on any key the checkpoint lacks.
    peft = _is_peft(model)
    return StateDictOptions(ignore_frozen_params=peft, strict=not peft)


def _per_rank_optimizer(optimizer: torch.optim.Optimizer) -> bool:
    """Optimizers whose state is not in DTensor form (``llama_cp.optim.optimizers.ShardLocalOptimizer``):
    each rank saves its own, in ``optimizer_rank{r}.pt``."""
    return getattr(optimizer, "per_rank_state", False)


def _optimizer_file(path: str, rank: int) -> str:
    return os.path.join(path, f"optimizer_rank{rank}.pt")


def _training_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Model and optimizer state keyed by canonical parameter names, tensors sharded as in training."""
    if _per_rank_optimizer(optimizer):
        return {"model": get_model_state_dict(model, options=_state_dict_options(model))}
    model_state, optimizer_state = get_state_dict(model, optimizer, options=_state_dict_options(model))
    return {"model": model_state, "optimizer": optimizer_state}


# ---------------------------------------------------------------- RNG
def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if np is not None:
        name, key, pos, has_gauss, gauss = np.random.get_state()
        state["numpy"] = (name, torch.from_numpy(key.astype(np.int64)), pos, has_gauss, gauss)
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()  # this rank's device
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if np is not None and "numpy" in state:
        name, key, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((name, key.numpy().astype(np.uint32), pos, has_gauss, gauss))
    if torch.cuda.is_available() and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])


def _rng_file(path: str, rank: int) -> str:
    return os.path.join(path, f"rng_rank{rank}.pt")


# ---------------------------------------------------------------- save
def save_checkpoint(
    output_dir: str,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    extra: dict | None = None,
    config: dict | None = None,
    keep_last: int | None = None,
) -> str:
    """Save the training state after ``step`` to ``output_dir/checkpoints/step_{step:08d}``.

    Call on every rank; ``output_dir`` must be one directory for all of them (a shared
    filesystem across nodes). Saves the model (only the trainable parameters under peft),
    the optimizer, and from rank 0 the step, ``scheduler.state_dict()`` and
    ``extra`` (plain data: dicts, lists, numbers, strings, tensors; e.g. the data
    loader position) and ``config`` (the run's settings, as ``config.yaml``, read back by
    ``checkpoint_config``); each rank saves its own RNG states. The directory appears
    only once whole (Note [Atomic checkpoints]); an existing checkpoint of the
    same step is replaced. ``keep_last``: then delete all but the newest
    ``keep_last`` complete checkpoints, never the one just written. Returns its path.
    """
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 or None (keep all), got {keep_last}")
    rank = dist.get_rank()
    final = checkpoint_dir(output_dir, step)
    parent, name = os.path.split(final)
    tmp = os.path.join(parent, TMP_PREFIX + name)
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # left by an interrupted save of this step
        os.makedirs(tmp)
    dist.barrier()  # the directory exists before any rank writes into it

    failure = None
    try:
        dcp.save(_training_state(model, optimizer), checkpoint_id=tmp)
        torch.save(_rng_state(), _rng_file(tmp, rank))
        if _per_rank_optimizer(optimizer):
            torch.save(optimizer.state_dict(), _optimizer_file(tmp, rank))
        if rank == 0:
            trainer_state = {
                "step": step,
                "scheduler": scheduler.state_dict() if scheduler is not None else None,
                "extra": extra,
            }
            torch.save(trainer_state, os.path.join(tmp, TRAINER_STATE_FILE))
            if config is not None:
                with open(os.path.join(tmp, CONFIG_FILE), "w") as f:
                    f.write(yaml_dump(config))
    except (Exception, CheckpointException) as error:  # noqa: BLE001 - a full disk, a lost mount: tell every rank
        failure = error  # (DCP's CheckpointException is a BaseException)
    # every rank's files are written, or the ranks fail together (no rank left in a barrier)
    _fail_together(failure, f"saving the checkpoint of step {step}", tmp, output_dir)
    _write_manifest(tmp)

    if rank == 0:
        with open(os.path.join(tmp, COMPLETE_MARKER), "w") as f:
            json.dump({"step": step, "world_size": dist.get_world_size()}, f)
            f.flush()
            os.fsync(f.fileno())
        if os.path.exists(final):
            _remove_checkpoint(final)
        os.rename(tmp, final)
        if keep_last is not None:
            older = [path for _, path in complete_checkpoints(output_dir) if path != final]
            # the newest keep_last - 1 others stay, with the one just written
            for path in older[: max(len(older) - (keep_last - 1), 0)]:
                _remove_checkpoint(path)
    dist.barrier()  # no rank returns (and maybe resumes) before the checkpoint is in place
    return final


class WriteFailed(OSError):
    """Writing a checkpoint or an export failed (e.g. a full disk); raised on every rank, nothing half-written kept."""

    same_on_every_rank = True


#: Free bytes under which a failed write is put down to a full filesystem.
_NEARLY_FULL = 64 << 20


def describe_write_failure(error: BaseException | None, what: str, directory: str, output_dir: str) -> str:
    """One paragraph on why ``what`` (writing into ``directory``) failed: a full filesystem
    when the error says so or almost nothing is free (torch's writer reports ENOSPC as
    "unexpected pos"), else the error itself; and what is still safe."""
    try:
        free = shutil.disk_usage(directory if os.path.exists(directory) else output_dir).free
    except OSError:
        free = None
    chain = _errors_behind(error)
    reason = _root_reason(chain) if chain else "another rank failed to write"
    full = any(getattr(e, "errno", None) == errno.ENOSPC for e in chain) or "no space left" in reason.lower() or (
        free is not None and free < _NEARLY_FULL
    )
    if full:
        reason = f"the filesystem is full ({(free or 0) / (1 << 20):.1f} MiB free; the writer said: {reason})"
    newest = latest_checkpoint(output_dir)
    kept = f"the newest checkpoint, {newest}, is intact" if newest else "no earlier checkpoint exists"
    fix = "free space, lower --keep_last or choose another --output_dir" if full else "fix the cause"
    return f"{what} in {directory} failed: {reason}. Nothing of it was kept; {kept}. {fix.capitalize()}, then --resume"


def _errors_behind(error: BaseException | None) -> list[BaseException]:
    """``error``, then what it wraps: causes, contexts, and the per-rank errors of DCP's
    CheckpointException (whose own text is a traceback per rank)."""
    found: list[BaseException] = []
    todo = [error]
    while todo:
        current = todo.pop(0)
        if current is None or any(current is seen for seen in found):
            continue
        found.append(current)
        wrapped = [f[0] for f in getattr(current, "failures", {}).values() if isinstance(f, tuple) and f]
        todo += [*wrapped, current.__cause__, current.__context__]
    return found


def _root_reason(chain: list[BaseException]) -> str:
    """One line saying why a write failed: the operating system's error when there is one
    ("[Errno 28] No space left on device"), else the innermost error's text without
    torch's "[enforce fail at file:line]" prefix."""
    system = [e for e in chain if isinstance(e, OSError) and e.strerror]
    root = system[0] if system else next((e for e in reversed(chain) if not hasattr(e, "failures")), chain[-1])
    text = " ".join(str(root).split()) if not hasattr(root, "failures") else ""
    text = text.split("] . ", 1)[1] if text.startswith("[enforce fail at ") and "] . " in text else text
    return text[:300] or type(root).__name__


def _fail_together(failure: BaseException | None, what: str, tmp: str, output_dir: str) -> None:
    """A collective: when ``failure`` happened on any rank, rank 0 removes the half-written
    ``tmp`` and every rank raises :class:`WriteFailed` with one message."""
    message = describe_write_failure(failure, what, tmp, output_dir) if failure is not None else None
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, message)  # works with gloo and NCCL alike
    if all(m is None for m in gathered):
        return
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    dist.barrier()
    raise WriteFailed(next(m for m in gathered if m is not None))


def _file_digest(path: str) -> dict[str, Any]:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 24):  # 16 MiB at a time (hashlib.file_digest needs Python 3.11)
            digest.update(block)
    return {"bytes": os.path.getsize(path), "sha256": digest.hexdigest()}


def _share(names: list[str]) -> list[str]:
    """This rank's share of ``names`` (the same sorted list on every rank)."""
    return names[dist.get_rank() :: dist.get_world_size()]


def _write_manifest(path: str) -> None:
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


def _remove_checkpoint(path: str) -> None:
    """Delete a checkpoint, marker first, so a partial deletion never looks complete."""
    marker = os.path.join(path, COMPLETE_MARKER)
    if os.path.exists(marker):
        os.remove(marker)
    shutil.rmtree(path)


# ---------------------------------------------------------------- load
def load_checkpoint(
    path: str,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
) -> dict[str, Any]:
    """Restore a checkpoint written by ``save_checkpoint`` in place; call on every rank.

    Loads the model (under peft: exactly the trainable parameters), the optimizer,
    the scheduler and this rank's RNG states. ``model`` may be sharded with
    ``shard_model``: each rank reads only its shards, also when the checkpoint was
    saved with another sharding (the RNG states then stay as they are, with a warning).
    Returns ``{"step": ..., "extra": ...}``.
    """
    if not os.path.isdir(path):
        raise FileNotFoundError(f"no checkpoint at {path!r}")
    if not is_complete(path):
        raise ValueError(
            f"checkpoint {path!r} is incomplete (no {COMPLETE_MARKER} marker): its save was "
            f"interrupted; resume from latest_checkpoint(output_dir) instead"
        )

    state = _training_state(model, optimizer)
    try:
        dcp.load(state, checkpoint_id=path)  # in place; fails on any key the checkpoint lacks
    except (Exception, CheckpointException) as error:  # DCP's is a BaseException
        if any("param_groups" in str(e) and DECAYS in str(e) for e in _errors_behind(error)):
            raise ValueError(
                f"checkpoint {path!r} was saved before the optimizer kept norms, biases and embeddings out of weight "
                "decay (two parameter groups, issue 35): its optimizer state cannot be resumed. Start a new run from its "
                "weights: python -m recipes.export --checkpoint PATH --output_dir DIR, then --model_name DIR"
            ) from None
        raise
    if _per_rank_optimizer(optimizer):
        with open(os.path.join(path, COMPLETE_MARKER)) as f:
            saved_world = json.load(f)["world_size"]
        if saved_world != dist.get_world_size():
            raise ValueError(
                f"checkpoint {path!r} holds per-rank optimizer state of {saved_world} ranks; resume it "
                f"with the same world size and degrees (now {dist.get_world_size()}) or with --optimizer adamw"
            )
        loaded = set_model_state_dict(model, state["model"], options=_state_dict_options(model))
        optimizer.load_state_dict(torch.load(_optimizer_file(path, dist.get_rank()), weights_only=True))
    else:
        loaded = set_state_dict(
            model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
            options=_state_dict_options(model),
        )
    not_loaded = set(loaded.missing_keys) & set(state["model"])
    if loaded.unexpected_keys or not_loaded:
        raise RuntimeError(
            f"checkpoint {path!r} does not match the model: unexpected {sorted(loaded.unexpected_keys)[:5]}, "
            f"not loaded {sorted(not_loaded)[:5]}"
        )

    trainer_state = torch.load(os.path.join(path, TRAINER_STATE_FILE), weights_only=True)
    if scheduler is not None:
        if trainer_state["scheduler"] is None:
            raise ValueError(f"checkpoint {path!r} has no scheduler state, but a scheduler was given")
        scheduler.load_state_dict(trainer_state["scheduler"])

    rng_file = _rng_file(path, dist.get_rank())
    if os.path.isfile(rng_file):
        _set_rng_state(torch.load(rng_file, weights_only=True))
    else:
        warnings.warn(
            f"{rng_file!r} is missing (saved with a smaller world size?): RNG states not restored",
            stacklevel=2,
        )
    return {"step": trainer_state["step"], "extra": trainer_state["extra"]}
