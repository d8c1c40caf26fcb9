"""A checkpoint or an export that cannot be written (a full disk, a lost mount): every rank
raises the same :class:`WriteFailed`, nothing half-written is kept, and the message says why and
what is still safe."""

from __future__ import annotations

import errno
import os
import shutil

import torch.distributed as dist

from llama_cp.train.checkpoint_files import latest_checkpoint


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
    chain = errors_behind(error)
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


def errors_behind(error: BaseException | None) -> list[BaseException]:
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


def fail_together(failure: BaseException | None, what: str, tmp: str, output_dir: str) -> None:
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

