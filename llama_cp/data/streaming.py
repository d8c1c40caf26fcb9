"""``--streaming``: documents read from a ``datasets`` stream, split over the dp ranks and
packed as they arrive (Note [Streaming rows]), for corpora too large to prepare
(``llama_cp/data/prepared.py``) or to hold in memory. ``StreamingRowLoader`` is the trainer's
loader; its position goes into the checkpoint, so a resumed run continues with the same batches.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import datasets
import torch

from llama_cp.data.formats import REQUIRED_COLUMNS, check_free_form_nulls, detect_format, free_form_struct_paths
from llama_cp.data.grammar import Source
from llama_cp.data.mixture import DataSpec, mixed_stream, mixture_weights, tokenize_row
from llama_cp.data.packing import Row, RowPacker, _pad_id, truncate_document
from llama_cp.data.sources import check_mapped_columns, declares_configs, is_saved_dataset, load_hub_dataset, local_files

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

#: Every EVAL_EVERY-th document of the stream (the 20th, 40th, ...) is held out for eval.
EVAL_EVERY = 20


# Note [Streaming rows]
# ~~~~~~~~~~~~~~~~~~~~~
# With --streaming, nothing is prepared: every rank reads the documents of the
# stream in order, keeps its share and packs it as it goes (RowPacker, the rows
# of Note [Packed rows] over that share). Which rank takes which document
# depends only on its place in the stream, so it is the same on every start:
#
#   stream       d0  d1  d2 ... d18 d19 d20 ... d38 d39 ...   (a mixture: Note [Mixtures])
#   eval         every 20th: d19, d39, ...  (the first --num_eval_samples rows of them;
#                with --eval_dataset, its documents, and none held out)
#   train        the others, t0 t1 t2 t3 ...; dp rank r takes t_j for j % dp == r
#
# There is no shuffling (the stream's order is the order) and batches are whole:
# rows left over at the end of a rank's share are dropped, and the rank starts
# its share again (the next epoch). Ranks take different numbers of batches per
# pass, hence --max_steps. The position after a batch is, per dp rank, (epoch,
# document, offset): the document of the rank's share that holds the next token
# and how many of its tokens are already in batches. A resumed run skips that
# many documents of its share (read, not tokenized) and packs on from the
# offset, so it continues with exactly the batches the first run would have had.


def stream_examples(source: Source | str) -> datasets.IterableDataset:
    """One source's documents as datasets' stream (``streaming=True``): a local file or directory,
    a ``save_to_disk`` directory, or a hub id, with its options (its ``split=``, else "train")."""
    source = Source(source) if isinstance(source, str) else source
    path = Path(source.path).expanduser()
    if is_saved_dataset(path):
        loaded = datasets.load_from_disk(str(path))
        if isinstance(loaded, datasets.DatasetDict):
            loaded = loaded[source.split or ("train" if "train" in loaded else next(iter(loaded)))]
        return loaded.to_iterable_dataset()
    if path.is_dir() and (source.hub_options() or declares_configs(path)):
        stream = datasets.load_dataset(str(path), streaming=True, **source.hub_options())
    elif path.exists():
        builder, files = local_files(path)
        options = {"sample_by": "document"} if builder == "text" else {}
        stream = datasets.load_dataset(builder, data_files=[str(file) for file in files], streaming=True, **options)
    else:
        stream = load_hub_dataset(source, streaming=True)
    if isinstance(stream, datasets.IterableDatasetDict):
        stream = stream["train"] if "train" in stream else next(iter(stream.values()))
    return stream


def _checked(example: Mapping[str, Any], index: int, source: Source) -> Mapping[str, Any]:
    """Document ``index`` of the stream with the source's columns mapped; ValueError when it
    lacks a value its format needs."""
    if source.columns:
        check_mapped_columns(source, example)
        example = dict(example)
        for key, column in source.columns:
            example[key] = example.pop(column)
    kind = detect_format(example.keys())
    for column in REQUIRED_COLUMNS.get(kind, ()):
        if example.get(column) is None:
            raise ValueError(
                f"{source.flag} {source.name!r}: document {index} of the stream has no {column!r} value, which "
                f"the {kind} format needs; fix or drop it"
            )
    if kind == "passkey":
        raise ValueError(f"{source.flag} {source.name!r}: --streaming reads text, prompt/completion, instruction or "
                         "chat documents")
    return example


def _stream_documents(spec: DataSpec, eval_part: bool, dp_rank: int = 0, dp_size: int = 1) -> Iterator[Mapping]:
    """The stream's eval documents, or dp rank ``dp_rank``'s share of its train documents
    (Note [Streaming rows]); the sources mixed as Note [Mixtures] says."""
    own_eval = eval_part and bool(spec.eval_dataset)
    sources = spec.sources("eval" if own_eval else "train")
    streams = [stream_examples(source) for source in sources]
    structs = [free_form_struct_paths(stream.features) for stream in streams]  # Note [JSON objects stored as structs]
    mixed = mixed_stream(streams, mixture_weights(sources), spec.seed)
    held_out = not spec.eval_dataset and spec.eval_fraction > 0
    train_index = 0
    for index, (which, example) in enumerate(mixed):
        if not own_eval and held_out and (index % EVAL_EVERY == EVAL_EVERY - 1) != eval_part:
            continue
        if not held_out and eval_part and not own_eval:
            return  # --eval_fraction 0: no eval documents
        if eval_part or train_index % dp_size == dp_rank:
            check_free_form_nulls(example, structs[which], f"document {index} of the stream", sources[which].name,
                                  sources[which].flag)
            yield _checked(example, index, sources[which])
        train_index += not eval_part


def streaming_eval_rows(
    dataset: str | DataSpec, tokenizer: PreTrainedTokenizerBase, context_length: int, num_rows: int, truncate: bool = False
) -> list[Row]:
    """The first ``num_rows`` packed rows of the stream's eval documents (every 20th, or
    --eval_dataset's); a stream of fewer than 20 documents has none, and its eval reads the first
    documents instead; none at all with --eval_fraction 0 and no --eval_dataset."""
    spec = dataset if isinstance(dataset, DataSpec) else DataSpec(dataset)
    if not spec.eval_dataset and spec.eval_fraction == 0:
        return []
    rows: list[Row] = []
    for eval_part in (True, False):
        packer = RowPacker(context_length, _pad_id(tokenizer))
        for index, example in enumerate(_stream_documents(spec, eval_part)):
            document, _ = tokenize_row(example, tokenizer, f"eval document {index} of the stream", spec)
            rows += [row for row, _ in packer.add(truncate_document(document, context_length) if truncate else document)]
            if len(rows) >= num_rows:
                return rows[:num_rows]
        rows += [row for row, _ in packer.finish()]
        if rows:
            return rows[:num_rows]
    raise ValueError(f"--dataset {spec.dataset!r}: the stream holds no documents")


class StreamingRowLoader:
    """(batch_size, L) batches packed on the fly from dp rank ``dp_rank``'s share of a stream.

    The counterpart of ``DistributedRowLoader`` for ``--streaming`` (Note [Streaming
    rows]): iterating never ends (each pass over the share is an epoch); ``state_dict``
    is the position of the next batch of every dp rank (gathered from all ranks, so it
    must be called on all of them, as saving a checkpoint does).
    """

    def __init__(self, dataset: str | DataSpec, tokenizer: PreTrainedTokenizerBase, context_length: int, batch_size: int,
                 dp_rank: int = 0, dp_size: int = 1, truncate: bool = False):
        if batch_size < 1:
            raise ValueError(f"--batch_size must be at least 1, got {batch_size}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} is outside 0..dp_size-1 = 0..{dp_size - 1}")
        self.spec = dataset if isinstance(dataset, DataSpec) else DataSpec(dataset)
        self.dataset, self.tokenizer, self.context_length = self.spec.dataset, tokenizer, context_length
        self.batch_size, self.dp_rank, self.dp_size, self.truncate = batch_size, dp_rank, dp_size, truncate
        self.epoch = self.document = self.offset = 0
        self.skipped = 0  # rows that could not be rendered (--on_bad_row skip)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        while True:
            start = (self.document, self.offset)
            packer = RowPacker(self.context_length, _pad_id(self.tokenizer))
            packer.next_document = self.document
            rows, yielded = [], False
            documents = _stream_documents(self.spec, False, self.dp_rank, self.dp_size)
            for index, example in enumerate(documents):
                if index < start[0]:
                    continue  # before the resumed position: read, not tokenized
                where = f"document {index} of dp rank {self.dp_rank}'s share of the stream"
                document, reason = tokenize_row(example, self.tokenizer, where, self.spec)
                if reason is not None:
                    self.skipped += 1
                    if self.skipped == 1:  # said once; the count is the loader's
                        warnings.warn(f"{reason}; such rows are skipped (--on_bad_row skip)", stacklevel=1)
                if self.truncate:
                    document = truncate_document(document, self.context_length)
                rows += packer.add(document, start[1] if index == start[0] else 0)
                while len(rows) >= self.batch_size:
                    batch, rows = rows[: self.batch_size], rows[self.batch_size :]
                    # advance before yielding: a checkpoint taken while this batch trains resumes at the next one
                    self.document, self.offset = batch[-1][1]
                    yielded = True
                    yield {key: torch.stack([row[key] for row, _ in batch]) for key in batch[0][0]}  # (B, L)
            rows += packer.finish()
            while len(rows) >= self.batch_size:
                batch, rows = rows[: self.batch_size], rows[self.batch_size :]
                self.document, self.offset = batch[-1][1]
                yielded = True
                yield {key: torch.stack([row[key] for row, _ in batch]) for key in batch[0][0]}
            if not yielded and start == (0, 0):
                raise ValueError(
                    f"--streaming: dp rank {self.dp_rank}'s share of --dataset {self.dataset!r} packs into fewer "
                    f"than --batch_size {self.batch_size} rows; lower --batch_size or give more data"
                )
            self.epoch, self.document, self.offset = self.epoch + 1, 0, 0

    def state_dict(self) -> dict[str, Any]:
        """``{"streaming": [[epoch, document, offset] of dp rank 0, of dp rank 1, ...]}``."""
        import torch.distributed as dist

        mine = [self.dp_rank, [self.epoch, self.document, self.offset]]
        if dist.is_initialized() and dist.get_world_size() > 1:
            gathered: list = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, mine)
        else:
            gathered = [mine]
        positions = dict(gathered)  # the ranks of one cp group share their dp rank and position
        return {"streaming": [positions[rank] for rank in range(self.dp_size)]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume at ``state`` (from :meth:`state_dict`, saved by a run with the same dp size)."""
        positions = state.get("streaming")
        if positions is None or len(positions) != self.dp_size:
            saved = "a run without --streaming" if positions is None else f"{len(positions)} dp ranks"
            raise ValueError(
                f"the checkpoint's data position was saved by {saved}; this run streams with {self.dp_size} dp "
                "ranks: resume with the same --streaming and data-parallel size"
            )
        self.epoch, self.document, self.offset = (int(value) for value in positions[self.dp_rank])
