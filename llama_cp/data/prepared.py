"""Data at corpus scale: rows prepared once into Arrow files (packed on the fly from a stream
instead: ``llama_cp/data/streaming.py``).

``build_rows`` tokenizes and packs a whole dataset in every rank's memory on every
start (24 bytes per token as three int64 tensors). This module gives the same rows
without that cost, two ways:

    prepare_dataset     tokenize (``datasets.map``, ``num_proc`` processes) and pack once
                        (split_rows), into ``<cache>/<key>/{train,eval}.arrow`` (the key:
                        cache_key; Note [Prepared rows] in ``llama_cp/data/row_files.py``,
                        with their checks)
    PreparedRows        the rows of one such file, read one row at a time from disk
                        (row_files): a drop-in ``rows`` for ``DistributedRowLoader``
    load_prepared_rows  what the trainer calls: one process per node (or per job, on shared
                        storage) prepares while the others wait, then every rank opens the rows
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import shutil
import socket
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llama_cp.data.cache_key import cache_key, default_cache_dir, key_hash
from llama_cp.data.grammar import PASSKEY, Source
from llama_cp.data.mixture import DataSpec, mixture_line, skipped_rows_line
from llama_cp.data.preference import PreferenceRows
from llama_cp.data.row_files import (  # noqa: F401 - PreparedRows, RowBatches: the rows read back
    SPLITS,
    DamagedRowsError,
    PreparedRows,
    RowBatches,
    checked_summary,
    file_checks,
    open_prepared,
)
from llama_cp.data.split_rows import prepare_split
from llama_cp.parallel.sharding import check_context_length

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def prepare_dataset(
    dataset: str | DataSpec,
    tokenizer: PreTrainedTokenizerBase,
    context_length: int,
    cp: int = 1,
    cache_dir: str = "",
    num_proc: int = 1,
    progress: bool = False,
    truncate: bool = False,
    say=print,
    objective: str = "sft",
) -> tuple[Path, dict[str, Any]]:
    """Tokenize and pack both splits of ``dataset`` into ``cache_dir`` unless they are there.

    Returns (the directory, its summary: per split documents, rows, tokens, padding
    fraction, documents split over rows; ``"reused": True`` when nothing was done).
    The rows are those of ``build_rows(dataset, ..., split=..., truncate=...)``, in the same order;
    with ``objective`` "dpo" those of ``pack_pairs`` on the examples' pairs.
    One preparer per key at a time on a node (Note [One preparer per key]); a directory
    that fails the checks of Note [Prepared rows] is moved aside and prepared anew, and
    ``say`` is told.
    """
    spec = DataSpec(dataset) if isinstance(dataset, str) else dataset
    if spec.dataset == PASSKEY:
        raise ValueError("--dataset passkey is generated from the seed at start (fast): there is nothing to prepare")
    check_context_length(context_length, cp)
    key = cache_key(spec, tokenizer, context_length, cp, truncate, objective)
    root = Path(cache_dir or default_cache_dir()).expanduser()
    final = root / key_hash(key)
    with contextlib.suppress(DamagedRowsError):  # looked at again under the lock
        if (summary := checked_summary(final)) is not None:
            return final, {**summary, "reused": True}
    root.mkdir(parents=True, exist_ok=True)
    temporary = f".{final.name}.tmp-{_host()}-"
    with _exclusive(root / f".{final.name}.lock", say) as locked:
        try:
            if (summary := checked_summary(final)) is not None:  # another preparer made them while we waited
                return final, {**summary, "reused": True}
        except DamagedRowsError as damage:
            _remove_aside(final, temporary)
            say(f"prepared rows {final}: {damage.problem}: removed, preparing anew")
        if locked:  # left by a preparer of this key on this node that was killed (none is running now)
            for stale in root.iterdir():
                if stale.name.startswith(temporary):
                    shutil.rmtree(stale, ignore_errors=True)
        work = Path(tempfile.mkdtemp(prefix=temporary, dir=root))
        try:
            summary = {"dataset": spec.dataset, "key": key}
            for split in SPLITS:
                summary[split] = prepare_split(spec, split, tokenizer, context_length, work, num_proc, progress,
                                               truncate, objective)
            summary["checks"] = {split: file_checks(work, split) for split in SPLITS}
            (work / "summary.json").write_text(json.dumps(summary, indent=1))
            try:
                os.rename(work, final)
            except OSError:  # another node finished first (shared storage): its rows are the same
                if not (final / "summary.json").exists():
                    raise
                shutil.rmtree(work, ignore_errors=True)
        except BaseException:
            shutil.rmtree(work, ignore_errors=True)
            raise
    return final, {**summary, "reused": False}


# Note [One preparer per key]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Two jobs on a node with one --data_cache_dir and one key would each tokenize
# everything; the rows are the same, so the second one should wait and reuse.
# An advisory lock (flock) on <root>/.<key>.lock orders them:
#
#   job A: check -- lock -- check: none -- write .<key>.tmp-<host>-XXXX -- rename to <key> -- unlock
#   job B: check -- lock ......................(waits)..................................... -- check: reuse
#
# The rename into place stays: a preparer killed mid-write leaves a temporary
# directory, never a <key> that looks complete. Whoever holds the lock next removes
# this node's temporaries of the key (.<key>.tmp-<host>-*: no other preparer of the
# key runs on this node while it holds the lock; other nodes' temporaries on shared
# storage are left alone, their preparers may be alive). The lock file is removed
# on release, so the cache holds only prepared directories; a waiter whose lock file
# was removed under it locks the new one instead (the inode check in _exclusive).
# Where the file system refuses locks the preparers go on unlocked, as before the
# lock: the rename still keeps the directory whole, only the work may be done twice.


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", socket.gethostname()) or "host"


@contextlib.contextmanager
def _exclusive(path: Path, say=print):
    """Hold an exclusive flock on ``path`` (made, and removed on release; Note [One preparer per key]).
    Yields whether the lock is held: False where the file system refuses locks."""
    told = False
    while True:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CREAT, 0o666)
        except OSError:  # e.g. a read-only or foreign cache root: unlocked
            yield False
            return
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if not told:
                    say(f"waiting for another preparer of {path.parent / path.name[1:].removesuffix('.lock')} "
                        f"(it holds {path})")
                told = True
                fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as error:
            os.close(fd)
            if error.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                yield False
                return
            raise
        try:
            same = os.path.samestat(os.stat(path), os.fstat(fd))
        except FileNotFoundError:  # the holder before us removed it on release
            same = False
        if same:
            break
        os.close(fd)
    try:
        yield True
    finally:
        with contextlib.suppress(OSError):  # gone, or not ours to remove: harmless either way
            os.unlink(path)  # while still held: a waiter on this file sees it gone and retries
        os.close(fd)


def _remove_aside(final: Path, temporary: str) -> None:
    """Rename ``final`` out of the way (at once: its name is free for the new rows), then delete it."""
    aside = Path(tempfile.mkdtemp(prefix=f"{temporary}damaged-", dir=final.parent))
    try:
        os.rename(final, aside / final.name)
    except FileNotFoundError:  # moved already, by a preparer on another node
        pass
    shutil.rmtree(aside, ignore_errors=True)



def summary_lines(summary: Mapping[str, Any], context_length: int) -> list[str]:
    """What the prepared rows hold, per split: documents and their formats, rows, tokens,
    padding, documents split or truncated, rows with no scored token (prepared before they were
    counted: not said), a mixture's share of each source, skipped rows."""
    lines = []
    for split in SPLITS:
        s = summary[split]
        formats = ", ".join(f"{kind} {count}" for kind, count in s.get("formats", {}).items())
        pairs = "pairs" in s  # --objective dpo: whole pairs in rows, none split
        lines.append(
            f"{split}: {s['documents']} {'pairs' if pairs else 'documents'} ({formats}) -> {s['rows']} rows of "
            f"{context_length} tokens, {s['tokens']} tokens, padding {100 * s['padding_fraction']:.2f}%, "
            + (f"{s['truncated_documents']} pairs truncated" if pairs else
               f"{s['split_documents']} documents split over rows, {s['truncated_documents']} truncated")
            + (f", {s['unscored_rows']} rows with no scored token (prompt tokens only: nothing to learn or score; "
               "a longer --context_length keeps prompts with their completions)" if s.get("unscored_rows") else "")
        )
        sources = s.get("sources", [])
        if len(sources) > 1:
            lines.append(mixture_line(split, [Source(x["name"]) for x in sources], [x["used"] for x in sources],
                                      [x["documents"] for x in sources]))
        if s.get("skipped_rows"):
            lines.append(f"{split}: " + skipped_rows_line(s["skipped_rows"], sum(x["documents"] for x in sources),
                                                          s["bad_rows"]))
    return lines


def load_prepared_rows(
    dataset: str | DataSpec,
    tokenizer: PreTrainedTokenizerBase,
    context_length: int,
    cp: int,
    cache_dir: str = "",
    shared: bool = False,
    num_proc: int = 1,
    say=print,
    truncate: bool = False,
    objective: str = "sft",
) -> tuple[PreparedRows, PreparedRows]:
    """(train, eval) rows of ``dataset`` (a ``--dataset`` value or a :class:`DataSpec`), prepared
    on first use, their summary said on rank 0: by local rank 0 of each node,
    or by global rank 0 alone when ``shared`` (one cache directory every node sees), while
    the other ranks wait; an error there is raised on every rank with the same message.
    ``objective`` "dpo": rows of pairs, read as :class:`PreferenceRows`."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    preparer = rank == 0 if shared else int(os.environ.get("LOCAL_RANK", rank)) == 0
    failure, directory = None, None
    if preparer:
        try:
            directory, summary = prepare_dataset(dataset, tokenizer, context_length, cp, cache_dir, num_proc,
                                                 progress=rank == 0, truncate=truncate, say=say, objective=objective)
            if rank == 0:
                say(f"{'prepared rows reused' if summary['reused'] else 'prepared'}: {directory}")
                for line in summary_lines(summary, context_length):  # the packing summary, as prepare_data prints it
                    say(line)
        except Exception as error:  # told to the other ranks before it is raised here
            failure = error
    if dist.is_initialized() and dist.get_world_size() > 1:
        messages: list = [None] * dist.get_world_size()
        dist.all_gather_object(messages, None if failure is None else str(failure))  # also the waiting barrier
        told = next((message for message in messages if message is not None), None)
    else:
        told = None if failure is None else str(failure)
    if failure is not None:
        raise failure
    if told is not None:
        raise ValueError(told)
    if directory is None:
        root = Path(cache_dir or default_cache_dir()).expanduser()
        directory = root / key_hash(cache_key(dataset, tokenizer, context_length, cp, truncate, objective))
    train, evaluation = open_prepared(directory, "train"), open_prepared(directory, "eval")
    if objective == "dpo":
        return PreferenceRows(train), PreferenceRows(evaluation)
    return train, evaluation
