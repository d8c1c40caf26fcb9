"""The files of prepared rows (Note [Prepared rows]): one packed row as an Arrow record batch and
its checksum (``row_batch``), what summary.json records to check the files by, and reading them
back (``PreparedRows``, checked on open and on every row; ``RowBatches``). Preparing and the
cache: ``llama_cp/data/prepared.py``.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from llama_cp.data.packing import IGNORE_INDEX, Row

SPLITS = ("train", "eval")


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
# depend on (cache_key); it is written under a temporary name and renamed
# (Note [One preparer per key]).
#
# What is checked, and when. Next to each <split>.arrow, <split>.rowsums holds one
# 8-byte blake2b digest per row, taken over the row's arrays as the reader decodes
# them (lengths, next_id, input_ids as int32, target as uint8, the segments), so
# writer and reader hash the same bytes whatever Arrow's buffers hold beyond them.
# summary.json's "checks" records per split the .arrow file's exact size, its row
# count and the sha256 of its .rowsums:
#
#   on open (PreparedRows, open_prepared,     size == recorded; footer opens, its
#     prepare_dataset's reuse check)           schema is ROW_SCHEMA, rows == recorded;
#                                              .rowsums' sha256 == recorded
#                                              (8 bytes a row: 640 KB for 80K rows)
#   on every row read (PreparedRows[i])        the decoded row's digest == rowsums[i]
#
# The open checks cost a footer read; the row check a hash of ~5 bytes per token:
# on one CPU thread a 64K-token row reads in ~500 us instead of ~250 us (blake2b
# runs at ~1.5 GB/s), a 64-token row in ~50 us instead of ~45 us; nothing next to
# a training step on such a row. Before any of it, the batch is validated in full
# (its offsets within their buffers, ~0.2 us): a damaged offset otherwise makes
# Arrow read out of bounds and abort the process.
# Together no damaged byte that changes a row goes unnoticed, and none that
# changes nothing (padding, Arrow's alignment) raises. A failed check raises
# DamagedRowsError (a ValueError), one line naming the directory, what is wrong
# and the fix: delete the directory and run again. prepare_dataset does that
# itself when its reuse check fails: it moves the directory aside under the
# lock, says so, and prepares anew. Damage found only on a row read (the open
# checks passed) cannot be repaired that way, since the next reuse check would
# pass again: the error says to delete the directory.


#: Bytes of one row's digest in ``<split>.rowsums``.
DIGEST_BYTES = 8

ROW_SCHEMA = pa.schema([
    ("input_ids", pa.list_(pa.int32())),
    ("target", pa.list_(pa.bool_())),
    ("next_id", pa.int32()),
    ("segment_starts", pa.list_(pa.int32())),
    ("segment_positions", pa.list_(pa.int32())),
])


def row_batch(row: Row, next_id: int) -> tuple[pa.RecordBatch, bytes]:
    """One packed row in the layout of Note [Prepared rows], and its digest (``row_digest``)."""
    ids, positions = row["input_ids"].numpy(), row["position_ids"].numpy()
    starts = np.flatnonzero(np.concatenate([[True], positions[1:] != positions[:-1] + 1]))
    columns = [
        ids.astype(np.int32), (row["labels"] != IGNORE_INDEX).numpy(), next_id,
        starts.astype(np.int32), positions[starts].astype(np.int32),
    ]
    batch = pa.record_batch([pa.array([column], type=field.type) for column, field in zip(columns, ROW_SCHEMA)],
                            schema=ROW_SCHEMA)
    return batch, row_digest(*columns)


def row_digest(ids: np.ndarray, target: np.ndarray, next_id: int, starts: np.ndarray, positions: np.ndarray) -> bytes:
    """8 bytes of blake2b over one row as the reader decodes it (Note [Prepared rows]): the
    lengths and next_id, then int32 ids, uint8 target, int32 segment starts and positions."""
    digest = hashlib.blake2b(digest_size=DIGEST_BYTES)
    digest.update(np.array([len(ids), len(starts), next_id], dtype="<i8"))
    digest.update(np.ascontiguousarray(ids, dtype="<i4"))
    digest.update(np.ascontiguousarray(target, dtype=np.bool_).view(np.uint8))
    digest.update(np.ascontiguousarray(starts, dtype="<i4"))
    digest.update(np.ascontiguousarray(positions, dtype="<i4"))
    return digest.digest()


def file_checks(directory: Path, split: str) -> dict[str, Any]:
    """What summary.json records of a written split for the checks of Note [Prepared rows]."""
    rowsums = (directory / f"{split}.rowsums").read_bytes()
    return {"arrow_bytes": (directory / f"{split}.arrow").stat().st_size, "rows": len(rowsums) // DIGEST_BYTES,
            "rowsums_sha256": hashlib.sha256(rowsums).hexdigest()}


class DamagedRowsError(ValueError):
    """Prepared rows that fail a check of Note [Prepared rows]; one line: the directory, what is
    wrong (``problem``) and the fix."""

    def __init__(self, directory: Path, problem: str):
        self.directory, self.problem = directory, problem
        super().__init__(f"prepared rows {directory}: {problem}: delete {directory} and run again "
                         "(or recipes.prepare_data): it is prepared anew")


def load_summary(directory: Path) -> dict[str, Any]:
    try:
        return json.loads((directory / "summary.json").read_text())
    except FileNotFoundError:
        raise DamagedRowsError(directory, "summary.json is missing") from None
    except (OSError, ValueError) as error:
        raise DamagedRowsError(directory, f"summary.json cannot be read ({error})") from None


def checked_summary(directory: Path) -> dict[str, Any] | None:
    """The summary of the prepared rows in ``directory`` once every split passes the open checks
    of Note [Prepared rows]; None when there is no such directory."""
    if not directory.exists():
        return None
    summary = load_summary(directory)
    for split in SPLITS:
        PreparedRows(directory / f"{split}.arrow").close()
    return summary


class PreparedRows(Sequence):
    """The packed rows of one prepared split, read from disk one row (record batch) at a time.

    ``rows[i]`` is ``{"input_ids", "labels", "position_ids"}`` of (L,) LongTensors,
    equal to ``build_rows(...)[i]``; nothing else is held in memory but the file's
    footer and its row digests, 8 bytes a row. Opening checks the file against its
    summary, every read checks the row against its digest (Note [Prepared rows]);
    either raises DamagedRowsError.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = str(path)
        directory, name = Path(path).parent, Path(path).name
        split = name.removesuffix(".arrow")
        checks = load_summary(directory).get("checks", {}).get(split)
        if checks is None:
            raise DamagedRowsError(directory, f"summary.json has no checks for {name}")
        try:
            size = os.path.getsize(path)
        except FileNotFoundError:
            raise DamagedRowsError(directory, f"{name} is missing") from None
        if size != checks["arrow_bytes"]:
            raise DamagedRowsError(directory, f"{name} is {size} bytes, its summary says {checks['arrow_bytes']}")
        try:
            self._digests = (directory / f"{split}.rowsums").read_bytes()
        except FileNotFoundError:
            raise DamagedRowsError(directory, f"{split}.rowsums is missing") from None
        if hashlib.sha256(self._digests).hexdigest() != checks["rowsums_sha256"]:
            raise DamagedRowsError(directory, f"{split}.rowsums differs from its sha256 in the summary")
        self._file = pa.OSFile(self.path, "rb")  # positioned reads, no memory map
        try:
            self._reader = pa.ipc.open_file(self._file)
        except (pa.ArrowException, OSError) as error:
            self._file.close()
            raise DamagedRowsError(directory, f"{name} cannot be opened ({error})") from None
        rows = self._reader.num_record_batches
        problem = (f"{name} has the schema {self._reader.schema}, not that of prepared rows"
                   if not self._reader.schema.equals(ROW_SCHEMA) else
                   f"{name} holds {rows} rows, its summary says {checks['rows']}" if rows != checks["rows"] else
                   f"{split}.rowsums holds {len(self._digests) // DIGEST_BYTES} digests for {rows} rows"
                   if len(self._digests) != rows * DIGEST_BYTES else None)
        if problem is not None:
            self._file.close()
            raise DamagedRowsError(directory, problem)

    def __len__(self) -> int:
        return self._reader.num_record_batches

    def __getitem__(self, index: int) -> Row:
        if not -len(self) <= index < len(self):
            raise IndexError(f"row {index} of {len(self)}")
        index %= len(self)
        try:
            batch = self._reader.get_batch(index)
            batch.validate(full=True)  # offsets within their buffers before anything reads through them
            ids = batch.column(0).flatten().to_numpy()  # (L,) int32
            target = batch.column(1).flatten().to_numpy(zero_copy_only=False)  # (L,) bool
            next_id = batch.column(2)[0].as_py()
            starts, first = batch.column(3).flatten().to_numpy(), batch.column(4).flatten().to_numpy()  # (S,) int32
            digest = row_digest(ids, target, next_id, starts, first)
        except Exception as error:  # a damaged message or buffer that Arrow cannot decode
            raise self._damaged(index, f"cannot be read ({type(error).__name__}: {error})") from error
        if digest != self._digests[index * DIGEST_BYTES : (index + 1) * DIGEST_BYTES]:
            raise self._damaged(index, "differs from its checksum")
        ids = torch.from_numpy(ids.astype(np.int64))
        following = torch.cat([ids[1:], torch.tensor([next_id])])
        labels = torch.where(torch.from_numpy(target), following, IGNORE_INDEX)
        starts, first = torch.from_numpy(starts.astype(np.int64)), torch.from_numpy(first.astype(np.int64))
        lengths = torch.diff(starts, append=torch.tensor([len(ids)]))
        positions = torch.arange(len(ids)) - torch.repeat_interleave(starts - first, lengths)
        return {"input_ids": ids, "labels": labels, "position_ids": positions}

    def _damaged(self, index: int, what: str) -> DamagedRowsError:
        directory = Path(self.path).parent
        return DamagedRowsError(directory, f"row {index} of {Path(self.path).name} {what}")

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
