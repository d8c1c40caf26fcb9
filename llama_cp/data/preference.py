"""Preference pairs for DPO: TRL's preference formats made into (chosen, rejected) documents, and
pairs packed into rows of exactly ``context_length`` tokens, each pair whole in one row.

    preference    {"prompt": str, "chosen": str, "rejected": str}
                  each sequence is ``[bos] + prompt + completion + eos``, only the completion
                  and eos scored; or three message lists
                  {"prompt": [{"role", "content"}, ...], "chosen": [..., {"role": "assistant", ...}],
                  "rejected": [...]}, prompt + completion rendered as one conversation with the
                  chat template, only the completion's last (assistant) message scored, with the
                  end-of-turn token the template writes (llama_cp.data.chat)
    implicit_preference
                  {"chosen": [messages], "rejected": [messages]}: the prompt is the two
                  conversations' longest common prefix of messages (TRL's implicit prompt);
                  then as the conversational preference format

A *sequence* is one document (input_ids, label_mask) whose label mask marks only the scored
completion tokens; the DPO loss sums each sequence's log-probabilities over them. How the
pairs sit in rows, and what tells the loss which sequence is which: Note [Packed preference pairs].
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from llama_cp.data.chat import ChatRenderError, chat_segments
from llama_cp.data.formats import PREFERENCE_KINDS, _encode_document, detect_format
from llama_cp.data.packing import IGNORE_INDEX, Document, Row, shifted_labels
from llama_cp.parallel.sharding import check_context_length

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

#: (chosen, rejected) sequences of one preference example, each a complete prompt + completion.
Pair = tuple[Document, Document]

#: The accepted preference formats, as the error for rows that match none lists them.
PREFERENCE_FORMATS = (
    "preference: 'prompt', 'chosen' and 'rejected' columns (strings, or message lists)",
    "implicit_preference: 'chosen' and 'rejected' columns, message lists that start with the same prompt",
)

#: Row keys of the packed pairs, besides input_ids / labels / position_ids (Note [Packed preference pairs]),
#: and of a row's index in its split (``PreferenceRows``).
SEQUENCE_IDS, PAIR_COUNT, ROW_INDEX = "sequence_ids", "pair_count", "row_index"
#: Batch keys a step adds (``batch_sequences``; the trainer's precomputed reference, llama_cp.train.reference).
SEQUENCE_LENGTHS, REFERENCE_LOGPS = "sequence_lengths", "reference_logps"


def detect_preference_format(columns: Iterable[str]) -> str:
    """"preference" or "implicit_preference" from the column names; ValueError otherwise."""
    columns = list(columns)
    try:
        kind = detect_format(columns)
    except ValueError:
        kind = None
    if kind not in PREFERENCE_KINDS:
        raise ValueError(
            f"rows have columns {sorted(columns)}, which match none of the preference formats: "
            + "; ".join(PREFERENCE_FORMATS)
        )
    return kind


def tokenize_pair(example: Mapping[str, Any], tokenizer: PreTrainedTokenizerBase) -> Pair:
    """(chosen, rejected) documents of one preference example; ChatRenderError (the caller names
    the row) when it cannot be made into a pair.

    Strings: each sequence is encoded as the one text prompt + completion (Note [Encoding the
    whole text] in llama_cp/data/formats.py) and closed with eos, which is scored; the prompt
    starts with the tokenizer's bos when it has one. TRL's ``DPOTrainer.tokenize_row`` differs
    there: it encodes the prompt and each completion apart (so the prompt's tokens are the same
    in both sequences, and a token that spans the prompt's end is split) and gives a decoder-only
    model's prompt no bos; here a sequence is tokenized as SFT tokenizes a prompt-completion
    document, as the model sees the text at inference.

    Messages: prompt + completion are rendered as one conversation and only the completion's
    last message, which must be an assistant's, is scored, from its header's end through its
    end-of-turn token; assistant messages before it (in the prompt, or earlier in the
    completion) are prompt.
    """
    kind = detect_preference_format(example.keys())
    chosen, rejected = example["chosen"], example["rejected"]
    if kind == "implicit_preference":
        prompt, chosen, rejected = implicit_prompt(chosen, rejected)
    else:
        prompt = example["prompt"]
    if isinstance(prompt, str) and isinstance(chosen, str) and isinstance(rejected, str):
        return (_encode_document([(prompt, False), (chosen, True)], tokenizer),
                _encode_document([(prompt, False), (rejected, True)], tokenizer))
    if isinstance(prompt, list) and isinstance(chosen, list) and isinstance(rejected, list):
        tools = example.get("tools")
        return _conversation_document(prompt, chosen, "chosen", tokenizer, tools), \
            _conversation_document(prompt, rejected, "rejected", tokenizer, tools)
    raise ChatRenderError(
        f"'prompt', 'chosen' and 'rejected' must all be strings or all be message lists, got "
        f"{type(prompt).__name__}, {type(chosen).__name__} and {type(rejected).__name__}"
    )


def implicit_prompt(chosen: Any, rejected: Any) -> tuple[list, list, list]:
    """(prompt, chosen completion, rejected completion) of an implicit-prompt example: the prompt
    is the longest common prefix of the two message lists, as TRL's ``extract_prompt`` takes it.
    ChatRenderError when they are not message lists, share no first message, or one holds the
    whole of the other (nothing left to score)."""
    if not isinstance(chosen, list) or not isinstance(rejected, list):
        raise ChatRenderError(
            f"'chosen' and 'rejected' without a 'prompt' must be message lists whose shared first messages are the "
            f"prompt, got {type(chosen).__name__} and {type(rejected).__name__}; add a 'prompt' column"
        )
    shared = 0
    while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
        shared += 1
    if shared == 0:
        raise ChatRenderError(
            "'chosen' and 'rejected' share no first message, so there is no implicit prompt (their longest common "
            "prefix); start both with the same prompt messages, or add a 'prompt' column"
        )
    if shared in (len(chosen), len(rejected)):
        same = "'chosen' and 'rejected' are the same conversation" if len(chosen) == len(rejected) else \
            f"'{'chosen' if shared == len(chosen) else 'rejected'}' is all prompt (the other conversation starts with it)"
        raise ChatRenderError(f"{same}, so it has no completion to score; fix or drop the row")
    return chosen[:shared], chosen[shared:], rejected[shared:]


def _conversation_document(
    prompt: list, completion: list, column: str, tokenizer: PreTrainedTokenizerBase, tools: Any = None
) -> Document:
    """The document of prompt + completion messages (with the row's ``tools``: Note [A row's tools]),
    only the last (assistant) message scored."""
    last = completion[-1] if completion else None
    if not isinstance(last, Mapping) or last.get("role") != "assistant":
        got = "no messages" if last is None else f"a last message {str(last)[:60]!r}"
        raise ChatRenderError(
            f"the {column!r} completion must end with an assistant message, which is what is scored; got {got}"
        )
    messages = [*prompt, *completion]
    return _encode_document(chat_segments(messages, tokenizer, first_trained=len(messages) - 1, tools=tools),
                            tokenizer)


def preference_pairs(examples: Iterable[Mapping[str, Any]], tokenizer: PreTrainedTokenizerBase) -> Iterator[Pair]:
    """The pairs of ``examples`` in order; a row that cannot be made into a pair raises
    ChatRenderError naming it (rows count from 1, as check_required_values counts them)."""
    for number, example in enumerate(examples, start=1):
        try:
            yield tokenize_pair(example, tokenizer)
        except ChatRenderError as error:
            raise ChatRenderError(f"row {number}: {error}") from None


# Note [Packed preference pairs]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# DPO compares the log-probability of a pair's chosen and rejected completions, so both must
# be scored whole, by the same forward pass: a pair's two sequences sit side by side in ONE
# row, chosen first, and a pair is never split over rows (unlike SFT documents, Note [Packed
# rows]). Pairs go into rows in order; a pair that does not fit the space left starts the next
# row and the row is padded. A pair longer than L is refused, or with ``truncate`` its two
# completions are cut from the end (``truncate_pair``). Within a row each sequence is a
# document as in Note [Packed rows]: labels shifted (labels[t] is the target of input t, -100
# when token t+1 is not scored or in another sequence), position_ids from 0 in each sequence,
# padding with labels -100 and positions continuing. Two keys tell the loss which is which:
#
#   sequence_ids (L,)  the sequence labels[t] scores, aligned with the labels: pair k's chosen
#                      sequence is 2k, its rejected 2k+1 (k counts pairs within the row, from
#                      0), where labels[t] != -100; -1 elsewhere (prompts, each sequence's last
#                      token, padding). A loss needs no labels to group its token terms, and
#                      counts a sequence's completion tokens as (sequence_ids == s).sum().
#   pair_count   ()    the row's number of pairs (sequences 0 .. 2 x pair_count - 1), so every
#                      cp rank knows it without seeing all of the row's tokens; in a batch, row
#                      b's sequences follow the earlier rows' (offset 2 x pair_count[:b].sum()).
#
# L = 12, prompt "Q", chosen "ab", rejected "c" (B = bos, E = eos, P = padding, - = -100):
#
#   input_ids      B  Q  a  b  E  B  Q  c  E  P  P  P
#   labels         -  a  b  E  -  -  c  E  -  -  -  -
#   position_ids   0  1  2  3  4  0  1  2  3  4  5  6
#   sequence_ids  -1  0  0  0 -1 -1  1  1 -1 -1 -1 -1        pair_count 1
#
# sequence_ids is a per-token (B, L) tensor like labels, so ``shard_batch`` hands each cp rank
# the same positions of both (zigzag or "documents"); pair_count, (B,) in a batch, is passed
# through. Per-sequence sums are then a scatter-add over sequence_ids on each rank and a sum
# over the cp group.


def truncate_pair(pair: Pair, context_length: int) -> Pair:
    """The pair with its completions cut from the end so that both sequences fit ``context_length``
    tokens (``--truncate_documents``); the prompt, everything before the first scored token, is
    kept whole. The completions are cut to one length (the shorter is kept whole when the longer
    one's cut leaves room for it), each keeps at least one token: ValueError when the prompts
    leave no room for that. A pair that fits is returned as it is."""
    (chosen_ids, chosen_mask), (rejected_ids, rejected_mask) = pair
    chosen_prompt, rejected_prompt = _prompt_length(chosen_mask, "chosen"), _prompt_length(rejected_mask, "rejected")
    chosen_completion, rejected_completion = len(chosen_ids) - chosen_prompt, len(rejected_ids) - rejected_prompt
    budget = context_length - chosen_prompt - rejected_prompt  # tokens left for the two completions
    if chosen_completion + rejected_completion <= budget:
        return pair
    if budget < 2:
        raise ValueError(
            f"the prompts ({chosen_prompt} + {rejected_prompt} tokens) leave {max(budget, 0)} of the row's "
            f"{context_length} tokens for the two completions, which keep at least one token each; raise "
            f"--context_length or drop the row"
        )
    cut = budget // 2
    shorter = min(chosen_completion, rejected_completion)
    if shorter <= cut:  # the shorter completion fits whole, the longer gets the rest
        cut = budget - shorter
    chosen_end, rejected_end = chosen_prompt + min(chosen_completion, cut), rejected_prompt + min(rejected_completion, cut)
    return (chosen_ids[:chosen_end], chosen_mask[:chosen_end]), (rejected_ids[:rejected_end], rejected_mask[:rejected_end])


def _prompt_length(label_mask: Sequence[bool], column: str) -> int:
    """The index of the first scored token; ValueError when there is none."""
    for index, scored in enumerate(label_mask):
        if scored:
            return index
    raise ValueError(f"the {column} sequence has no scored token (its label_mask is all False); a pair needs a "
                     f"completion in both sequences")


class PairPacker:
    """Packs (chosen, rejected) pairs one at a time into the rows of Note [Packed preference pairs]:
    ``add`` returns the rows a pair completed (at most one: the row it did not fit), ``finish``
    the last, padded one. A pair longer than the row is refused (ValueError) unless
    ``truncate`` (``truncate_pair``); counts: ``pairs``, ``tokens`` (of the pairs, after
    truncation), ``truncated``."""

    def __init__(self, context_length: int, pad_id: int = 0, truncate: bool = False):
        self.context_length, self.pad_id, self.truncate = context_length, pad_id, truncate
        self.waiting: list[Pair] = []  # the pairs of the row being filled
        self.used = 0  # their tokens
        self.pairs = self.tokens = self.truncated = 0

    def add(self, pair: Pair) -> list[Row]:
        index, self.pairs = self.pairs, self.pairs + 1
        try:
            for (ids, mask), column in zip(pair, ("chosen", "rejected")):
                if len(ids) != len(mask):
                    raise ValueError(f"the {column} sequence has {len(ids)} input_ids but {len(mask)} label_mask entries")
                _prompt_length(mask, column)
            length = len(pair[0][0]) + len(pair[1][0])
            if length > self.context_length:
                if not self.truncate:
                    raise ValueError(
                        f"its sequences ({len(pair[0][0])} + {len(pair[1][0])} tokens) do not fit a row of "
                        f"--context_length {self.context_length} and a pair is never split over rows; raise "
                        f"--context_length, or pass --truncate_documents to cut the completions"
                    )
                pair = truncate_pair(pair, self.context_length)
                length = len(pair[0][0]) + len(pair[1][0])
                self.truncated += 1
        except ValueError as error:
            raise ValueError(f"preference pair {index}: {error}") from None
        rows = []
        if self.used + length > self.context_length:
            rows.append(_pack_row(self.waiting, self.context_length, self.pad_id))
            self.waiting, self.used = [], 0
        self.waiting.append(pair)
        self.used += length
        self.tokens += length
        return rows

    def finish(self) -> list[Row]:
        """The last row (none when no pair is waiting); then the packer is empty."""
        rows = [_pack_row(self.waiting, self.context_length, self.pad_id)] if self.waiting else []
        self.waiting, self.used = [], 0
        return rows


def pack_pairs(
    pairs: Iterable[Pair], context_length: int, cp: int = 1, pad_id: int = 0, truncate: bool = False
) -> list[Row]:
    """Pack (chosen, rejected) pairs into rows of exactly ``context_length`` tokens, each pair whole
    in one row: Note [Packed preference pairs] (:class:`PairPacker` over all of them).

    Returns rows ``{"input_ids", "labels", "position_ids", "sequence_ids"}`` of (L,) LongTensors
    and ``"pair_count"``, a 0-d LongTensor. A pair longer than L is refused (ValueError) unless
    ``truncate`` (``truncate_pair``). ValueError also when L is not a multiple of 2 x cp, when a
    sequence has no scored token, or when there are no pairs.
    """
    check_context_length(context_length, cp)
    packer = PairPacker(context_length, pad_id, truncate)
    rows = [row for pair in pairs for row in packer.add(pair)] + packer.finish()
    if not rows:
        raise ValueError("no preference pairs to pack: the data holds no (chosen, rejected) example")
    return rows


def sequences_of_row(row: Row) -> Row:
    """``row`` with its ``sequence_ids`` and ``pair_count`` (Note [Packed preference pairs]) made
    from its position_ids and labels, as prepared rows keep them: each document (a run of
    positions going up by one) is one sequence, numbered in order, its label positions scored."""
    positions = row["position_ids"]
    starts = torch.ones_like(positions, dtype=torch.bool)
    starts[1:] = positions[1:] != positions[:-1] + 1
    sequence = torch.cumsum(starts.long(), 0) - 1  # the padding continues the last sequence's positions
    count = int(sequence[-1]) + 1
    if count % 2:
        raise ValueError(f"a preference row holds {count} sequences, not whole pairs: were these rows prepared "
                         "for --objective dpo?")
    return {**row, SEQUENCE_IDS: torch.where(row["labels"] != IGNORE_INDEX, sequence, -1),
            PAIR_COUNT: torch.tensor(count // 2)}


class PreferenceRows:
    """Rows of packed pairs as the trainer reads them: each ``rows[i]`` with its ``sequence_ids``
    and ``pair_count`` (``sequences_of_row``: prepared rows store no more than SFT rows) and
    ``row_index`` (i, a 0-d LongTensor: where its reference log-probabilities are,
    ``llama_cp.train.reference``)."""

    def __init__(self, rows: Sequence[Row]):
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> Row:
        return {**sequences_of_row(self.rows[index]), ROW_INDEX: torch.tensor(index)}


def _pack_row(pairs: Sequence[Pair], context_length: int, pad_id: int) -> Row:
    """One row of whole pairs, padded to ``context_length`` (Note [Packed preference pairs])."""
    input_ids, labels, positions, sequence_ids = [], [], [], []
    for sequence, (ids, mask) in enumerate(document for pair in pairs for document in pair):  # 2k, 2k + 1
        sequence_input_ids = torch.tensor(ids, dtype=torch.long)  # (n,)
        sequence_labels = shifted_labels(sequence_input_ids, mask)  # as packed documents' (Note [Packed rows])
        input_ids.append(sequence_input_ids)
        labels.append(sequence_labels)
        positions.append(torch.arange(len(ids)))
        sequence_ids.append(torch.where(sequence_labels != IGNORE_INDEX, sequence, -1))  # aligned with the labels
    padding = context_length - sum(len(ids) for ids in input_ids)
    input_ids.append(torch.full((padding,), pad_id, dtype=torch.long))
    labels.append(torch.full((padding,), IGNORE_INDEX, dtype=torch.long))
    positions.append(positions[-1][-1] + 1 + torch.arange(padding))
    sequence_ids.append(torch.full((padding,), -1, dtype=torch.long))
    return {
        "input_ids": torch.cat(input_ids), "labels": torch.cat(labels), "position_ids": torch.cat(positions),
        SEQUENCE_IDS: torch.cat(sequence_ids), PAIR_COUNT: torch.tensor(len(pairs)),
    }


def passkey_pairs(
    num_rows: int, context_length: int, tokenizer: PreTrainedTokenizerBase, split: str = "train", seed: int = 0,
    digits: int = 1, pairs_per_row: Sequence[int] | None = None,
) -> list[Pair]:
    """The built-in preference task (``--objective dpo --dataset passkey``), ``num_rows`` rows of
    pairs: each pair a passkey document (Note [Passkey rows]) answered with its own key (chosen)
    and with another key of as many digits (rejected), the two sharing the prompt; the key and
    where it sits drawn from (seed, pair index) as the SFT task draws them, eval from seed +
    PASSKEY_EVAL_SEED_OFFSET. Row i holds ``pairs_per_row[i]`` pairs (default 1) whose sequences
    take ``context_length / (2 x pairs)`` tokens each, so ``pack_pairs`` packs them as given
    (a length warm-up: Note [Passkey length warm-up])."""
    from llama_cp.data.passkey import PASSKEY_EVAL_SEED_OFFSET, _draw_passkey, _passkey_rng, passkey_document

    stream_seed = seed if split == "train" else seed + PASSKEY_EVAL_SEED_OFFSET
    pairs = []
    for count in pairs_per_row or [1] * num_rows:
        for _ in range(count):
            rng = _passkey_rng(stream_seed, len(pairs))
            key, depth = _draw_passkey(rng, digits)
            wrong = key
            while wrong == key:
                wrong = _draw_passkey(rng, digits)[0]
            right_answer, wrong_answer = (tokenizer.encode(str(k), add_special_tokens=False) for k in (key, wrong))
            slack = max(0, len(wrong_answer) - len(right_answer))  # both sequences fit their share of the row
            ids, mask = passkey_document(key, depth, context_length // (2 * count) - slack, tokenizer)
            prompt = len(ids) - len(right_answer) - 1  # the answer's digits and eos end the document
            rejected = ids[:prompt] + wrong_answer + ids[-1:]
            pairs.append(((ids, mask), (rejected, mask[:prompt] + [True] * (len(wrong_answer) + 1))))
    return pairs


def batch_sequences(batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A (B, L) batch of preference rows numbered as one: row b's sequence ids follow the earlier
    rows' (offset 2 x pair_count[:b].sum()), so the batch holds sequences 0 .. 2P - 1, chosen
    even, rejected odd; adds ``sequence_lengths`` (2P,), the scored tokens of each. Called on the
    whole rows, before ``shard_batch`` (which passes the (2P,) and (B,) tensors through)."""
    ids, counts = batch[SEQUENCE_IDS], batch[PAIR_COUNT].reshape(-1)
    offsets = 2 * (torch.cumsum(counts, 0) - counts)
    numbered = torch.where(ids >= 0, ids + offsets[:, None], -1)
    lengths = torch.bincount(numbered[numbered >= 0], minlength=2 * int(counts.sum()))
    return {**batch, SEQUENCE_IDS: numbered, SEQUENCE_LENGTHS: lengths}
