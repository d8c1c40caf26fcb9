"""Packing tokenized documents into rows of exactly ``context_length`` tokens: labels shifted
to next-token targets once, here, and ``position_ids`` counting from 0 in each document; all
documents at once (``pack_documents``) or one at a time, resumably (``RowPacker``).

A document's ``label_mask[t]`` says whether token t is a training *target*
(predicted from tokens 0..t-1). No attention mask is built anywhere: a (L, L)
mask at L = 131072 is what crashed Megatron-LM's loader; documents are told
apart by ``position_ids``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from llama_cp.parallel.sharding import check_context_length

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

#: (input_ids, label_mask) of one document; label_mask[t]: token t is a training target.
Document = tuple[list[int], list[bool]]
#: One packed row: ``input_ids``, ``labels``, ``position_ids``, each a (L,) LongTensor.
Row = dict[str, torch.Tensor]
#: The label of a position that is not trained (Note [Packed rows]): PyTorch's cross-entropy
#: default ignore_index, which the loss (llama_cp/model/loss.py, cross_entropy.py) reads from here.
IGNORE_INDEX = -100


def _eos_id(tokenizer: PreTrainedTokenizerBase) -> int:
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no eos token; every packed document must end with one")
    return tokenizer.eos_token_id


def _pad_id(tokenizer: PreTrainedTokenizerBase) -> int:
    """The pad id, or eos for tokenizers without one (Llama 3): padded positions are never trained."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else _eos_id(tokenizer)


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


def shifted_labels(ids: torch.Tensor, mask) -> torch.Tensor:
    """(n,) labels of one document: the target of token t is token t+1, kept where token t+1 is
    trained (``mask``), -100 elsewhere; the last token has none."""
    labels = torch.full_like(ids, IGNORE_INDEX)
    labels[:-1] = ids[1:].masked_fill(~torch.as_tensor(mask, dtype=torch.bool)[1:], IGNORE_INDEX)
    return labels


def _pack(documents: Iterable[Document], context_length: int, pad_id: int) -> list[Row]:
    input_ids, labels, positions = [], [], []
    for index, (ids, mask) in enumerate(documents):
        if len(ids) != len(mask):
            raise ValueError(f"document {index}: {len(ids)} input_ids but {len(mask)} label_mask entries")
        if not ids:
            continue
        document_ids = torch.tensor(ids, dtype=torch.long)  # (n,)
        document_labels = shifted_labels(document_ids, mask)
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
        self.unscored_rows = 0  # rows without a label (a long prompt's middle): they train nothing
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
        document_labels = shifted_labels(document_ids, mask)
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
        self.unscored_rows += bool((row["labels"] == IGNORE_INDEX).all())
        after = (self.pieces[0][0], self.pieces[0][1]) if self.pieces else (self.next_document, 0)
        return row, after
