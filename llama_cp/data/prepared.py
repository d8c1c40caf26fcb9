"""Data at corpus scale: rows prepared once into Arrow files (packed on the fly from a stream
instead: ``llama_cp/data/streaming.py``).

``build_rows`` tokenizes and packs a whole dataset in every rank's memory on every
start (24 bytes per token as three int64 tensors). This module gives the same rows
without that cost, two ways:

    prepare_dataset     tokenize (``datasets.map``, ``num_proc`` processes) and pack once,
                        into ``<cache>/<key>/{train,eval}.arrow`` (Note [Prepared rows])
    PreparedRows        the rows of one such file, read one row at a time from disk:
                        a drop-in ``rows`` for ``DistributedRowLoader``
    load_prepared_rows  what the trainer calls: one process per node (or per job, on shared
                        storage) prepares while the others wait, then every rank opens the rows
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import datasets
import numpy as np
import pyarrow as pa
import torch

from llama_cp.config import PASSKEY
from llama_cp.data.formats import detect_format, tokenize_example
from llama_cp.data.packing import Row, RowPacker, _pad_id, truncate_document
from llama_cp.data.sources import _quiet_datasets, load_examples, load_hub_dataset, local_files
from llama_cp.model.loss import IGNORE_INDEX
from llama_cp.parallel.sharding import check_context_length

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

#: Version of the files' layout (Note [Prepared rows]); a change makes every cache key new.
LAYOUT_VERSION = 1
SPLITS = ("train", "eval")


# ----------------------------------------------------------------------------- cache key

# Note [Prepared rows]
# ~~~~~~~~~~~~~~~~~~~~
# One Arrow IPC *file* per split, one record batch per packed row, read back with
# positioned reads (not a memory map, so a rank's resident memory holds only the
# rows it is using, whatever the file's size). A row of L tokens is stored as
#
#   input_ids          int32[L]   the tokens (vocabularies < 2^31)
#   target             bool[L]    labels[t] != -100 (one bit per token in Arrow)
#   next_id            int32      the first token of the next row (or pad)
#   segment_starts     int32[S]   where position_ids jump: 0 and every document start
#   segment_positions  int32[S]   position_ids at those indices
#
# ~4.2 bytes per token instead of 24, and the three tensors of Note [Packed rows]
# come back exactly: labels = where(target, input_ids shifted left by one with
# next_id appended, -100), since a trained label is always the next token of the
# same document, which may start the next row; position_ids go up by one from
# each segment start. The directory is named by a hash of everything the rows
# depend on (cache_key); it is written under a temporary name and renamed.


def dataset_fingerprint(dataset: str) -> dict[str, Any]:
    """What identifies ``--dataset``'s content without reading it: every local file's path,
    size and modification time; for a hub id, datasets' fingerprint of each split."""
    path = Path(dataset).expanduser()
    if path.exists():
        if path.is_dir() and ((path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists()):
            files = sorted(file for file in path.rglob("*") if file.is_file())
        else:
            files = local_files(path)[1]
        return {"files": [[str(file.absolute()), file.stat().st_size, file.stat().st_mtime_ns] for file in files]}
    loaded = load_hub_dataset(dataset)
    parts = loaded.items() if isinstance(loaded, datasets.DatasetDict) else [("train", loaded)]
    return {"hub": dataset, "splits": {name: part._fingerprint for name, part in parts}}


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """sha256 of the tokenizer's whole definition (vocabulary, merges, normalizer, special
    tokens) and its chat template: two tokenizers with one fingerprint encode alike."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    definition = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    extra = [type(tokenizer).__name__, tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id,
             getattr(tokenizer, "chat_template", None)]
    return hashlib.sha256((definition + json.dumps(extra, default=str)).encode()).hexdigest()


def cache_key(
    dataset: str, tokenizer: PreTrainedTokenizerBase, context_length: int, cp: int, truncate: bool = False
) -> dict[str, Any]:
    """Everything the prepared rows depend on; ``key_hash`` of it names their directory. The
    example format (text / instruction / chat) is read from the files, so it changes with them."""
    return {
        "layout": LAYOUT_VERSION,
        "dataset": dataset_fingerprint(dataset),
        "tokenizer": {"name": getattr(tokenizer, "name_or_path", ""), "sha256": tokenizer_fingerprint(tokenizer)},
        "context_length": context_length,
        "cp": cp,
        # Note [Packed rows]: continued in the next row, positions going on; or cut at context_length
        "long_documents": "truncate" if truncate else "split",
    }


def key_hash(key: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]


def default_cache_dir() -> str:
    """``--data_cache_dir ""``: a llama_cp folder in datasets' cache (HF_DATASETS_CACHE / HF_HOME)."""
    return os.path.join(str(datasets.config.HF_DATASETS_CACHE), "llama_cp")


# ----------------------------------------------------------------------------- preparing


def prepare_dataset(
    dataset: str,
    tokenizer: PreTrainedTokenizerBase,
    context_length: int,
    cp: int = 1,
    cache_dir: str = "",
    num_proc: int = 1,
    progress: bool = False,
    truncate: bool = False,
) -> tuple[Path, dict[str, Any]]:
    """Tokenize and pack both splits of ``dataset`` into ``cache_dir`` unless they are there.

    Returns (the directory, its summary: per split documents, rows, tokens, padding
    fraction, documents split over rows; ``"reused": True`` when nothing was done).
    The rows are those of ``build_rows(dataset, ..., split=..., truncate=...)``, in the same order.
    """
    if dataset == PASSKEY:
        raise ValueError("--dataset passkey is generated from the seed at start (fast): there is nothing to prepare")
    check_context_length(context_length, cp)
    key = cache_key(dataset, tokenizer, context_length, cp, truncate)
    root = Path(cache_dir or default_cache_dir()).expanduser()
    final = root / key_hash(key)
    if (final / "summary.json").exists():
        return final, {**json.loads((final / "summary.json").read_text()), "reused": True}
    root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=root))
    try:
        summary = {"dataset": dataset, "key": key}
        for split in SPLITS:
            summary[split] = _prepare_split(dataset, split, tokenizer, context_length, work, num_proc, progress,
                                            truncate)
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


def _prepare_split(
    dataset: str, split: str, tokenizer: PreTrainedTokenizerBase, context_length: int, work: Path, num_proc: int,
    progress: bool, truncate: bool,
) -> dict[str, Any]:
    examples = load_examples(dataset, split)
    with contextlib.nullcontext() if progress else _quiet_datasets():
        documents = examples.map(
            _tokenize,
            fn_kwargs={"tokenizer": tokenizer},
            remove_columns=examples.column_names,
            features=datasets.Features(
                {"input_ids": datasets.Sequence(datasets.Value("int32")), "label_mask": datasets.Sequence(datasets.Value("bool"))}
            ),
            num_proc=num_proc if num_proc > 1 else None,
            cache_file_name=str(work / f"{split}-documents.arrow"),
            new_fingerprint=f"{work.name}-{split}",  # the key is ours: datasets need not hash the tokenizer
            desc=f"tokenizing {split}",
        )
    packer = RowPacker(context_length, _pad_id(tokenizer))
    rows = truncated = 0
    bar = _progress_bar(progress, len(documents), f"packing {split}")
    with pa.OSFile(str(work / f"{split}.arrow.tmp"), "wb") as sink, \
            pa.ipc.new_file(sink, ROW_SCHEMA) as writer:
        waiting = None  # a row is written once the next one (its next_id) is known

        def write(row: Row | None) -> None:
            nonlocal waiting, rows
            if waiting is not None:
                next_id = _pad_id(tokenizer) if row is None else int(row["input_ids"][0])
                writer.write_batch(_row_batch(waiting, next_id))
                rows += 1
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
    if not packer.trainable:
        raise ValueError(
            f"--dataset {dataset!r} ({split} split): no usable text: the documents hold no trainable token "
            "(every label would be -100)"
        )
    os.rename(work / f"{split}.arrow.tmp", work / f"{split}.arrow")
    del documents
    for leftover in work.glob(f"{split}-documents*"):
        leftover.unlink()
    padding = rows * context_length - packer.tokens
    return {
        "documents": len(examples), "rows": rows, "tokens": packer.tokens,
        "padding_fraction": round(padding / max(1, rows * context_length), 6),
        "split_documents": packer.split_documents, "truncated_documents": truncated,
    }


def _progress_bar(enabled: bool, total: int, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="doc", disable=not enabled)


def _tokenize(example: Mapping[str, Any], tokenizer: PreTrainedTokenizerBase) -> dict[str, list]:
    input_ids, label_mask = tokenize_example(example, tokenizer)
    return {"input_ids": input_ids, "label_mask": label_mask}


ROW_SCHEMA = pa.schema([
    ("input_ids", pa.list_(pa.int32())),
    ("target", pa.list_(pa.bool_())),
    ("next_id", pa.int32()),
    ("segment_starts", pa.list_(pa.int32())),
    ("segment_positions", pa.list_(pa.int32())),
])


def _row_batch(row: Row, next_id: int) -> pa.RecordBatch:
    """One packed row in the layout of Note [Prepared rows]."""
    ids, positions = row["input_ids"].numpy(), row["position_ids"].numpy()
    starts = np.flatnonzero(np.concatenate([[True], positions[1:] != positions[:-1] + 1]))
    columns = [
        [ids.astype(np.int32)], [(row["labels"] != IGNORE_INDEX).numpy()], [next_id],
        [starts.astype(np.int32)], [positions[starts].astype(np.int32)],
    ]
    return pa.record_batch([pa.array(column, type=field.type) for column, field in zip(columns, ROW_SCHEMA)],
                           schema=ROW_SCHEMA)


# ----------------------------------------------------------------------------- reading


class PreparedRows(Sequence):
    """The packed rows of one prepared split, read from disk one row (record batch) at a time.

    ``rows[i]`` is ``{"input_ids", "labels", "position_ids"}`` of (L,) LongTensors,
    equal to ``build_rows(...)[i]``; nothing else is held in memory but the file's
    footer (Note [Prepared rows]).
    """

    def __init__(self, path: str | os.PathLike):
        self.path = str(path)
        self._file = pa.OSFile(self.path, "rb")  # positioned reads, no memory map
        self._reader = pa.ipc.open_file(self._file)

    def __len__(self) -> int:
        return self._reader.num_record_batches

    def __getitem__(self, index: int) -> Row:
        if not -len(self) <= index < len(self):
            raise IndexError(f"row {index} of {len(self)}")
        batch = self._reader.get_batch(index % len(self))
        ids = torch.from_numpy(batch.column(0).flatten().to_numpy().astype(np.int64))  # (L,)
        target = torch.from_numpy(batch.column(1).flatten().to_numpy(zero_copy_only=False))
        following = torch.cat([ids[1:], torch.tensor([batch.column(2)[0].as_py()])])
        labels = torch.where(target, following, IGNORE_INDEX)
        starts = torch.from_numpy(batch.column(3).flatten().to_numpy().astype(np.int64))
        first = torch.from_numpy(batch.column(4).flatten().to_numpy().astype(np.int64))
        lengths = torch.diff(starts, append=torch.tensor([len(ids)]))
        positions = torch.arange(len(ids)) - torch.repeat_interleave(starts - first, lengths)
        return {"input_ids": ids, "labels": labels, "position_ids": positions}

    def close(self) -> None:
        self._file.close()


class RowBatches(Sequence):
    """(batch_size, L) batches of ``rows[i]`` for i in ``indices``, read and stacked on access."""

    def __init__(self, rows: Sequence[Row], indices: Sequence[int], batch_size: int):
        self.rows, self.indices, self.batch_size = rows, indices, batch_size

    def __len__(self) -> int:
        return -(-len(self.indices) // self.batch_size)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"batch {index} of {len(self)}")
        mine = [self.rows[i] for i in self.indices[index * self.batch_size : (index + 1) * self.batch_size]]
        return {key: torch.stack([row[key] for row in mine]) for key in mine[0]}


def open_prepared(directory: str | os.PathLike, split: str) -> PreparedRows:
    return PreparedRows(Path(directory) / f"{split}.arrow")


def load_prepared_rows(
    dataset: str,
    tokenizer: PreTrainedTokenizerBase,
    context_length: int,
    cp: int,
    cache_dir: str = "",
    shared: bool = False,
    num_proc: int = 1,
    say=print,
    truncate: bool = False,
) -> tuple[PreparedRows, PreparedRows]:
    """(train, eval) rows of ``dataset``, prepared on first use: by local rank 0 of each node,
    or by global rank 0 alone when ``shared`` (one cache directory every node sees), while
    the other ranks wait; an error there is raised on every rank with the same message."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    preparer = rank == 0 if shared else int(os.environ.get("LOCAL_RANK", rank)) == 0
    failure, directory = None, None
    if preparer:
        try:
            directory, summary = prepare_dataset(dataset, tokenizer, context_length, cp, cache_dir, num_proc,
                                                 progress=rank == 0, truncate=truncate)
            if rank == 0:
                say(f"{'prepared rows reused' if summary['reused'] else 'prepared'}: {directory}")
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
        directory = root / key_hash(cache_key(dataset, tokenizer, context_length, cp, truncate))
    return open_prepared(directory, "train"), open_prepared(directory, "eval")
