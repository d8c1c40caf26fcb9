"""The formats of a dataset's examples, told apart by their columns, and the columns each
needs; one example made into a document: its token ids and which of them are trained.

    text          {"text": str}                                  every token is trained
    prompt_completion
                  {"prompt": str, "completion": str}             TRL's prompt-completion format:
                  only the completion and eos are trained; or both message lists
                  {"prompt": [{"role", "content"}, ...], "completion": [{"role": "assistant", ...}]},
                  rendered as one conversation, only the completion's assistant turns trained
    instruction   {"instruction": str, "input": str (optional), "output": str}   (alpaca)
                  the prompt is not trained, only the response and eos
    chat          {"messages": [{"role": str, "content": str}, ...]}
                  only the assistant turns (and the end of each turn) are trained;
                  rendered with the tokenizer's chat template or --chat_template's, refused
                  without one (llama_cp.data.chat); an optional "tools" (a list of tool
                  definitions, or its JSON string) is given to the template, for message lists
                  of the other formats too (Note [A row's tools])
    passkey       {"passkey": int, "depth": float, "length": int (optional)}
                  the synthetic task (llama_cp.data.passkey), only the answer is trained
    preference, implicit_preference
                  {"prompt", "chosen", "rejected"} or {"chosen", "rejected"}: pairs for
                  --objective dpo (llama_cp.data.preference); refused by the SFT objective
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from llama_cp.data.chat import ChatRenderError, chat_segments
from llama_cp.data.grammar import FORMAT_COLUMNS  # noqa: F401 - the columns these formats read
from llama_cp.data.packing import Document, _eos_id
from llama_cp.data.passkey import passkey_document

if TYPE_CHECKING:
    import datasets
    from transformers import PreTrainedTokenizerBase

#: The accepted example formats, as the error for rows that match none lists them.
ACCEPTED_FORMATS = (
    "text: a 'text' column",
    "prompt_completion: 'prompt' and 'completion' columns (strings, or message lists)",
    "instruction (alpaca): 'instruction' and 'output' columns, optional 'input'",
    "chat: a 'messages' column, a list of {'role', 'content'}",
    "preference (--objective dpo): 'prompt', 'chosen' and 'rejected' columns, or 'chosen' and 'rejected' "
    "conversations",
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

#: The columns each example format needs a value in (a missing key is read as null).
REQUIRED_COLUMNS = {"text": ("text",), "prompt_completion": ("prompt", "completion"),
                    "instruction": ("instruction", "output"), "chat": ("messages",),
                    "preference": ("prompt", "chosen", "rejected"), "implicit_preference": ("chosen", "rejected")}

#: The formats of preference pairs (--objective dpo), which the SFT objective refuses.
PREFERENCE_KINDS = ("preference", "implicit_preference")


def check_required_values(examples: datasets.Dataset, dataset: str, flag: str = "--dataset") -> None:
    """ValueError when rows lack a value their format needs (a JSON row without the key, or
    null): such a row would otherwise be dropped or trained as empty without a word. Row
    numbers count from 1 over the loaded rows (a JSONL file's lines, blank lines aside)."""
    import pyarrow.compute as pc

    try:
        kind = detect_format(examples.column_names)
    except ValueError as error:
        raise ValueError(f"{flag} {dataset!r}: {error}") from None
    for column in REQUIRED_COLUMNS.get(kind, ()):
        values = examples.data.column(column)
        if values.null_count == 0:
            continue
        missing = pc.indices_nonzero(pc.is_null(values)).to_pylist()
        shown = ", ".join(str(i + 1) for i in missing[:5]) + (", ..." if len(missing) > 5 else "")
        raise ValueError(
            f"{flag} {dataset!r}: {len(missing)} of {len(examples)} rows have no {column!r} value "
            f"(missing or null; rows {shown}), which the {kind} format needs; fix or drop those rows"
        )


# Note [JSON objects stored as structs]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A tool call's arguments and a tool's parameters are JSON objects of any shape: {"city": "Rome"}
# in one row, {"query": "cats", "limit": 3} in the next. datasets before 4.7 (no Json feature in
# the 4.0 to 4.6 wheels; 3.0.0 run) stores such a column as one Arrow struct for every row, whose
# fields are the keys of all rows together, so every row reads back with the keys it never had,
# as null: {"city": "Rome", "query": null, "limit": null}. The chat template then writes those
# nulls, and the model learns to emit them. datasets 4.7 and later (4.7.0, 4.8.5 and 5.2 run)
# read JSON lines into their Json feature and keep each object as written; a parquet file keeps
# whatever schema it was written with. So wherever such an object is a struct and a row holds a
# null in it, the source is refused: a null there cannot be told
# from a key the row never had.

#: The keys whose values are JSON objects of any shape (Note [JSON objects stored as structs]).
FREE_FORM_KEYS = ("arguments", "properties")


def free_form_struct_paths(features: datasets.Features | None) -> dict[str, list[tuple[str, ...]]]:
    """Column -> where its type holds a tool call's arguments or a tool's parameters as a struct
    (Note [JSON objects stored as structs]); {} when the features are unknown or hold none."""
    import pyarrow as pa

    def paths(kind, path):
        if pa.types.is_list(kind) or pa.types.is_large_list(kind):
            yield from paths(kind.value_type, path)
        elif pa.types.is_struct(kind):
            for field in kind:
                if field.name in FREE_FORM_KEYS and pa.types.is_struct(field.type):
                    yield (*path, field.name)
                else:
                    yield from paths(field.type, (*path, field.name))

    if features is None:
        return {}
    schema = features.arrow_schema
    found = {name: list(paths(schema.field(name).type, ())) for name in schema.names}
    return {name: where for name, where in found.items() if where}


def check_free_form_nulls(example: Mapping[str, Any], paths: Mapping[str, list[tuple[str, ...]]], row: str,
                          dataset: str, flag: str = "--dataset") -> None:
    """ValueError naming ``row`` when ``example`` holds a null where ``paths`` (of
    ``free_form_struct_paths``) say an object is a struct (Note [JSON objects stored as structs])."""
    for column, where in paths.items():
        for path in where:
            nulls = _nulls_at(example.get(column), path)
            if nulls:
                import datasets as installed

                raise ValueError(
                    f"{flag} {dataset!r}: {row}'s {column!r} has {'.'.join(path)} with {', '.join(nulls)}: null. The "
                    f"rows' {path[-1]} are stored as one struct whose keys are all rows' together (datasets "
                    f"{installed.__version__} reads JSON so; a parquet file may be written so), and a row reads back with "
                    f"the keys it never had as null, which the chat template would write: upgrade datasets (>= 4.7 "
                    f"keeps JSON objects as written) or store {path[-1]} as JSON strings (Note [JSON objects stored as "
                    "structs])"
                )


def check_free_form_structs(examples: datasets.Dataset, dataset: str, flag: str = "--dataset") -> None:
    """``check_free_form_nulls`` for every row of ``examples`` (rows count from 1)."""
    paths = free_form_struct_paths(examples.features)
    if paths:
        for index, example in enumerate(examples.select_columns(list(paths))):
            check_free_form_nulls(example, paths, f"row {index + 1}", dataset, flag)


def _nulls_at(value: Any, path: tuple[str, ...]) -> list[str]:
    """The keys holding None in the objects at ``path`` (through lists) of ``value``."""
    if isinstance(value, list):
        return next((found for item in value if (found := _nulls_at(item, path))), [])
    if not isinstance(value, Mapping):
        return []
    if not path:
        return [key for key, item in value.items() if item is None]
    return _nulls_at(value.get(path[0]), path[1:])


def detect_format(columns: Iterable[str]) -> str:
    """"chat", "prompt_completion", "preference", "implicit_preference", "instruction", "text" or
    "passkey" from the column names;
    ValueError otherwise. The most specific format wins (messages before prompt/completion
    before instruction before text)."""
    columns = set(columns)
    if "messages" in columns:
        return "chat"
    if {"prompt", "completion"} <= columns:
        return "prompt_completion"
    if {"chosen", "rejected"} <= columns:
        return "preference" if "prompt" in columns else "implicit_preference"
    if {"instruction", "output"} <= columns:
        return "instruction"
    if "text" in columns:
        return "text"
    if {"passkey", "depth"} <= columns:
        return "passkey"
    raise ValueError(
        f"rows have columns {sorted(columns)}, which match none of the accepted formats: "
        + "; ".join(ACCEPTED_FORMATS)
        + " (--dataset_columns text=COLUMN, or a source's :text=COLUMN, reads a format's column from another)"
    )


def check_objective(kind: str, objective: str, where: str = "the data") -> None:
    """ValueError when examples of format ``kind`` cannot train ``--objective objective``:
    preference pairs need dpo, and dpo needs them."""
    if objective == "dpo" and kind not in PREFERENCE_KINDS:
        raise ValueError(
            f"--objective dpo trains on preference pairs, and {where} is in the {kind} format: give rows with "
            "'prompt', 'chosen' and 'rejected' (or 'chosen' and 'rejected' conversations), or drop --objective dpo"
        )
    if objective != "dpo" and kind in PREFERENCE_KINDS:
        raise ValueError(
            f"{where} holds preference pairs ('chosen' and 'rejected' columns), which the next-token loss cannot "
            "train: pass --objective dpo (or give SFT data, e.g. a prompt_completion file of the chosen answers)"
        )


def tokenize_example(
    example: Mapping[str, Any], tokenizer: PreTrainedTokenizerBase, context_length: int | None = None
) -> Document:
    """(input_ids, label_mask) of one example: ``[bos] + tokens + [eos]``, bos only if the tokenizer has one.

    ``label_mask[t]`` is True when token t is a training target: every token but
    bos for text, the completion (or response) and eos for prompt_completion and
    instruction, the assistant turns for chat. A row that cannot be rendered raises
    ``ChatRenderError`` (the caller names the row). A passkey example has exactly its ``length`` tokens, or fills a row of
    ``context_length`` when it has none. An empty text gives an empty document
    (skipped by packing).
    """
    kind = detect_format(example.keys())
    check_objective(kind, "sft")
    if kind == "passkey":
        length = example.get("length") or context_length
        if length is None:
            raise ValueError("a passkey example fills a whole row: pass context_length to tokenize_example")
        return passkey_document(example["passkey"], example["depth"], length, tokenizer)
    if kind == "text":
        if not example["text"]:
            return [], []
        segments = [(example["text"], True)]
    elif kind == "prompt_completion":
        segments = prompt_completion_segments(example["prompt"], example["completion"], tokenizer,
                                              tools=example.get("tools"))
    elif kind == "instruction":
        template = ALPACA_PROMPT_WITH_INPUT if example.get("input") else ALPACA_PROMPT
        prompt = template.format(instruction=example["instruction"], input=example.get("input") or "")
        segments = [(prompt, False), (example["output"] or "", True)]
    else:
        segments = chat_segments(example["messages"], tokenizer, tools=example.get("tools"))
    return _encode_document(segments, tokenizer)


def prompt_completion_segments(
    prompt: Any, completion: Any, tokenizer: PreTrainedTokenizerBase, tools: Any = None
) -> list[tuple[str, bool]]:
    """(text, trained) pieces of a prompt-completion example: two strings, the prompt untrained;
    or two message lists rendered as one conversation with the chat template (and the row's
    ``tools``), only the completion's assistant turns trained (TRL's conversational prompt-completion)."""
    if isinstance(prompt, str) and isinstance(completion, str):
        return [(prompt, False), (completion, True)]
    if isinstance(prompt, list) and isinstance(completion, list):
        return chat_segments([*prompt, *completion], tokenizer, first_trained=len(prompt), tools=tools)
    raise ChatRenderError(
        f"'prompt' and 'completion' must both be strings or both be message lists, got "
        f"{type(prompt).__name__} and {type(completion).__name__}"
    )


# Note [Encoding the whole text]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A document's segments (prompt, completion, a chat's turns) are encoded as one
# text, as the model will see it at inference, and each token is trained when its
# first character lies in a trained segment; encoding the segments one by one
# would give other tokens where they meet (SentencePiece tokenizers start every
# piece with a word boundary, "▁"; a BPE merge may span the border), so the model
# would be trained on token sequences it never meets. Where the tokenizer gives no
# character offsets (a slow tokenizer), the segments are encoded one by one.


def _encode_document(segments: Sequence[tuple[str, bool]], tokenizer: PreTrainedTokenizerBase) -> Document:
    """Encode the (text, trained) segments as one text (Note [Encoding the whole text]) and close
    the document with bos / eos.

    eos is appended unless the text already ends with it (chat templates often
    do) and is trained when the last segment is.
    """
    eos = _eos_id(tokenizer)
    input_ids, label_mask = _encode_segments(segments, tokenizer)
    bos = tokenizer.bos_token_id
    if bos is not None and input_ids[:1] != [bos]:
        input_ids.insert(0, bos)
        label_mask.insert(0, False)
    if input_ids[-1:] != [eos]:
        input_ids.append(eos)
        label_mask.append(bool(segments) and segments[-1][1])
    label_mask[0] = False  # the first token of a document is never a target: no token of the document precedes it
    return input_ids, label_mask


def _encode_segments(segments: Sequence[tuple[str, bool]], tokenizer: PreTrainedTokenizerBase) -> Document:
    if len(segments) > 1 and getattr(tokenizer, "is_fast", False):
        text = "".join(piece for piece, _ in segments)
        encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        trained_chars = np.zeros(len(text) + 1, dtype=bool)  # (chars + 1,): a token starting at the end is not
        start = 0
        for piece, trained in segments:
            trained_chars[start : start + len(piece)] = trained
            start += len(piece)
        return list(encoding["input_ids"]), [bool(trained_chars[first]) for first, _ in encoding["offset_mapping"]]
    input_ids: list[int] = []
    label_mask: list[bool] = []
    for text, trained in segments:
        tokens = tokenizer.encode(text, add_special_tokens=False)
        input_ids += tokens
        label_mask += [trained] * len(tokens)
    return input_ids, label_mask
