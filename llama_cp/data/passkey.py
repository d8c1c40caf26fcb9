"""The synthetic passkey task (``--dataset passkey``): a key hidden at some depth of filler
text and asked for at the end, only the answer trained. Its examples, documents and rows, and
the length warm-up whose first rows pack several shorter passkey documents.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import datasets

from llama_cp.data.packing import Document, Row, _eos_id, _pack, _pad_id

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

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
    tasks of the same shape (``llama_cp/eval/needle.py``), ``task`` names it in errors."""
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


def passkey_examples(
    split: str,
    seed: int = 0,
    num_passkey: int = DEFAULT_PASSKEY_SAMPLES,
    passkey_digits: int = PASSKEY_DIGITS,
    passkey_lengths: Sequence[int] | None = None,
) -> datasets.Dataset:
    """The examples of ``--dataset passkey``'s ``split`` ("train" or "eval"): ``num_passkey`` draws,
    columns ``passkey`` (the key, ``passkey_digits`` digits) and ``depth`` (where the key sits,
    0..1), drawn from (seed, index); eval uses seed + ``PASSKEY_EVAL_SEED_OFFSET``. With
    ``passkey_lengths`` (one per draw, ``passkey_warmup_lengths``) a column ``length`` gives each
    document's tokens; without, every document fills a row."""
    stream_seed = seed if split == "train" else seed + PASSKEY_EVAL_SEED_OFFSET
    count = num_passkey if passkey_lengths is None else len(passkey_lengths)
    draws = [_draw_passkey(_passkey_rng(stream_seed, index), passkey_digits) for index in range(count)]
    keys, depths = zip(*draws) if draws else ((), ())
    columns = {"passkey": list(keys), "depth": list(depths)}
    if passkey_lengths is not None:
        columns["length"] = list(passkey_lengths)
    return datasets.Dataset.from_dict(columns)


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
