"""One split of a dataset prepared into its row file: the examples tokenized (``datasets.map``,
``num_proc`` processes, a bad row skipped or refused as --on_bad_row says), put in the mixture's
order, and packed into ``<split>.arrow`` and ``<split>.rowsums`` (Note [Prepared rows] in
``llama_cp/data/row_files.py``): documents into SFT rows (Note [Packed rows]), or with
--objective dpo whole (chosen, rejected) pairs into rows of pairs (Note [Packed preference pairs]).
``llama_cp/data/prepared.py`` calls ``prepare_split`` for each split in a temporary directory.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import datasets
import numpy as np
import pyarrow as pa

from llama_cp.data.chat import ChatRenderError
from llama_cp.data.formats import check_objective, detect_format
from llama_cp.data.grammar import Source
from llama_cp.data.mixture import (
    DataSpec,
    bad_row,
    documents_taken,
    mixture_order,
    mixture_weights,
    skipped_rows_line,
    tokenize_row,
)
from llama_cp.data.packing import Row, RowPacker, _pad_id, truncate_document
from llama_cp.data.preference import PairPacker, tokenize_pair
from llama_cp.data.row_files import ROW_SCHEMA, row_batch
from llama_cp.data.sources import ROW_NUMBER, _quiet_datasets

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def prepare_split(
    spec: DataSpec, split: str, tokenizer: PreTrainedTokenizerBase, context_length: int, work: Path, num_proc: int,
    progress: bool, truncate: bool, objective: str = "sft",
) -> dict[str, Any]:
    """Tokenize and pack ``split`` of ``spec`` into ``work``; returns the split's summary (documents
    and their formats, rows, tokens, padding, documents split or truncated, skipped rows)."""
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
            shared = {"tokenizer": tokenizer, "spec": spec, "source": source}
            part = examples.map(
                _tokenize_pair if objective == "dpo" else _tokenize,
                fn_kwargs=shared if objective == "dpo" else {**shared, "context_length": context_length},
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
                         split_documents=packer.split_documents, truncated_documents=truncated,
                         unscored_rows=packer.unscored_rows)


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
              source: Source, context_length: int) -> dict[str, Any]:
    """One example's document; a passkey row without a length fills a row of ``context_length``."""
    where = f"row {example.get(ROW_NUMBER)} of {source.flag} {source.name!r}"
    (input_ids, label_mask), reason = tokenize_row(example, tokenizer, where, spec, context_length)
    return {"input_ids": input_ids, "label_mask": label_mask, "bad": reason}


def _tokenize_pair(example: Mapping[str, Any], tokenizer: PreTrainedTokenizerBase, spec: DataSpec,
                   source: Source) -> dict[str, Any]:
    """One preference example as its (chosen, rejected) sequences; empty ones and the reason for a
    row that cannot be made into a pair under --on_bad_row skip (as ``tokenize_row`` does)."""
    where = f"row {example.get(ROW_NUMBER)} of {source.flag} {source.name!r}"
    try:
        (ids, mask), (rejected_ids, rejected_mask) = tokenize_pair(example, tokenizer)
        reason = None
    except ChatRenderError as error:
        reason = bad_row(error, where, spec)
        ids, mask, rejected_ids, rejected_mask = [], [], [], []
    except ValueError as error:  # about the data as a whole, as tokenize_row says it
        raise ValueError(f"{where}: {error}") from None
    return {"chosen_ids": ids, "chosen_mask": mask, "rejected_ids": rejected_ids, "rejected_mask": rejected_mask,
            "bad": reason}
