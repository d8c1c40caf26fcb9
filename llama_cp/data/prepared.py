"""Data at corpus scale: rows prepared once into Arrow files (packed on the fly from a stream
instead: ``llama_cp/data/streaming.py``).

``build_rows`` tokenizes and packs a whole dataset in every rank's memory on every
start (24 bytes per token as three int64 tensors). This module gives the same rows
without that cost, two ways:

    prepare_dataset     tokenize (``datasets.map``, ``num_proc`` processes) and pack once,
                        into ``<cache>/<key>/{train,eval}.arrow`` (Note [Prepared rows] in
                        ``llama_cp/data/row_files.py``, with their checks)
    PreparedRows        the rows of one such file, read one row at a time from disk
                        (row_files): a drop-in ``rows`` for ``DistributedRowLoader``
    load_prepared_rows  what the trainer calls: one process per node (or per job, on shared
                        storage) prepares while the others wait, then every rank opens the rows
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import socket
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import datasets
import numpy as np
import pyarrow as pa

from llama_cp.data.chat import ChatRenderError
from llama_cp.data.formats import check_objective, detect_format
from llama_cp.data.mixture import (
    DataSpec,
    documents_taken,
    mixture_line,
    mixture_order,
    bad_row,
    mixture_weights,
    skipped_rows_line,
    tokenize_row,
)
from llama_cp.data.packing import Row, RowPacker, _pad_id, truncate_document
from llama_cp.data.preference import PairPacker, PreferenceRows, tokenize_pair
from llama_cp.data.row_files import (  # noqa: F401 - PreparedRows, RowBatches: the rows read back
    DIGEST_BYTES,
    ROW_SCHEMA,
    SPLITS,
    DamagedRowsError,
    PreparedRows,
    RowBatches,
    checked_summary,
    file_checks,
    open_prepared,
    row_batch,
)
from llama_cp.data.sources import ROW_NUMBER, _quiet_datasets, is_saved_dataset, load_hub_dataset, local_files
from llama_cp.data_flags import PASSKEY, Source
from llama_cp.parallel.sharding import check_context_length

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

#: Version of the files' layout (Note [Prepared rows] in row_files.py); a change makes every cache key new.
#: 2: a checksum per row (``<split>.rowsums``) and the files' sizes in summary.json.
LAYOUT_VERSION = 2


# ----------------------------------------------------------------------------- cache key

def dataset_fingerprint(source: Source | str) -> dict[str, Any]:
    """What identifies a source's content without reading it: every local file's path, size
    and modification time; for a hub id, datasets' fingerprint of each split it loads."""
    source = Source(source) if isinstance(source, str) else source
    path = Path(source.path).expanduser()
    if path.exists():
        if is_saved_dataset(path) or source.hub_options() or path.is_dir() and (path / "README.md").exists():
            files = sorted(file for file in path.rglob("*") if file.is_file()  # not .git/ and the like
                           and not any(part.startswith(".") for part in file.relative_to(path).parts))
        else:
            files = local_files(path)[1]
        return {"files": [[str(file.absolute()), file.stat().st_size, file.stat().st_mtime_ns] for file in files]}
    loaded = load_hub_dataset(source)
    parts = loaded.items() if isinstance(loaded, datasets.DatasetDict) else [("train", loaded)]
    return {"hub": source.path, "splits": {name: part._fingerprint for name, part in parts}}


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """sha256 of the tokenizer's whole definition (vocabulary, merges, normalizer, special
    tokens) and its chat template: two tokenizers with one fingerprint encode alike."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    definition = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    extra = [type(tokenizer).__name__, tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id,
             getattr(tokenizer, "chat_template", None)]
    return hashlib.sha256((definition + json.dumps(extra, default=str)).encode()).hexdigest()


def cache_key(
    dataset: str | DataSpec, tokenizer: PreTrainedTokenizerBase, context_length: int, cp: int, truncate: bool = False,
    objective: str = "sft",
) -> dict[str, Any]:
    """Everything the prepared rows depend on; ``key_hash`` of it names their directory: the
    data flags (sources, options, weights, eval set, seed, ...) and each source's content. The
    example format (text / instruction / chat ...) is read from the files, so it changes with them.
    ``objective`` "dpo": rows of whole (chosen, rejected) pairs (Note [Packed preference pairs])."""
    spec = DataSpec(dataset) if isinstance(dataset, str) else dataset
    sources = dict.fromkeys([*spec.sources("train"), *spec.sources("eval")])
    return {
        "layout": LAYOUT_VERSION,
        "data": spec.key(),
        "dataset": [dataset_fingerprint(source) for source in sources],
        "tokenizer": {"name": getattr(tokenizer, "name_or_path", ""), "sha256": tokenizer_fingerprint(tokenizer)},
        "context_length": context_length,
        "cp": cp,
        # Note [Packed rows]: continued in the next row, positions going on; or cut at context_length
        "long_documents": "truncate" if truncate else "split",
        **({"objective": objective} if objective != "sft" else {}),  # SFT keys as before: their caches stay valid
    }


def key_hash(key: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]


def default_cache_dir() -> str:
    """``--data_cache_dir ""``: a llama_cp folder in datasets' cache (HF_DATASETS_CACHE / HF_HOME)."""
    return os.path.join(str(datasets.config.HF_DATASETS_CACHE), "llama_cp")


# ----------------------------------------------------------------------------- preparing


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
                summary[split] = _prepare_split(spec, split, tokenizer, context_length, work, num_proc, progress,
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


def _prepare_split(
    spec: DataSpec, split: str, tokenizer: PreTrainedTokenizerBase, context_length: int, work: Path, num_proc: int,
    progress: bool, truncate: bool, objective: str = "sft",
) -> dict[str, Any]:
    parts = spec.examples(split)
    tokenized, seen = [], {"formats": {}, "sources": [], "skipped_rows": 0, "bad_rows": []}
    sequence = {"ids": datasets.Sequence(datasets.Value("int32")), "mask": datasets.Sequence(datasets.Value("bool"))}
    names = [f"{column}_{part}" for column in ("chosen", "rejected") for part in ("ids", "mask")] \
        if objective == "dpo" else ["input_ids", "label_mask"]
    features = datasets.Features({
        **{name: sequence[name.rsplit("_", 1)[1]] for name in names},
        "bad": datasets.Value("string"),  # why the row was skipped (--on_bad_row skip), else null
    })
    for index, (source, examples) in enumerate(parts):
        if len(examples) == 0:  # no eval set (--eval_fraction 0): map would not apply the features
            tokenized.append(datasets.Dataset.from_dict({name: [] for name in features}, features=features))
            continue
        check_objective(detect_format(examples.column_names), objective, f"{source.flag} {source.name!r}")
        with contextlib.nullcontext() if progress else _quiet_datasets():
            part = examples.map(
                _tokenize_pair if objective == "dpo" else _tokenize,
                fn_kwargs={"tokenizer": tokenizer, "spec": spec, "source": source},
                remove_columns=examples.column_names,
                features=features,
                num_proc=num_proc if num_proc > 1 and len(examples) > 1 else None,
                cache_file_name=str(work / f"{split}-documents-{index}.arrow"),
                new_fingerprint=f"{work.name}-{split}-{index}",  # the key is ours: datasets need not hash the tokenizer
                desc=f"tokenizing {split} ({source.name})" if len(parts) > 1 else f"tokenizing {split}",
            )
        tokenized.append(part)
        bad = part.data.column("bad")
        if bad.null_count < len(bad):
            reasons = [reason for reason in bad.drop_null().to_pylist()[:3]]
            seen["skipped_rows"] += len(bad) - bad.null_count
            seen["bad_rows"] += reasons
    sizes = [len(part) for part in tokenized]
    weights = mixture_weights([source for source, _ in parts])
    order = mixture_order(sizes, weights, spec.seed)
    for (source, examples), size, used in zip(parts, sizes, documents_taken(order, sizes)):
        kind = detect_format(examples.column_names) if len(examples) else "none"
        seen["formats"][kind] = seen["formats"].get(kind, 0) + used
        seen["sources"].append({"name": source.name, "documents": size, "used": used})
    documents = datasets.concatenate_datasets(tokenized) if len(tokenized) > 1 else tokenized[0]
    if weights is not None:
        documents = documents.select(order)
    if objective == "dpo":
        return _pack_pairs_split(documents, split, seen, context_length, tokenizer, work, progress, truncate, spec)
    packer = RowPacker(context_length, _pad_id(tokenizer))
    truncated = 0
    bar = _progress_bar(progress, len(documents), f"packing {split}")
    with _RowFile(work, split) as row_file:
        waiting = None  # a row is written once the next one (its next_id) is known

        def write(row: Row | None) -> None:
            nonlocal waiting
            if waiting is not None:
                row_file.write(waiting, _pad_id(tokenizer) if row is None else int(row["input_ids"][0]))
            waiting = row

        for batch in documents.with_format("arrow").iter(batch_size=256):
            ids, masks = batch.column("input_ids"), batch.column("label_mask")
            for index in range(batch.num_rows):
                document = (ids[index].values.to_numpy().astype(np.int64), masks[index].values.to_numpy(zero_copy_only=False))
                if truncate and len(document[0]) > context_length:
                    document, truncated = truncate_document(document, context_length), truncated + 1
                for row, _ in packer.add(document):
                    write(row)
            bar.update(batch.num_rows)
        for row, _ in packer.finish():
            write(row)
        write(None)
    bar.close()
    if not packer.trainable and not (split == "eval" and len(documents) == 0):  # no eval set: an empty file
        raise ValueError(
            f"--dataset {spec.dataset!r} ({split} split): no usable text: the documents hold no trainable token "
            f"(every label would be -100){_skipped_rows(seen)}"
        )
    del documents, tokenized
    return _finish_split(work, split, seen, row_file.rows, context_length, packer.tokens,
                         split_documents=packer.split_documents, truncated_documents=truncated)


class _RowFile:
    """``<split>.arrow`` (as ``.arrow.tmp`` until ``_finish_split``) and ``<split>.rowsums`` being
    written, one row and its digest at a time (Note [Prepared rows]); ``rows`` counts them."""

    def __init__(self, work: Path, split: str):
        self.work, self.split, self.rows = work, split, 0

    def __enter__(self) -> "_RowFile":
        self._files = contextlib.ExitStack()
        sink = self._files.enter_context(pa.OSFile(str(self.work / f"{self.split}.arrow.tmp"), "wb"))
        self._writer = self._files.enter_context(pa.ipc.new_file(sink, ROW_SCHEMA))
        self._rowsums = self._files.enter_context(open(self.work / f"{self.split}.rowsums", "wb"))
        return self

    def write(self, row: Row, next_id: int) -> None:
        batch, digest = row_batch(row, next_id)
        self._writer.write_batch(batch)
        self._rowsums.write(digest)
        self.rows += 1

    def __exit__(self, *error) -> None:
        self._files.__exit__(*error)


def _skipped_rows(seen: dict[str, Any]) -> str:
    """"; skipped ..." for a split's error message when rows were skipped (--on_bad_row skip), else ""."""
    if not seen["skipped_rows"]:
        return ""
    return f"; {skipped_rows_line(seen['skipped_rows'], sum(x['documents'] for x in seen['sources']), seen['bad_rows'])}"


def _finish_split(work: Path, split: str, seen: dict[str, Any], rows: int, context_length: int, tokens: int,
                  **counts: int) -> dict[str, Any]:
    """Put the split's rows file in place, drop its tokenized documents, and return its summary."""
    os.rename(work / f"{split}.arrow.tmp", work / f"{split}.arrow")
    for leftover in work.glob(f"{split}-documents*"):
        leftover.unlink()
    padding = rows * context_length - tokens
    return {
        **seen, "documents": sum(source["used"] for source in seen["sources"]), "rows": rows, "tokens": tokens,
        "padding_fraction": round(padding / max(1, rows * context_length), 6), **counts,
    }


def _pack_pairs_split(
    pairs: datasets.Dataset, split: str, seen: dict[str, Any], context_length: int,
    tokenizer: PreTrainedTokenizerBase, work: Path, progress: bool, truncate: bool, spec: DataSpec,
) -> dict[str, Any]:
    """Pack the tokenized pairs of ``split`` (Note [Packed preference pairs]) into ``work/<split>.arrow``
    and its rowsums, in the layout of SFT rows (Note [Prepared rows]): a pair's two sequences
    are two segments, so ``sequences_of_row`` finds them again on reading."""
    packer = PairPacker(context_length, _pad_id(tokenizer), truncate)
    bar = _progress_bar(progress, len(pairs), f"packing {split}")
    with _RowFile(work, split) as row_file:
        def write(done: list[Row]) -> None:
            for row in done:  # no label crosses a row of pairs: the next row's first token is never needed
                row_file.write(row, _pad_id(tokenizer))

        for batch in pairs.with_format("arrow").iter(batch_size=256):
            columns = [batch.column(name) for name in ("chosen_ids", "chosen_mask", "rejected_ids", "rejected_mask")]
            for index in range(batch.num_rows):
                ids, mask, rejected_ids, rejected_mask = (
                    column[index].values.to_numpy(zero_copy_only=False).tolist() for column in columns)
                if ids:  # a skipped row (--on_bad_row skip) is empty
                    write(packer.add(((ids, mask), (rejected_ids, rejected_mask))))
            bar.update(batch.num_rows)
        write(packer.finish())
    bar.close()
    if row_file.rows == 0 and split == "train":
        raise ValueError(f"--dataset {spec.dataset!r} ({split} split): no preference pairs to train on"
                         f"{_skipped_rows(seen)}")
    del pairs
    return _finish_split(work, split, seen, row_file.rows, context_length, packer.tokens, split_documents=0,
                         truncated_documents=packer.truncated, pairs=packer.pairs)


def _progress_bar(enabled: bool, total: int, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="doc", disable=not enabled)


def _tokenize(example: Mapping[str, Any], tokenizer: PreTrainedTokenizerBase, spec: DataSpec,
              source: Source) -> dict[str, Any]:
    where = f"row {example.get(ROW_NUMBER)} of {source.flag} {source.name!r}"
    (input_ids, label_mask), reason = tokenize_row(example, tokenizer, where, spec)
    return {"input_ids": input_ids, "label_mask": label_mask, "bad": reason}


def _tokenize_pair(example: Mapping[str, Any], tokenizer: PreTrainedTokenizerBase, spec: DataSpec,
                   source: Source) -> dict[str, Any]:
    """One preference example as its (chosen, rejected) sequences; empty ones and the reason for a
    row that cannot be made into a pair under --on_bad_row skip (as ``tokenize_row`` does)."""
    try:
        (ids, mask), (rejected_ids, rejected_mask) = tokenize_pair(example, tokenizer)
        reason = None
    except ChatRenderError as error:
        reason = bad_row(error, f"row {example.get(ROW_NUMBER)} of {source.flag} {source.name!r}", spec)
        ids, mask, rejected_ids, rejected_mask = [], [], [], []
    return {"chosen_ids": ids, "chosen_mask": mask, "rejected_ids": rejected_ids, "rejected_mask": rejected_mask,
            "bad": reason}


def summary_lines(summary: Mapping[str, Any], context_length: int) -> list[str]:
    """What the prepared rows hold, per split: documents and their formats, rows, tokens,
    padding, documents split or truncated, a mixture's share of each source, skipped rows."""
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
