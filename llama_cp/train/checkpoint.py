"""Training checkpoints with ``torch.distributed.checkpoint`` (DCP): save a run's state, load it to resume.

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

DCP loads in place into the model's (FSDP2-sharded) state, so a checkpoint can
be resumed on another sharding of the same model. Finding the checkpoints of a run and
verifying their files (Note [Verified checkpoints]): ``llama_cp.train.checkpoint_files``;
a save that fails on any rank: ``llama_cp.train.write_failures``.
"""

from __future__ import annotations

import json
import os
import random
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
from llama_cp.train.checkpoint_files import (
    COMPLETE_MARKER,
    CONFIG_FILE,
    TMP_PREFIX,
    TRAINER_STATE_FILE,
    checkpoint_dir,
    complete_checkpoints,
    is_complete,
    remove_checkpoint,
    write_manifest,
    yaml_dump,
)
from llama_cp.train.write_failures import errors_behind, fail_together


try:
    import numpy as np
except ImportError:  # numpy is optional: its RNG is saved only when it is installed
    np = None


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
    fail_together(failure, f"saving the checkpoint of step {step}", tmp, output_dir)
    write_manifest(tmp)

    if rank == 0:
        with open(os.path.join(tmp, COMPLETE_MARKER), "w") as f:
            json.dump({"step": step, "world_size": dist.get_world_size()}, f)
            f.flush()
            os.fsync(f.fileno())
        if os.path.exists(final):
            remove_checkpoint(final)
        os.rename(tmp, final)
        if keep_last is not None:
            older = [path for _, path in complete_checkpoints(output_dir) if path != final]
            # the newest keep_last - 1 others stay, with the one just written
            for path in older[: max(len(older) - (keep_last - 1), 0)]:
                remove_checkpoint(path)
    dist.barrier()  # no rank returns (and maybe resumes) before the checkpoint is in place
    return final


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
        if any("param_groups" in str(e) and DECAYS in str(e) for e in errors_behind(error)):
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
