"""The entry points from ``--dataset`` to one dp rank's batches: ``build_rows``, every packed
row of a split in memory, and ``DistributedRowLoader``, those rows as shuffled, resumable batches.

Pipeline (``build_rows`` runs the first three steps, ``DistributedRowLoader`` the last)::

    load_source        one source of --dataset: a local file / directory or a hub id -> datasets.Dataset
                       (sources; "passkey": load_examples), mixed with the others (mixture)
    tokenize_example   one example -> (input_ids, label_mask), a document: [bos] ... eos (formats)
    pack_documents     documents -> rows of exactly context_length tokens (packing, Note [Packed rows])
    DistributedRowLoader   rows -> (batch_size, context_length) batches of one dp rank
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from llama_cp.data.formats import tokenize_example
from llama_cp.data.grammar import PASSKEY
from llama_cp.data.mixture import DataSpec, spec_documents
from llama_cp.data.packing import Row, _pack, _pad_id, truncate_document
from llama_cp.data.passkey import DEFAULT_PASSKEY_SAMPLES, PASSKEY_DIGITS, passkey_warmup_lengths
from llama_cp.data.sources import _check_split, load_examples
from llama_cp.parallel.sharding import check_context_length

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def build_rows(
    dataset: str | DataSpec,
    tokenizer: PreTrainedTokenizerBase,
    context_length: int,
    cp: int = 1,
    split: str = "train",
    seed: int = 0,
    num_samples: int | None = None,
    truncate: bool = False,
    passkey_digits: int = PASSKEY_DIGITS,
    passkey_warmup_rows: int = 0,
    say=None,
) -> list[Row]:
    """The packed rows of one split of ``--dataset``: what the trainer feeds the loader.

    ``"passkey"``: ``num_samples`` rows (default ``DEFAULT_PASSKEY_SAMPLES``), the
    same as ``passkey_rows(num_samples, ..., seed, passkey_digits)`` for train, with seed +
    ``PASSKEY_EVAL_SEED_OFFSET`` for eval; on train, the first ``passkey_warmup_rows``
    pack shorter documents (``passkey_warmup_lengths``). Files, hub ids and mixtures (a
    :class:`DataSpec` for --eval_dataset, --eval_fraction, --dataset_columns, --on_bad_row):
    every packed row of the split, in mixture order (``num_samples`` does not apply); eval is
    the sources' eval splits or their hold-out (``load_source``), no rows when there is none.
    ``say`` hears the skipped rows and a mixture's counts. A document longer than
    ``context_length`` goes on in the next row, or with ``truncate`` keeps only its first
    ``context_length`` tokens (``truncate_document``).
    """
    check_context_length(context_length, cp)
    num_passkey = DEFAULT_PASSKEY_SAMPLES if num_samples is None else num_samples
    lengths = None
    if dataset == PASSKEY and passkey_warmup_rows and _check_split(split) == "train":
        lengths = passkey_warmup_lengths(num_passkey, context_length, passkey_warmup_rows)
    if dataset == PASSKEY:
        examples = load_examples(dataset, split, seed, num_passkey, passkey_digits, lengths)
        documents = (tokenize_example(example, tokenizer, context_length) for example in examples)
    else:
        spec = dataset if isinstance(dataset, DataSpec) else DataSpec(dataset, seed=seed)
        documents = list(spec_documents(spec, _check_split(split), tokenizer, say, context_length))
        if not documents and _check_split(split) == "eval":
            return []  # --eval_fraction 0 and no eval split: no eval
        dataset = spec.dataset if split == "train" or not spec.eval_dataset else spec.eval_dataset
    if truncate:
        documents = (truncate_document(document, context_length) for document in documents)
    try:
        return _pack(documents, context_length, _pad_id(tokenizer))
    except ValueError as error:
        raise ValueError(f"--dataset {dataset!r} ({split} split): {error}") from None


class DistributedRowLoader:
    """Epochs of (batch_size, L) batches of packed rows for one data-parallel rank.

    Each epoch shuffles the rows with a generator seeded by seed + epoch (like
    ``torch.utils.data.DistributedSampler``), so every rank computes the same
    order; global batch i is rows ``order[i*G:(i+1)*G]`` with G = batch_size x
    dp_size, and dp rank r takes its r-th slice of batch_size rows. The ranks of
    one cp group pass the same dp_rank and so read the same rows::

        order (G = 2 x 2):  [7 2 5 0 | 3 6 1 4 | ...]
        dp rank 0:           7 2      3 6
        dp rank 1:               5 0      1 4

    Iterating yields from the current position to the end of the epoch;
    ``state_dict`` is the position of the next batch, so a resumed run sees the
    same remaining batches. With ``drop_last=False`` the last global batch is
    completed with rows from the start of the epoch's order, so every rank takes
    the same number of steps.
    """

    def __init__(
        self,
        rows: Sequence[Row],
        batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = True,
    ):
        if batch_size < 1:
            raise ValueError(f"--batch_size must be at least 1, got {batch_size}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} is outside 0..dp_size-1 = 0..{dp_size - 1}")
        if len(rows) < batch_size * dp_size:
            raise ValueError(
                f"{len(rows)} rows are fewer than one global batch of batch_size({batch_size}) x "
                f"dp({dp_size}) = {batch_size * dp_size}; lower --batch_size or give more data "
                "(--dataset, or more passkey samples)"
            )
        self.rows = rows
        self.batch_size = batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.epoch = 0
        self.batch_index = 0

    @property
    def global_batch_size(self) -> int:
        return self.batch_size * self.dp_size

    @property
    def steps_per_epoch(self) -> int:
        """Batches per epoch (the same on every rank)."""
        full, partial = divmod(len(self.rows), self.global_batch_size)
        return full + (1 if partial and not self.drop_last else 0)

    def epoch_order(self, epoch: int) -> torch.Tensor:
        """(steps_per_epoch x global_batch_size,) row indices of ``epoch``, identical on every rank."""
        count = len(self.rows)
        if self.shuffle:
            order = torch.randperm(count, generator=torch.Generator().manual_seed(self.seed + epoch))
        else:
            order = torch.arange(count)
        needed = self.steps_per_epoch * self.global_batch_size
        return torch.cat([order, order[: needed - count]]) if needed > count else order[:needed]

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        order = self.epoch_order(self.epoch)
        for index in range(self.batch_index, self.steps_per_epoch):
            global_batch = order[index * self.global_batch_size : (index + 1) * self.global_batch_size]
            mine = global_batch[self.dp_rank * self.batch_size : (self.dp_rank + 1) * self.batch_size]
            read = [self.rows[i] for i in mine.tolist()]  # each row read once (prepared rows: from disk)
            batch = {key: torch.stack([row[key] for row in read]) for key in read[0]}  # (B, L)
            # advance before yielding: a checkpoint taken while this batch trains resumes at the next one
            if index + 1 == self.steps_per_epoch:
                self.epoch, self.batch_index = self.epoch + 1, 0
            else:
                self.batch_index = index + 1
            yield batch

    def state_dict(self) -> dict[str, int]:
        """The position of the next batch."""
        return {"epoch": self.epoch, "batch_index": self.batch_index}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Resume at ``state`` (from :meth:`state_dict`)."""
        if "batch_index" not in state:
            raise ValueError(
                "the checkpoint's data position was saved by a --streaming run: resume with --streaming"
            )
        epoch, batch_index = int(state["epoch"]), int(state["batch_index"])
        if epoch < 0 or not 0 <= batch_index < self.steps_per_epoch:
            raise ValueError(
                f"loader state epoch={epoch}, batch_index={batch_index} is outside this data: "
                f"{self.steps_per_epoch} batches per epoch (did --dataset, --batch_size or dp change?)"
            )
        self.epoch, self.batch_index = epoch, batch_index
