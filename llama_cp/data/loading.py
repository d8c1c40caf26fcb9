"""Datasets -> tokenized documents -> packed fixed-length rows -> one dp rank's batches.

Pipeline (``build_rows`` runs the first three steps, ``DistributedRowLoader`` the last)::

    load_examples      "passkey", a local file / directory, or a hub id -> datasets.Dataset
    tokenize_example   one example -> (input_ids, label_mask), a document: [bos] ... eos
    pack_documents     documents -> rows of exactly context_length tokens (Note [Packed rows])
    DistributedRowLoader   rows -> (batch_size, context_length) batches of one dp rank

Example formats, detected from the columns:

    text          {"text": str}                                  every token is trained
    instruction   {"instruction": str, "input": str (optional), "output": str}   (alpaca)
                  the prompt is not trained, only the response and eos
    chat          {"messages": [{"role": str, "content": str}, ...]}
                  only the assistant turns (and the eos that closes them) are trained

A document's ``label_mask[t]`` says whether token t is a training *target*
(predicted from tokens 0..t-1); the shift to next-token labels happens once, in
packing. No attention mask is built anywhere: a (L, L) mask at L = 131072 is
what crashed Megatron-LM's loader; documents are told apart by ``position_ids``.
"""

from __future__ import annotations

import contextlib
import random
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import datasets
import torch

from llama_cp.config import PASSKEY, check_dataset_path
from llama_cp.model.loss import IGNORE_INDEX
from llama_cp.parallel.sharding import check_context_length

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

#: Local file extensions and the ``datasets`` builder that reads them. A ``.txt``
#: file is one document (the whole file), which is what long-context data wants.
FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".txt": "text"}
#: Names that mean "a file" even when no such file exists (hub ids never end like this).
ACCEPTED_FORMATS = (
    "text: a 'text' column",
    "instruction (alpaca): 'instruction' and 'output' columns, optional 'input'",
    "chat: a 'messages' column, a list of {'role', 'content'}",
)
#: Fraction of the documents of a local or hub dataset held out for the eval split.
EVAL_FRACTION = 0.05
#: The eval passkey rows use seed + this offset, so train and eval rows never share a stream.
PASSKEY_EVAL_SEED_OFFSET = 1 << 30
#: Digits of the passkey task's key unless told (--passkey_digits).
PASSKEY_DIGITS = 5
#: The shortest passkey document of a length warm-up: the byte tokenizer's needle, question
#: and a 5-digit answer take about 110 tokens, and this leaves room for some filler.
MIN_PASSKEY_DOCUMENT = 128
DEFAULT_PASSKEY_SAMPLES = 1000
PASSKEY_FILLER = (
    "The grass is green. ",
    "The sky is blue. ",
    "The sun is yellow. ",
    "Here we go. ",
    "There and back again. ",
)

ALPACA_PROMPT = (
    "Below is an instruction that describes a task. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:\n"
)
ALPACA_PROMPT_WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)

#: (input_ids, label_mask) of one document; label_mask[t]: token t is a training target.
Document = tuple[list[int], list[bool]]
#: One packed row: ``input_ids``, ``labels``, ``position_ids``, each a (L,) LongTensor.
Row = dict[str, torch.Tensor]


# ----------------------------------------------------------------------------- loading


def load_examples(
    dataset: str,
    split: str = "train",
    seed: int = 0,
    num_passkey: int = DEFAULT_PASSKEY_SAMPLES,
    passkey_digits: int = PASSKEY_DIGITS,
    passkey_lengths: Sequence[int] | None = None,
) -> datasets.Dataset:
    """The examples of ``split`` ("train" or "eval") of ``--dataset``.

    - ``"passkey"``: ``num_passkey`` draws of the synthetic task, columns
      ``passkey`` (the key, ``passkey_digits`` digits) and ``depth`` (where the
      key sits, 0..1), drawn from (seed, index); eval uses seed +
      ``PASSKEY_EVAL_SEED_OFFSET``. With ``passkey_lengths`` (one per draw,
      ``passkey_warmup_lengths``) a column ``length`` gives each document's
      tokens; without, every document fills a row.
    - a local .json / .jsonl / .parquet / .txt file, a directory of such files,
      or a directory written by ``Dataset.save_to_disk``;
    - anything else is a hub id for ``datasets.load_dataset``.

    Files have no splits: eval is the last ~5% of the documents and train the
    rest (a single text document is cut at 95% of its characters instead). A
    hub dataset with a "validation" or "test" split uses it for eval.
    """
    split = _check_split(split)
    if dataset == PASSKEY:
        stream_seed = seed if split == "train" else seed + PASSKEY_EVAL_SEED_OFFSET
        count = num_passkey if passkey_lengths is None else len(passkey_lengths)
        draws = [_draw_passkey(_passkey_rng(stream_seed, index), passkey_digits) for index in range(count)]
        keys, depths = zip(*draws) if draws else ((), ())
        columns = {"passkey": list(keys), "depth": list(depths)}
        if passkey_lengths is not None:
            columns["length"] = list(passkey_lengths)
        return datasets.Dataset.from_dict(columns)
    check_dataset_path(dataset)
    path = Path(dataset).expanduser()
    loaded = _load_local(path) if path.exists() else load_hub_dataset(dataset)
    for part in loaded.values() if isinstance(loaded, datasets.DatasetDict) else [loaded]:
        if len(part) == 0:
            raise ValueError(f"--dataset {dataset!r} is empty: it holds no rows")
        check_required_values(part, dataset)  # also fails on unusable columns, before any tokenization
    return _select_split(loaded, split)


def load_hub_dataset(dataset: str) -> datasets.Dataset | datasets.DatasetDict:
    """``datasets.load_dataset(dataset)``; its error says that the name was taken for a hub id."""
    try:
        return datasets.load_dataset(dataset)
    except Exception as error:
        note = (
            f"--dataset {dataset!r} is not a local path (no such file or directory), "
            "so it was treated as a HuggingFace hub dataset id"
        )
        if not hasattr(error, "add_note"):  # Python 3.10
            raise RuntimeError(f"{note}: {error}") from error
        error.add_note(note)
        raise


def _check_split(split: str) -> str:
    if split in ("eval", "validation", "test"):
        return "eval"
    if split != "train":
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    return split


def _load_local(path: Path) -> datasets.Dataset | datasets.DatasetDict:
    """Read a local file or directory with the ``datasets`` builder its extension names."""
    if path.is_dir() and ((path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists()):
        return datasets.load_from_disk(str(path))
    builder, files = local_files(path)
    options = {"sample_by": "document"} if builder == "text" else {}
    try:
        with _quiet_datasets():
            return datasets.load_dataset(builder, data_files=[str(file) for file in files], **options)
    except Exception:
        if builder == "json":
            for file in files:
                _check_json_file(file)  # names the file and line when that is what failed
        raise


def local_files(path: Path) -> tuple[str, list[Path]]:
    """(``datasets`` builder, the files) of a local file or directory of data files;
    ValueError when there are none, they mix types, or all are blank."""
    if path.is_dir():
        files = sorted(
            file
            for file in path.rglob("*")
            if file.is_file()
            and file.suffix in FILE_BUILDERS
            and not any(part.startswith(".") for part in file.relative_to(path).parts)
        )
        if not files:
            raise ValueError(f"--dataset {str(path)!r}: the directory holds no {'/'.join(FILE_BUILDERS)} files")
    else:
        files = [path]
        if path.suffix not in FILE_BUILDERS:
            raise ValueError(
                f"--dataset {str(path)!r}: unsupported file type {path.suffix!r}; use one of {', '.join(FILE_BUILDERS)}"
            )
    builders = {FILE_BUILDERS[file.suffix] for file in files}
    if len(builders) > 1:
        raise ValueError(f"--dataset {str(path)!r} mixes file types ({', '.join(sorted(builders))}); use one type")
    builder = builders.pop()
    if all(_is_blank(file) for file in files):
        raise ValueError(f"--dataset {str(path)!r} is empty: it holds no rows")
    return builder, files


@contextlib.contextmanager
def _quiet_datasets() -> Iterator[None]:
    """datasets' own logging and progress bars off: on a bad file it logs its parser's error
    (rows counted its own way) and draws bars on every rank; the error we raise says it once."""
    from datasets.utils import logging as datasets_logging

    verbosity, bars = datasets_logging.get_verbosity(), datasets_logging.is_progress_bar_enabled()
    datasets_logging.set_verbosity(datasets_logging.CRITICAL)
    datasets_logging.disable_progress_bar()
    try:
        yield
    finally:
        datasets_logging.set_verbosity(verbosity)
        if bars:
            datasets_logging.enable_progress_bar()


def _is_blank(file: Path) -> bool:
    """Whether ``file`` holds nothing but whitespace (read only when it is small)."""
    size = file.stat().st_size
    return size == 0 or (size < 1 << 16 and not file.read_bytes().strip())


def _check_json_file(file: Path) -> None:
    """ValueError naming the first line of ``file`` that is not valid JSON: the whole file as
    one JSON document when it starts with ``[``, else every non-blank line as one row."""
    import json

    with open(file, encoding="utf-8", errors="replace") as f:
        text = f.read()
    if text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(
                f"--dataset {str(file)!r}: invalid JSON at line {error.lineno}, column {error.colno}: {error.msg}"
            ) from None
        if not rows:
            raise ValueError(f"--dataset {str(file)!r} is empty: it holds no rows")
        return
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            json.loads(line)
        except json.JSONDecodeError as error:
            shown = line if len(line) <= 80 else line[:77] + "..."
            raise ValueError(
                f"--dataset {str(file)!r}: line {number} is not valid JSON ({error.msg}, column {error.colno}): "
                f"{shown!r}; fix or remove that line"
            ) from None


#: The columns each example format needs a value in (a missing key is read as null).
REQUIRED_COLUMNS = {"text": ("text",), "instruction": ("instruction", "output"), "chat": ("messages",)}


def check_required_values(examples: datasets.Dataset, dataset: str) -> None:
    """ValueError when rows lack a value their format needs (a JSON row without the key, or
    null): such a row would otherwise be dropped or trained as empty without a word. Row
    numbers count from 1 over the loaded rows (a JSONL file's lines, blank lines aside)."""
    import pyarrow.compute as pc

    kind = detect_format(examples.column_names)
    for column in REQUIRED_COLUMNS.get(kind, ()):
        values = examples.data.column(column)
        if values.null_count == 0:
            continue
        missing = pc.indices_nonzero(pc.is_null(values)).to_pylist()
        shown = ", ".join(str(i + 1) for i in missing[:5]) + (", ..." if len(missing) > 5 else "")
        raise ValueError(
            f"--dataset {dataset!r}: {len(missing)} of {len(examples)} rows have no {column!r} value "
            f"(missing or null; rows {shown}), which the {kind} format needs; fix or drop those rows"
        )


def _select_split(loaded: datasets.Dataset | datasets.DatasetDict, split: str) -> datasets.Dataset:
    """A real eval split when the data has one ("validation" / "test"), else hold out the tail."""
    if isinstance(loaded, datasets.Dataset):
        return _hold_out(loaded, split)
    train_name = "train" if "train" in loaded else next(iter(loaded))
    eval_name = next((name for name in ("validation", "test") if name in loaded and name != train_name), None)
    if eval_name is not None:
        return loaded[train_name if split == "train" else eval_name]
    return _hold_out(loaded[train_name], split)


def _hold_out(examples: datasets.Dataset, split: str) -> datasets.Dataset:
    """The first ~95% of the documents for train, the last ~5% (at least one) for eval."""
    count = len(examples)
    if count >= 2:
        num_eval = max(1, round(EVAL_FRACTION * count))
        kept = range(count - num_eval) if split == "train" else range(count - num_eval, count)
        return examples.select(kept)
    if count == 1 and detect_format(examples.column_names) == "text":
        # one long document: its last 5% of characters is the held-out text
        text = examples[0]["text"] or ""
        cut = round((1 - EVAL_FRACTION) * len(text))
        return datasets.Dataset.from_dict({"text": [text[:cut] if split == "train" else text[cut:]]})
    warnings.warn(f"only {count} example(s): no eval split can be held out, eval reuses the training data")
    return examples


def detect_format(columns: Iterable[str]) -> str:
    """"chat", "instruction", "text" or "passkey" from the column names; ValueError otherwise."""
    columns = set(columns)
    if "messages" in columns:
        return "chat"
    if {"instruction", "output"} <= columns:
        return "instruction"
    if "text" in columns:
        return "text"
    if {"passkey", "depth"} <= columns:
        return "passkey"
    raise ValueError(
        f"--dataset rows have columns {sorted(columns)}, which match none of the accepted formats: "
        + "; ".join(ACCEPTED_FORMATS)
    )


# ----------------------------------------------------------------------------- tokenizing


def tokenize_example(
    example: Mapping[str, Any], tokenizer: PreTrainedTokenizerBase, context_length: int | None = None
) -> Document:
    """(input_ids, label_mask) of one example: ``[bos] + tokens + [eos]``, bos only if the tokenizer has one.

    ``label_mask[t]`` is True when token t is a training target: every token but
    bos for text, the response and eos for instruction, the assistant turns for
    chat. A passkey example has exactly its ``length`` tokens, or fills a row of
    ``context_length`` when it has none. An empty text gives an empty document
    (skipped by packing).
    """
    kind = detect_format(example.keys())
    if kind == "passkey":
        length = example.get("length") or context_length
        if length is None:
            raise ValueError("a passkey example fills a whole row: pass context_length to tokenize_example")
        return passkey_document(example["passkey"], example["depth"], length, tokenizer)
    if kind == "text":
        if not example["text"]:
            return [], []
        segments = [(example["text"], True)]
    elif kind == "instruction":
        template = ALPACA_PROMPT_WITH_INPUT if example.get("input") else ALPACA_PROMPT
        prompt = template.format(instruction=example["instruction"], input=example.get("input") or "")
        segments = [(prompt, False), (example["output"] or "", True)]
    else:
        segments = _chat_segments(example["messages"], tokenizer)
    return _encode_document(segments, tokenizer)


def _encode_document(segments: Sequence[tuple[str, bool]], tokenizer: PreTrainedTokenizerBase) -> Document:
    """Encode (text, trained) segments one by one and close the document with bos / eos.

    eos is appended unless the text already ends with it (chat templates often
    do) and is trained when the last segment is.
    """
    eos = _eos_id(tokenizer)
    input_ids: list[int] = []
    label_mask: list[bool] = []
    for text, trained in segments:
        tokens = tokenizer.encode(text, add_special_tokens=False)
        input_ids += tokens
        label_mask += [trained] * len(tokens)
    bos = tokenizer.bos_token_id
    if bos is not None and input_ids[:1] != [bos]:
        input_ids.insert(0, bos)
        label_mask.insert(0, False)
    if input_ids[-1:] != [eos]:
        input_ids.append(eos)
        label_mask.append(bool(segments) and segments[-1][1])
    label_mask[0] = False  # the first token of a document is never a target: no token of the document precedes it
    return input_ids, label_mask


def _chat_segments(messages: Sequence[Mapping[str, Any]], tokenizer: PreTrainedTokenizerBase) -> list[tuple[str, bool]]:
    """(text, trained) pieces of a conversation; only assistant content is trained.

    With a chat template, a turn's text is the difference between the rendering
    of the conversation up to it and the rendering up to the previous turn; an
    assistant turn is split after its header (the ``add_generation_prompt``
    rendering), so the header is not trained. Without a template the rendering
    is ``role: content\\n`` per message.
    """
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping) or "role" not in message or "content" not in message:
            raise ValueError(f"chat message {index} must be a {{'role', 'content'}} dict, got {message!r}")
    if not getattr(tokenizer, "chat_template", None):
        segments = []
        for message in messages:
            segments.append((f"{message['role']}: ", False))
            segments.append((f"{message['content']}\n", message["role"] == "assistant"))
        return segments

    def render(prefix: Sequence[Mapping[str, Any]], add_generation_prompt: bool = False) -> str:
        if not prefix and not add_generation_prompt:
            return ""
        return tokenizer.apply_chat_template(list(prefix), tokenize=False, add_generation_prompt=add_generation_prompt)

    def new_text(rendering: str, previous: str) -> str:
        if not rendering.startswith(previous):
            raise ValueError(
                "the tokenizer's chat template does not render a conversation's prefix as a prefix of the "
                "whole rendering, so the assistant turns cannot be located for masking"
            )
        return rendering[len(previous) :]

    segments, rendered = [], ""
    for index, message in enumerate(messages):
        is_assistant = message["role"] == "assistant"
        if is_assistant:
            header = render(messages[:index], add_generation_prompt=True)
            segments.append((new_text(header, rendered), False))
            rendered = header
        rendering = render(messages[: index + 1])
        segments.append((new_text(rendering, rendered), is_assistant))
        rendered = rendering
    return [(text, trained) for text, trained in segments if text]


def _eos_id(tokenizer: PreTrainedTokenizerBase) -> int:
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no eos token; every packed document must end with one")
    return tokenizer.eos_token_id


def _pad_id(tokenizer: PreTrainedTokenizerBase) -> int:
    """The pad id, or eos for tokenizers without one (Llama 3): padded positions are never trained."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else _eos_id(tokenizer)


# ----------------------------------------------------------------------------- packing

# Note [Packed rows]
# ~~~~~~~~~~~~~~~~~~
# Documents are concatenated into one token stream and cut into rows of exactly
# L = context_length tokens; a document longer than the space left is continued
# in the next row, and the last row is padded. Labels are shifted here, once:
# labels[t] is the target of input t, i.e. the next token of the same document,
# or -100 when that token is not trained, belongs to another document, or is
# padding. position_ids count from 0 within each document, so RoPE and any
# document-aware attention see where documents start. L = 8, documents "abc"
# and "defghij" (a, d = bos; c, j = eos), P = padding, - = -100:
#
#              row 0                       row 1
#   input_ids     a  b  c  d  e  f  g  h  |  i  j  P  P  P  P  P  P
#   labels        b  c  -  e  f  g  h  i  |  j  -  -  -  -  -  -  -
#   position_ids  0  1  2  0  1  2  3  4  |  5  6  7  8  9 10 11 12
#
# Shifting the whole stream before cutting it keeps the target that crosses a
# row border (h -> i); a continued document keeps counting its positions.


def pack_documents(documents: Iterable[Document], context_length: int, cp: int = 1, pad_id: int = 0) -> list[Row]:
    """Pack (input_ids, label_mask) documents into rows of exactly ``context_length`` tokens.

    Returns rows, each ``{"input_ids", "labels", "position_ids"}`` of (L,)
    LongTensors, labels already shifted; see Note [Packed rows]. Padding uses
    ``pad_id`` with labels -100 and positions continuing the last document.
    Raises ValueError when L is not a multiple of 2 x cp, or when no document
    has a trainable token ("no usable text").
    """
    check_context_length(context_length, cp)
    return _pack(documents, context_length, pad_id)


def _pack(documents: Iterable[Document], context_length: int, pad_id: int) -> list[Row]:
    input_ids, labels, positions = [], [], []
    for index, (ids, mask) in enumerate(documents):
        if len(ids) != len(mask):
            raise ValueError(f"document {index}: {len(ids)} input_ids but {len(mask)} label_mask entries")
        if not ids:
            continue
        document_ids = torch.tensor(ids, dtype=torch.long)  # (n,)
        document_labels = torch.full_like(document_ids, IGNORE_INDEX)
        # the target of token t is token t+1, kept where token t+1 is trained; the last token has none
        document_labels[:-1] = document_ids[1:].masked_fill(~torch.tensor(mask[1:], dtype=torch.bool), IGNORE_INDEX)
        input_ids.append(document_ids)
        labels.append(document_labels)
        positions.append(torch.arange(len(ids)))
    if not labels or all(bool((document_labels == IGNORE_INDEX).all()) for document_labels in labels):
        raise ValueError("no usable text: the documents hold no trainable token (every label would be -100)")
    input_ids, labels, positions = torch.cat(input_ids), torch.cat(labels), torch.cat(positions)  # (N,)
    padding = -len(input_ids) % context_length
    if padding:
        input_ids = torch.cat([input_ids, torch.full((padding,), pad_id, dtype=torch.long)])
        labels = torch.cat([labels, torch.full((padding,), IGNORE_INDEX, dtype=torch.long)])
        positions = torch.cat([positions, positions[-1] + 1 + torch.arange(padding)])
    return [
        {"input_ids": row_ids, "labels": row_labels, "position_ids": row_positions}
        for row_ids, row_labels, row_positions in zip(
            input_ids.split(context_length), labels.split(context_length), positions.split(context_length)
        )
    ]


def truncate_document(document: Document, context_length: int) -> Document:
    """The first ``context_length`` tokens of a document (``--truncate_documents``): the rest,
    and its eos, are dropped, so it fits one row when it starts one."""
    input_ids, label_mask = document
    return input_ids[:context_length], label_mask[:context_length]


class RowPacker:
    """Packs documents one at a time into the rows ``_pack`` makes from all of them at once.

    The same rows as ``pack_documents`` (Note [Packed rows]), for data that does not fit
    in memory: ``add`` takes one document and returns the rows it completed, ``finish``
    pads and returns the last one. Each returned row comes with the stream position
    *after* it, ``(document, offset)``: the document (counted from 0 over every ``add``,
    empty ones too) holding the row's next token and how many of its tokens are already
    in rows, so a reader can resume exactly there (``add(..., offset=...)``).
    """

    def __init__(self, context_length: int, pad_id: int):
        self.context_length = context_length
        self.pad_id = pad_id
        # [document, offset, input_ids, labels, position_ids, first offset], oldest first
        self.pieces: list[list] = []
        self.size = 0  # tokens waiting in pieces
        self.next_document = 0
        self.documents = self.tokens = self.split_documents = 0
        self.trainable = False  # some token so far has a label

    def add(self, document: Document, offset: int = 0) -> list[tuple[Row, tuple[int, int]]]:
        """Rows completed by the next document, of which the first ``offset`` tokens are
        already in earlier rows (a resumed stream)."""
        ids, mask = document
        if len(ids) != len(mask):
            raise ValueError(f"document {self.next_document}: {len(ids)} input_ids but {len(mask)} label_mask entries")
        index, self.next_document = self.next_document, self.next_document + 1
        if not len(ids):
            return []
        self.documents += 1
        document_ids = torch.as_tensor(ids, dtype=torch.long)  # (n,)
        mask = torch.as_tensor(mask, dtype=torch.bool)
        document_labels = torch.full_like(document_ids, IGNORE_INDEX)
        document_labels[:-1] = document_ids[1:].masked_fill(~mask[1:], IGNORE_INDEX)  # as _pack
        self.trainable = self.trainable or bool((document_labels != IGNORE_INDEX).any())
        positions = torch.arange(len(document_ids))
        piece = [index, offset, document_ids[offset:], document_labels[offset:], positions[offset:], offset]
        self.pieces.append(piece)
        self.size += len(document_ids) - offset
        self.tokens += len(document_ids) - offset
        rows = []
        while self.size >= self.context_length:
            rows.append(self._take(self.context_length))
        return rows

    def finish(self) -> list[tuple[Row, tuple[int, int]]]:
        """The last, padded row (none when the tokens filled whole rows); then the packer is empty."""
        if not self.size:
            return []
        padding = self.context_length - self.size
        last = self.pieces[-1][4][-1]
        self.pieces.append([self.next_document, 0, torch.full((padding,), self.pad_id, dtype=torch.long),
                            torch.full((padding,), IGNORE_INDEX, dtype=torch.long), last + 1 + torch.arange(padding), 0])
        self.size += padding
        return [self._take(self.context_length)]

    def _take(self, count: int) -> tuple[Row, tuple[int, int]]:
        parts = []
        while count:
            piece = self.pieces[0]
            taken = min(count, len(piece[2]))
            parts.append([tensor[:taken] for tensor in piece[2:5]])
            if taken == len(piece[2]):
                self.pieces.pop(0)
            else:  # the row ends inside this document: it goes on in the next row
                self.split_documents += piece[1] == piece[5]  # counted at its first cut
                piece[1] += taken
                piece[2:5] = [tensor[taken:] for tensor in piece[2:5]]
            count -= taken
            self.size -= taken
        row = {key: torch.cat([part[k] for part in parts]) for k, key in enumerate(("input_ids", "labels", "position_ids"))}
        after = (self.pieces[0][0], self.pieces[0][1]) if self.pieces else (self.next_document, 0)
        return row, after


# ----------------------------------------------------------------------------- passkey

# Note [Passkey rows]
# ~~~~~~~~~~~~~~~~~~~
# One row of exactly L tokens; only the answer (and eos) is trained, so the loss
# and the exact-match accuracy measure whether the model retrieves a number
# from anywhere in its context:
#
#   [bos] ...filler... The pass key is 58231. Remember it. 58231 is the pass key. ...filler...
#         What is the pass key? The pass key is 58231[eos]
#                                               ^^^^^^^^^^ trained
#
# The filler is whole sentences, cut at the front so the answer ends the row;
# the key goes in at the sentence boundary nearest below ``depth`` x filler.
#
# Note [Passkey length warm-up]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A model learning the task from scratch gets almost no signal from full rows:
# at first its attention is spread evenly, so the key's few tokens are a few
# L-ths of what the answer position reads. The embedded model (3.3M parameters,
# random init) trained on 1024-token rows ends at chance after 200 steps. So
# the first rows of a run (--passkey_warmup, a share of the steps: 0.9 of the
# default job's 200) pack several shorter passkey documents, each with its own
# key and question, in equal shares of L/8, L/4 and L/2 tokens, shortest
# first, then full rows:
#
#   rows 0..59     [ 128 | 128 | 128 | 128 | 128 | 128 | 128 | 128 ]   L = 1024
#   rows 60..119   [   256   |   256   |   256   |   256   ]
#   rows 120..179  [        512        |        512        ]
#   rows 180..     [                  1024                 ]
#
# Packed documents attend only within themselves (--document_mask; without it
# there is no warm-up), so a row of eight 128-token documents is eight short
# examples of the same task. What
# the model learns on them (attend to the digit) carries to full rows; the
# loader keeps this order (no shuffle: passkey rows are independent draws).
#
# The key: one digit for the embedded model (--passkey_digits 0, auto). Finding
# one digit anywhere in the row needs one attention head that looks for
# digits; copying five digits in order needs an induction circuit (a head
# that finds where the current digit appeared and one that reads the token
# after it), which the embedded model does not form in a CPU-sized run: five
# digits with the same warm-up and 200 steps stay at 0 (docs/recipe.md).


def _passkey_rng(seed: int, index: int) -> random.Random:
    # a string seed is hashed with SHA-512: deterministic across processes, one stream per (seed, index)
    return random.Random(f"passkey:{seed}:{index}")


def _draw_passkey(rng: random.Random, digits: int = PASSKEY_DIGITS) -> tuple[int, float]:
    """(key of ``digits`` digits, depth in [0, 1)); one digit is 0..9, more never start with 0."""
    return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10**digits - 1), rng.random()


#: The passkey task's needle and question; ``{key}`` is the key.
PASSKEY_NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key. "
PASSKEY_QUESTION = "What is the pass key? The pass key is "


def passkey_document(
    key: int,
    depth: float,
    context_length: int,
    tokenizer: PreTrainedTokenizerBase,
    *,
    needle: str = PASSKEY_NEEDLE,
    question: str = PASSKEY_QUESTION,
    filler: Sequence[str] = PASSKEY_FILLER,
    task: str = "passkey",
) -> Document:
    """The passkey document of exactly ``context_length`` tokens (Note [Passkey rows]);
    ``needle``, ``question`` and the ``filler`` sentences make other needle-in-a-haystack
    tasks of the same shape (``recipes/eval_longctx.py``), ``task`` names it in errors."""
    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    bos = [] if tokenizer.bos_token_id is None else [tokenizer.bos_token_id]
    needle = encode(needle.format(key=key))
    question = encode(question)
    answer = encode(str(key)) + [_eos_id(tokenizer)]
    budget = context_length - len(bos) - len(needle) - len(question) - len(answer)
    if budget < 0:
        raise ValueError(
            f"--context_length {context_length} is too short for the {task} task: "
            f"it needs at least {context_length - budget} tokens"
        )
    sentences = [encode(sentence) for sentence in filler]
    starts, filler = [], []  # starts: offset of each sentence in the filler
    while len(filler) < budget:
        starts.append(len(filler))
        filler += sentences[(len(starts) - 1) % len(sentences)]
    excess = len(filler) - budget  # drop it from the front: the answer must end the row
    filler = filler[excess:]
    boundaries = [start - excess for start in starts if start >= excess] + [budget]
    insert = max((boundary for boundary in boundaries if boundary <= depth * budget), default=boundaries[0])
    prompt = bos + filler[:insert] + needle + filler[insert:] + question
    return prompt + answer, [False] * len(prompt) + [True] * len(answer)


def passkey_example(
    rng: random.Random,
    context_length: int,
    tokenizer: PreTrainedTokenizerBase,
    *,
    key: int | None = None,
    depth: float | None = None,
    digits: int = PASSKEY_DIGITS,
    **task: Any,
) -> Row:
    """One passkey row of exactly ``context_length`` tokens, key (``digits`` digits) and depth drawn
    from ``rng`` unless given;
    ``task``: another needle, question or filler (``passkey_document``'s keywords).

    Returns ``{"input_ids", "labels", "position_ids"}`` of (L,) LongTensors; labels
    (shifted) are -100 except on the targets of the answer digits and eos.
    """
    drawn_key, drawn_depth = _draw_passkey(rng, digits)
    document = passkey_document(
        drawn_key if key is None else key, drawn_depth if depth is None else depth, context_length, tokenizer, **task
    )
    (row,) = _pack([document], context_length, _pad_id(tokenizer))
    return row


def passkey_rows(
    num_rows: int, context_length: int, tokenizer: PreTrainedTokenizerBase, seed: int = 0, digits: int = PASSKEY_DIGITS
) -> list[Row]:
    """``num_rows`` passkey rows; row i depends only on (seed, i). Eval rows use seed + PASSKEY_EVAL_SEED_OFFSET."""
    return [
        passkey_example(_passkey_rng(seed, index), context_length, tokenizer, digits=digits) for index in range(num_rows)
    ]


def passkey_warmup_stages(context_length: int) -> list[int]:
    """Documents per row of each stage of a passkey length warm-up (8, 4, 2: those whose
    documents hold at least ``MIN_PASSKEY_DOCUMENT`` tokens); empty: no warm-up at this length."""
    return [parts for parts in (8, 4, 2) if context_length // parts >= MIN_PASSKEY_DOCUMENT]


def passkey_warmup_lengths(num_rows: int, context_length: int, warmup_rows: int) -> list[int]:
    """The document lengths of ``num_rows`` passkey training rows whose first ``warmup_rows``
    pack shorter documents (Note [Passkey length warm-up]): equal shares of rows of
    documents of context_length // 8, // 4 and // 2 tokens (those of at least
    ``MIN_PASSKEY_DOCUMENT`` tokens), shortest first, then one document per row. The last
    document of a warm-up row takes the row's remainder, so documents never cross rows."""
    if not 0 <= warmup_rows <= num_rows:
        raise ValueError(f"warmup_rows must be in 0..{num_rows} (the rows), got {warmup_rows}")
    stages = passkey_warmup_stages(context_length)
    lengths = []
    for row in range(num_rows):
        parts = stages[row * len(stages) // warmup_rows] if stages and row < warmup_rows else 1
        size = context_length // parts
        lengths += [size] * (parts - 1) + [context_length - size * (parts - 1)]
    return lengths


# ----------------------------------------------------------------------------- top level


def build_rows(
    dataset: str,
    tokenizer: PreTrainedTokenizerBase,
    context_length: int,
    cp: int = 1,
    split: str = "train",
    seed: int = 0,
    num_samples: int | None = None,
    truncate: bool = False,
    passkey_digits: int = PASSKEY_DIGITS,
    passkey_warmup_rows: int = 0,
) -> list[Row]:
    """The packed rows of one split of ``--dataset``: what the trainer feeds the loader.

    ``"passkey"``: ``num_samples`` rows (default ``DEFAULT_PASSKEY_SAMPLES``), the
    same as ``passkey_rows(num_samples, ..., seed, passkey_digits)`` for train, with seed +
    ``PASSKEY_EVAL_SEED_OFFSET`` for eval; on train, the first ``passkey_warmup_rows``
    pack shorter documents (``passkey_warmup_lengths``). Files and hub ids: every packed row of
    the split (``num_samples`` does not apply); eval holds out the last ~5% of
    the documents, which always gives at least one row. A document longer than
    ``context_length`` goes on in the next row, or with ``truncate`` keeps only its first
    ``context_length`` tokens (``truncate_document``).
    """
    check_context_length(context_length, cp)
    num_passkey = DEFAULT_PASSKEY_SAMPLES if num_samples is None else num_samples
    lengths = None
    if dataset == PASSKEY and passkey_warmup_rows and _check_split(split) == "train":
        lengths = passkey_warmup_lengths(num_passkey, context_length, passkey_warmup_rows)
    examples = load_examples(dataset, split, seed, num_passkey, passkey_digits, lengths)
    documents = (tokenize_example(example, tokenizer, context_length) for example in examples)
    if truncate:
        documents = (truncate_document(document, context_length) for document in documents)
    try:
        return _pack(documents, context_length, _pad_id(tokenizer))
    except ValueError as error:
        raise ValueError(f"--dataset {dataset!r} ({split} split): {error}") from None


# ----------------------------------------------------------------------------- loading batches


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
            batch = {key: torch.stack([self.rows[i][key] for i in mine.tolist()]) for key in self.rows[0]}  # (B, L)
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
