"""The grammar of the data flags: ``--dataset`` and ``--eval_dataset`` as sources, each a local
path or hub id with options and a mixture weight (Note [Dataset sources]), and
``--dataset_columns``. The config parses and checks them with this module when it is made,
before anything is built, so it imports nothing but the standard library; reading the
sources it describes is ``llama_cp/data/sources.py``'s.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

#: ``--dataset`` value of the built-in synthetic long-context task (passkey retrieval).
PASSKEY = "passkey"
#: A ``--dataset`` ending like this names a local file (llama_cp.data.sources.FILE_BUILDERS
#: says which of them it reads), never a hub id.
LOCAL_FILE_SUFFIXES = (".json", ".jsonl", ".parquet", ".txt", ".csv", ".tsv", ".arrow", ".gz", ".zst")
#: The columns of the example formats (llama_cp.data.formats), which --dataset_columns and a
#: source's options may map to another column of the data.
FORMAT_COLUMNS = ("text", "prompt", "completion", "messages", "instruction", "input", "output", "chosen", "rejected",
                  "tools")
#: A source's options after its path or id (``org/corpus:config=en:split=train``).
SOURCE_OPTIONS = ("config", "split", "revision", "data_files", "weight")


# Note [Dataset sources]
# ~~~~~~~~~~~~~~~~~~~~~~
# --dataset (and --eval_dataset) is one source or a comma-separated mixture of them;
# each source is a path or hub id followed by ":"-separated options:
#
#   --dataset HuggingFaceFW/fineweb-edu:config=sample-10BT:split=train:revision=v1.3
#   --dataset "notes.jsonl:text=body:0.7,chat.jsonl:messages=conversation:0.3"
#
#   config=NAME          the dataset's configuration (subset), datasets' `name`
#   split=NAME           the split to train on (any split, or slices like train[:10%])
#   revision=REF         a hub branch, tag or commit
#   data_files=PATTERN   the files of a hub or local dataset repository to read
#   FORMAT_COLUMN=COLUMN read the example format's column from another column
#                        (text=body, messages=conversations, prompt=question, ...);
#                        --dataset_columns sets the same for every source
#   weight=W, or a bare W   the source's share of the mixture's documents
#
# A ":" piece that is neither an option nor a number stays part of the path. The
# options a local file cannot have (config, revision, data_files) are refused by
# name. Without weights the sources are concatenated; with a weight on every
# source, documents are drawn from them at random in those proportions
# (Note [Mixtures] in llama_cp/data/mixture.py). Each source keeps its own format.


@dataclass(frozen=True)
class Source:
    """One dataset of ``--dataset`` / ``--eval_dataset`` with its options (Note [Dataset sources])."""

    path: str
    config: str | None = None
    split: str | None = None
    revision: str | None = None
    data_files: str | None = None
    weight: float | None = None
    #: (format column, the dataset's column) pairs: ``text=body`` is ("text", "body")
    columns: tuple[tuple[str, str], ...] = field(default=())
    flag: str = "--dataset"

    @property
    def name(self) -> str:
        """How messages name the source: its path or id."""
        return self.path

    def hub_options(self) -> dict[str, str]:
        """``datasets.load_dataset``'s keyword arguments for this source's options."""
        options = {"name": self.config, "split": self.split, "revision": self.revision,
                   "data_files": self.data_files}
        return {key: value for key, value in options.items() if value is not None}


def parse_columns(text: str, flag: str = "--dataset_columns") -> tuple[tuple[str, str], ...]:
    """``text=body,messages=conversation`` -> (("text", "body"), ("messages", "conversation"))."""
    pairs = []
    for item in (piece.strip() for piece in text.split(",")):
        if not item:
            continue
        key, equals, column = item.partition("=")
        if not equals or not column.strip():
            raise ValueError(f"{flag} {text!r}: {item!r} is not FORMAT_COLUMN=COLUMN (e.g. text=body)")
        pairs.append(_column_pair(key.strip(), column.strip(), flag, text))
    return tuple(pairs)


def _column_pair(key: str, column: str, flag: str, text: str) -> tuple[str, str]:
    if key not in FORMAT_COLUMNS:
        raise ValueError(
            f"{flag} {text!r}: {key!r} is not a column of an accepted format; map one of "
            f"{', '.join(FORMAT_COLUMNS)} (e.g. text=body)"
        )
    return key, column


def parse_sources(value: str, flag: str = "--dataset", columns: str = "") -> tuple[Source, ...]:
    """The sources of a ``--dataset`` / ``--eval_dataset`` value (Note [Dataset sources]);
    ``columns`` (``--dataset_columns``) maps columns for every source that maps none itself.
    ValueError naming the flag for anything malformed."""
    default_columns = parse_columns(columns)
    sources = []
    for spec in (piece.strip() for piece in value.split(",")):
        if not spec:
            raise ValueError(f"{flag} {value!r}: an empty source between commas")
        parts = re.split(r":(?![^\[]*\])", spec)  # not the ":" of a split slice, train[:10%]
        options: dict[str, str] = {}
        mapped: list[tuple[str, str]] = []
        while len(parts) > 1:  # options are read from the right; what is left is the path
            piece = parts[-1].strip()
            key, equals, option = piece.partition("=")
            if equals and (key in SOURCE_OPTIONS or key in FORMAT_COLUMNS):
                if key in options or key in dict(mapped):
                    raise ValueError(f"{flag} {spec!r}: {key} is given twice")
                if key in SOURCE_OPTIONS:
                    options[key] = option
                else:
                    mapped.append(_column_pair(key, option, flag, spec))
            elif equals and re.fullmatch(r"[A-Za-z_]\w*", key):
                raise ValueError(
                    f"{flag} {spec!r}: unknown option {key!r}; a source takes {', '.join(SOURCE_OPTIONS)}, "
                    f"or FORMAT_COLUMN=COLUMN for one of {', '.join(FORMAT_COLUMNS)}"
                )
            elif _is_number(piece) and "weight" not in options:
                options["weight"] = piece
            else:
                break
            parts.pop()
        path = ":".join(parts).strip()
        weight = None
        if "weight" in options:
            weight = float(options.pop("weight")) if _is_number(options["weight"]) else math.nan
            if not weight > 0 or not math.isfinite(weight):
                raise ValueError(f"{flag} {spec!r}: a mixture weight must be a positive number")
        if path == PASSKEY and (len(value.split(",")) > 1 or options or mapped):
            raise ValueError(f"{flag} passkey is the built-in task, generated from the seed: it takes no options "
                             "and is not mixed with other data")
        sources.append(Source(path, weight=weight, columns=tuple(mapped) or default_columns, flag=flag, **options))
    weighted = [source.weight is not None for source in sources]
    if any(weighted) and not all(weighted):
        raise ValueError(
            f"{flag} {value!r}: give every source of a mixture a weight (e.g. a.jsonl:0.7,b.jsonl:0.3), or none "
            "to use all of each"
        )
    if len(sources) == 1 and sources[0].weight is not None:
        sources[0] = Source(**{**sources[0].__dict__, "weight": None})  # one source: the weight means nothing
    return tuple(sources)


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def check_sources(sources: Sequence[Source]) -> None:
    """At config time: FileNotFoundError for a local path that does not exist; ValueError for an
    option the source cannot take (a local file has no config, revision or data_files)."""
    for source in sources:
        check_dataset_path(source.path, source.flag)
        path = Path(source.path).expanduser()
        if source.revision is not None and path.exists():
            raise ValueError(f"{source.flag} {source.path!r}: revision= picks a version of a hub dataset; "
                             "a local path has none")
        if path.is_file() and (source.config is not None or source.data_files is not None):
            raise ValueError(f"{source.flag} {source.path!r}: config= and data_files= apply to hub datasets and "
                             "dataset directories, not to one file")



def check_dataset_path(dataset: str, flag: str = "--dataset") -> None:
    """FileNotFoundError when ``--dataset`` (or ``flag``) names a local file or directory (a path, or a file
    name ending like one) that does not exist; run at config time, before anything is built."""
    path = Path(dataset).expanduser()
    looks_local = dataset.startswith(("/", "./", "../", "~")) or dataset.endswith(LOCAL_FILE_SUFFIXES)
    if dataset != PASSKEY and looks_local and not path.exists():
        raise FileNotFoundError(f"{flag} {dataset!r}: no such file or directory ({path.absolute()})")
