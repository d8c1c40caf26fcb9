"""What the data flags ask for, as one object (``DataSpec``), and several sources made into one
stream of documents: concatenated, or drawn at random by weight (Note [Mixtures]); each row
tokenized in its own source's format, a row that cannot be rendered skipped or refused
(``--on_bad_row``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from llama_cp.data.chat import ChatRenderError
from llama_cp.data.formats import tokenize_example
from llama_cp.data.grammar import Source, parse_sources
from llama_cp.data.packing import Document
from llama_cp.data.sources import EVAL_FRACTION, load_source

if TYPE_CHECKING:
    import datasets
    from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True)
class DataSpec:
    """The data of a run: ``--dataset``, ``--eval_dataset``, ``--dataset_columns``,
    ``--eval_fraction``, ``--seed`` (the hold-out and the mixture draws), ``--on_bad_row``
    and the ``--chat_template`` file (named in messages)."""

    dataset: str
    eval_dataset: str = ""
    columns: str = ""
    eval_fraction: float = EVAL_FRACTION
    seed: int = 0
    on_bad_row: str = "skip"
    chat_template: str = ""

    @classmethod
    def of(cls, data, seed: int = 0) -> DataSpec:
        """The spec of a :class:`llama_cp.config.DataConfig` (``cfg.data``) and ``cfg.seed``."""
        return cls(data.dataset, data.eval_dataset, data.dataset_columns, data.eval_fraction, seed,
                   data.on_bad_row, data.chat_template)

    def sources(self, split: str) -> tuple[Source, ...]:
        """The sources ``split`` ("train" or "eval") reads."""
        if split == "eval" and self.eval_dataset:
            return parse_sources(self.eval_dataset, "--eval_dataset", self.columns)
        return parse_sources(self.dataset, "--dataset", self.columns)

    def examples(self, split: str) -> list[tuple[Source, datasets.Dataset]]:
        """Each source of ``split`` with its examples (``load_source``): an --eval_dataset whole,
        and with one, nothing held out of the training sources."""
        if split == "eval" and self.eval_dataset:
            return [(source, load_source(source, "all")) for source in self.sources("eval")]
        fraction = 0.0 if self.eval_dataset else self.eval_fraction
        return [(source, load_source(source, split, self.seed, fraction)) for source in self.sources(split)]

    def template_name(self) -> str:
        return f"--chat_template {self.chat_template!r}" if self.chat_template else "the tokenizer's chat template"

    def key(self) -> dict[str, Any]:
        """What the prepared rows depend on beyond the sources' content (llama_cp.data.prepared)."""
        return {key: value for key, value in asdict(self).items() if key != "chat_template"}


# Note [Mixtures]
# ~~~~~~~~~~~~~~~
# Sources without weights are read one after the other, each whole. With weights
# w_1..w_n, each next document is drawn from source i with probability
# w_i / sum(w), taking that source's documents in their order, until a draw
# lands on a source that has none left (datasets' interleave_datasets with
# probabilities and its default "first_exhausted"): the weights are the shares
# of the mixture, and the source that runs out first, relative to its weight,
# ends it. The draws come from numpy's PCG64 seeded with --seed, in blocks, so
# the order is the same on every rank, start and resume, for prepared rows
# (mixture_order) and for a stream (mixed_stream) alike:
#
#   weights 0.7, 0.3, seed 0   draws  A A B A A A B A B ...
#   documents                         a0 a1 b0 a2 a3 a4 b1 a5 b2 ...
#
# Each document is tokenized in its own source's format before mixing, so a chat
# source and a text source mix. The run logs how many documents each source gave.

_DRAWS_PER_BLOCK = 1 << 16


def _draws(weights: Sequence[float], seed: int) -> Iterator[np.ndarray]:
    """Blocks of source indices drawn with probabilities ``weights / sum(weights)``."""
    p = np.asarray(weights, dtype=np.float64)
    p = p / p.max()  # first: a sum of huge weights would overflow
    generator = np.random.default_rng(seed)
    while True:
        yield generator.choice(len(p), size=_DRAWS_PER_BLOCK, p=p / p.sum())


def mixture_order(sizes: Sequence[int], weights: Sequence[float] | None, seed: int) -> np.ndarray:
    """Indices into the concatenation of sources of ``sizes`` documents, in mixture order
    (Note [Mixtures]); all of them in order when ``weights`` is None."""
    starts = np.concatenate([[0], np.cumsum(sizes)])
    if weights is None:
        return np.arange(starts[-1])
    taken, order = np.zeros(len(sizes), dtype=np.int64), []
    for block in _draws(weights, seed):
        counts = np.zeros((len(block), len(sizes)), dtype=np.int64)
        counts[np.arange(len(block)), block] = 1
        seen = taken + np.cumsum(counts, axis=0)  # (draws, sources): documents taken from each so far
        over = np.flatnonzero((seen > np.asarray(sizes)).any(axis=1))  # draws past a source's end
        end = over[0] if len(over) else len(block)
        position = seen[np.arange(end), block[:end]] - 1  # the document of its source each draw takes
        order.append(starts[block[:end]] + position)
        taken = seen[end - 1] if end else taken
        if len(over):
            return np.concatenate(order)


def mixture_weights(sources: Sequence[Source]) -> list[float] | None:
    """The sources' weights, or None when they have none (``parse_sources`` allows all or none)."""
    return None if sources[0].weight is None else [source.weight for source in sources]


def documents_taken(order: np.ndarray, sizes: Sequence[int]) -> list[int]:
    """How many documents of each source a ``mixture_order`` takes."""
    source = np.searchsorted(np.cumsum(sizes), order, side="right")  # (documents,): the source of each
    return np.bincount(source, minlength=len(sizes)).tolist()


def mixed_stream(streams: Sequence[Iterable], weights: Sequence[float] | None, seed: int) -> Iterator[tuple[int, Any]]:
    """(source index, item) of ``streams`` in mixture order (Note [Mixtures]), the same order as
    ``mixture_order`` gives for streams of known length."""
    iterators = [iter(stream) for stream in streams]
    if weights is None:
        for index, iterator in enumerate(iterators):
            yield from ((index, item) for item in iterator)
        return
    for block in _draws(weights, seed):
        for index in block.tolist():
            try:
                item = next(iterators[index])
            except StopIteration:
                return
            yield index, item


def tokenize_row(
    example: Mapping[str, Any], tokenizer: PreTrainedTokenizerBase, where: str, spec: DataSpec,
    context_length: int | None = None,
) -> tuple[Document, str | None]:
    """(document, None), or (an empty document, why) for a row that cannot be rendered when
    ``--on_bad_row skip``; ``where`` names the row ("row 7 of --dataset 'chat.jsonl'")."""
    try:
        return tokenize_example(example, tokenizer, context_length), None
    except ChatRenderError as error:
        return ([], []), bad_row(error, where, spec)
    except ValueError as error:  # about the data as a whole (no template, one that writes no tools): at its first row
        raise ValueError(f"{where}: {error}") from None


def bad_row(error: ChatRenderError, where: str, spec: DataSpec) -> str:
    """Why the row ``where`` is skipped (``--on_bad_row skip``), or ValueError naming it and the
    fix (``--on_bad_row error``); the one policy for documents and preference pairs alike."""
    reason = f"{where}: {error} ({spec.template_name()})"
    if spec.on_bad_row == "error":
        raise ValueError(f"{reason}; fix the row, or pass --on_bad_row skip to train on the others") from None
    return reason


def skipped_rows_line(skipped: int, total: int, reasons: Sequence[str]) -> str:
    """The log line of ``--on_bad_row skip``: how many rows were skipped and the first reason."""
    return (f"skipped {skipped} of {total} rows that could not be rendered (--on_bad_row skip); "
            f"the first: {reasons[0]}" if reasons else f"skipped {skipped} of {total} rows (--on_bad_row skip)")


def mixture_line(split: str, sources: Sequence[Source], counts: Sequence[int], sizes: Sequence[int]) -> str:
    """What a mixture took from each source, for the log."""
    parts = ", ".join(f"{source.name} {count} of {size}" for source, count, size in zip(sources, counts, sizes))
    return f"{split} mixture: {sum(counts)} documents ({parts})"


def spec_documents(
    spec: DataSpec, split: str, tokenizer: PreTrainedTokenizerBase, say=None, context_length: int | None = None
) -> Iterator[Document]:
    """The documents of ``split`` of every source, tokenized in memory, in mixture order; rows
    that cannot be rendered are skipped (said through ``say``) or refused (``--on_bad_row``); a
    passkey row without a length fills a row of ``context_length``."""
    from llama_cp.data.sources import ROW_NUMBER

    sources, documents, reasons, total = [], [], [], 0
    for source, examples in spec.examples(split):
        mine = []
        for index, example in enumerate(examples):
            row = example.get(ROW_NUMBER, index + 1)
            where = f"row {row} of {source.flag} {source.name!r}"
            document, reason = tokenize_row(example, tokenizer, where, spec, context_length)
            mine.append(document)
            reasons += [reason] if reason else []
        sources.append(source)
        documents.append(mine)
        total += len(mine)
    if reasons and say is not None:
        say(skipped_rows_line(len(reasons), total, reasons))
    sizes = [len(mine) for mine in documents]
    weights = mixture_weights(sources)
    order = mixture_order(sizes, weights, spec.seed)
    if weights is not None and say is not None:
        say(mixture_line(split, sources, documents_taken(order, sizes), sizes))
    flat = [document for mine in documents for document in mine]
    return (flat[index] for index in order.tolist())
