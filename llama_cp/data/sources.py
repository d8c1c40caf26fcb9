"""Where examples come from: the sources of ``--dataset`` and ``--eval_dataset`` (a local file
or directory, a ``Dataset.save_to_disk`` directory, a hub dataset, each with its options and a
mixture weight; their syntax is ``llama_cp/data/grammar.py``'s), read with ``datasets`` and
checked; and the train / eval part of each (a real eval split, or a seeded random hold-out).
"""

from __future__ import annotations

import contextlib
import re
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path

import datasets
import numpy as np

from llama_cp.data.formats import check_free_form_structs, check_required_values, detect_format
from llama_cp.data.grammar import PASSKEY, Source, check_sources, parse_sources
from llama_cp.data.passkey import (
    DEFAULT_PASSKEY_SAMPLES,
    PASSKEY_DIGITS,
    passkey_examples,
)

#: Local file extensions and the ``datasets`` builder that reads them. A ``.txt``
#: file is one document (the whole file), which is what long-context data wants.
FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".txt": "text"}
#: The column ``load_source`` adds: each example's row number in its split, counted from 1.
ROW_NUMBER = "_row_number"
#: ``--eval_fraction``'s default: the share of a source's documents held out for eval when it
#: has no eval split of its own and no ``--eval_dataset`` is given.
EVAL_FRACTION = 0.05
def load_examples(
    dataset: str,
    split: str = "train",
    seed: int = 0,
    num_passkey: int = DEFAULT_PASSKEY_SAMPLES,
    passkey_digits: int = PASSKEY_DIGITS,
    passkey_lengths: Sequence[int] | None = None,
    eval_fraction: float = EVAL_FRACTION,
) -> datasets.Dataset:
    """The examples of ``split`` ("train" or "eval") of a ``--dataset`` of one source.

    - ``"passkey"``: ``num_passkey`` draws of the synthetic task
      (``llama_cp.data.passkey.passkey_examples``: its columns, and what the
      passkey arguments do);
    - a local .json / .jsonl / .parquet / .txt file, a directory of such files,
      or a directory written by ``Dataset.save_to_disk``;
    - anything else is a hub id for ``datasets.load_dataset``;
    each with the options of Note [Dataset sources]. See :func:`load_source` for the
    split; several sources are read with :func:`llama_cp.data.mixture.source_examples`.
    """
    split = _check_split(split)
    if dataset == PASSKEY:
        return passkey_examples(split, seed, num_passkey, passkey_digits, passkey_lengths)
    sources = parse_sources(dataset)
    if len(sources) > 1:
        raise ValueError(f"--dataset {dataset!r} is a mixture: read its sources one by one (load_source)")
    return load_source(sources[0], split, seed, eval_fraction)


def load_source(source: Source, part: str, seed: int = 0, eval_fraction: float = EVAL_FRACTION) -> datasets.Dataset:
    """The examples of one source, columns mapped to the format's names, checked.

    ``part``: "train" or "eval" of a training source: a real eval split ("validation" /
    "test") when the source has one and no ``split=`` picks one, else a hold-out of
    ``eval_fraction`` of the documents drawn at random with ``seed`` ("train" is the rest;
    a single text document is cut at 1 - eval_fraction of its characters instead);
    "all": every example of an ``--eval_dataset`` source (its ``split=``, else its
    validation / test split, else its first).
    """
    if part not in ("train", "eval", "all"):
        raise ValueError(f"part must be 'train', 'eval' or 'all', got {part!r}")
    check_sources([source])
    path = Path(source.path).expanduser()
    loaded = _load_local(path, source) if path.exists() else load_hub_dataset(source)
    if source.columns:
        loaded = _map_columns(loaded, source)
    pieces = dict(loaded) if isinstance(loaded, datasets.DatasetDict) else {"": loaded}
    for name in _used_splits(loaded, part):  # only what is read: another split may hold other columns
        piece, where = pieces[name], f"{source.name} (split {name})" if name else source.name
        if len(piece) == 0:
            raise ValueError(f"{source.flag} {where!r} is empty: it holds no rows")
        check_required_values(piece, where, source.flag)  # also fails on unusable columns, before tokenizing
        check_free_form_structs(piece, where, source.flag)
        for column in ("prompt", "completion", "messages", "chosen", "rejected"):
            if type(piece.features.get(column)).__name__ == "Json":  # datasets >= 4.7 reads mixed JSON as Json
                raise ValueError(f"{source.flag} {where!r}: the {column!r} column mixes strings and message lists "
                                 "across rows; use one form per source (split the file in two)")
        # each example's row number (from 1, in its split) goes along, for messages about the row
        pieces[name] = piece.add_column(ROW_NUMBER, np.arange(1, len(piece) + 1))
    loaded = datasets.DatasetDict(pieces) if isinstance(loaded, datasets.DatasetDict) else pieces[""]
    return _select_part(loaded, part, seed, eval_fraction)


def check_mapped_columns(source: Source, columns) -> None:
    """ValueError naming the source when a column it maps (``text=body``) is not among ``columns``."""
    for key, column in source.columns:
        if column not in columns:
            raise ValueError(f"{source.flag} {source.name!r}: {key}={column} maps a column the data does not have; "
                             f"its columns are {sorted(columns)}")


def _map_columns(loaded: datasets.Dataset | datasets.DatasetDict, source: Source):
    """Rename the source's columns to the format's names (``text=body``: body becomes text)."""
    columns = loaded.column_names
    columns = next(iter(columns.values())) if isinstance(columns, dict) else columns
    check_mapped_columns(source, columns)
    renames = {column: key for key, column in source.columns if column != key}
    clashes = sorted(key for key in renames.values() if key in columns and key not in renames)
    dropped = loaded.remove_columns(clashes) if clashes else loaded  # the mapped column replaces it
    return dropped.rename_columns(renames) if renames else dropped


def load_hub_dataset(source: Source | str, streaming: bool = False):
    """``datasets.load_dataset`` of a hub id with the source's options; its error says that the
    name was taken for a hub id."""
    source = Source(source) if isinstance(source, str) else source
    try:
        return datasets.load_dataset(source.path, streaming=streaming, **source.hub_options())
    except Exception as error:
        note = (
            f"{source.flag} {source.path!r} is not a local path (no such file or directory), so it was treated "
            "as a HuggingFace hub dataset id: give a local file or directory, or a hub id this machine can reach"
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


def _load_local(path: Path, source: Source | None = None) -> datasets.Dataset | datasets.DatasetDict:
    """Read a local file or directory: a ``save_to_disk`` directory with ``load_from_disk``; a
    directory with options (config, split, data_files) or a dataset card declaring configs as
    a dataset repository, with ``datasets.load_dataset`` as a hub id would be; else every data
    file, with the ``datasets`` builder its extension names."""
    source = source or Source(str(path))
    if is_saved_dataset(path):
        loaded = datasets.load_from_disk(str(path))
        if source.split is None:
            return loaded
        if not isinstance(loaded, datasets.DatasetDict) or source.split not in loaded:
            held = list(loaded) if isinstance(loaded, datasets.DatasetDict) else ["(one unnamed split)"]
            raise ValueError(f"{source.flag} {source.name!r}: split={source.split} is not among its splits {held}")
        return loaded[source.split]
    if path.is_dir() and (source.hub_options() or declares_configs(path)):
        with _quiet_datasets():
            return datasets.load_dataset(str(path), cache_dir=_private_cache(), **source.hub_options())
    builder, files = local_files(path)
    options = {"sample_by": "document"} if builder == "text" else {}
    try:
        with _quiet_datasets():
            loaded = datasets.load_dataset(builder, data_files=[str(file) for file in files], **options)
    except Exception as error:
        if builder == "json":
            for file in files:
                _check_json_file(file)  # names the file and line when that is what failed
            told = f"{error} {error.__cause__} {getattr(error.__cause__, '__context__', None)}"
            if any(words in told for words in ("mix list and non-list", "from array to", "to array in row")):  # datasets 3
                raise ValueError(f"{source.flag} {source.name!r}: a column mixes strings and lists across rows "
                                 "(a prompt or completion as text in some, as messages in others); use one form per "
                                 "source (split the file in two)") from None
        raise
    if source.split not in (None, "train"):
        raise ValueError(f"{source.flag} {source.name!r}: a file's rows are one split, 'train'; "
                         f"split={source.split} applies to dataset directories and hub datasets")
    return loaded


def _private_cache() -> str:
    """A new cache directory for one load of a local dataset repository, removed at exit.

    datasets keys its cache of a local repository by the folder's name and card, not by the
    files: a second folder of that name (or the files edited) reads the first one's rows, or
    fails on the features and split sizes it recorded for them, even with
    ``download_mode="force_redownload"`` (datasets 5.2). A directory of its own per load
    cannot be stale; it lives until the process ends, since ``map(num_proc=N)`` reopens the
    Arrow files in its workers."""
    import atexit
    import shutil
    import tempfile

    root = Path(datasets.config.HF_DATASETS_CACHE) / "llama_cp" / ".local-repositories"
    root.mkdir(parents=True, exist_ok=True)
    directory = tempfile.mkdtemp(dir=root)
    atexit.register(shutil.rmtree, directory, True)
    return directory


def is_saved_dataset(path: Path) -> bool:
    """Whether ``path`` is a directory written by ``Dataset(Dict).save_to_disk``."""
    return path.is_dir() and ((path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists())


def declares_configs(path: Path) -> bool:
    """Whether the directory's dataset card (README.md) declares configs or data files in its
    YAML header, as hub dataset repositories do."""
    card = path / "README.md"
    if not card.is_file():
        return False
    header = card.read_text(errors="replace").split("---")
    return len(header) > 2 and re.search(r"^configs:", header[1], re.MULTILINE) is not None


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


def _split_names(loaded: datasets.DatasetDict) -> tuple[str, str | None]:
    """(the training split: "train", else the first; the eval split: "validation" / "test", or None)."""
    train_name = "train" if "train" in loaded else next(iter(loaded))
    eval_name = next((name for name in ("validation", "test") if name in loaded and name != train_name), None)
    return train_name, eval_name


def _used_splits(loaded: datasets.Dataset | datasets.DatasetDict, part: str) -> list[str]:
    """The names of the splits ``_select_part`` reads ("" for a Dataset)."""
    if isinstance(loaded, datasets.Dataset):
        return [""]
    train_name, eval_name = _split_names(loaded)
    if part == "all":
        return [eval_name or train_name]
    return [train_name if part == "train" or eval_name is None else eval_name]


def _select_part(loaded: datasets.Dataset | datasets.DatasetDict, part: str, seed: int,
                 eval_fraction: float) -> datasets.Dataset:
    """``load_source``'s part of what was loaded: a real eval split ("validation" / "test") when
    there is one, else the hold-out."""
    if isinstance(loaded, datasets.Dataset):
        return loaded if part == "all" else _hold_out(loaded, part, seed, eval_fraction)
    train_name, eval_name = _split_names(loaded)
    if part == "all" or eval_name is not None:
        return loaded[_used_splits(loaded, part)[0]]
    return _hold_out(loaded[train_name], part, seed, eval_fraction)


def _hold_out(examples: datasets.Dataset, part: str, seed: int, fraction: float) -> datasets.Dataset:
    """``fraction`` of the documents (at least one) drawn at random with ``seed`` for eval, the rest,
    in their order, for train; nothing held out when ``fraction`` is 0."""
    count = len(examples)
    if fraction == 0:
        return examples if part == "train" else examples.select([])
    if count >= 2:
        num_eval = min(count - 1, max(1, round(fraction * count)))
        held = np.zeros(count, dtype=bool)
        held[np.random.default_rng(seed).choice(count, num_eval, replace=False)] = True
        return examples.select(np.flatnonzero(held if part == "eval" else ~held))
    if count == 1 and detect_format(examples.column_names) == "text":
        # one long document: its last fraction of characters is the held-out text
        text = examples[0]["text"] or ""
        cut = round((1 - fraction) * len(text))
        return datasets.Dataset.from_dict({"text": [text[:cut] if part == "train" else text[cut:]], ROW_NUMBER: [1]})
    warnings.warn(f"only {count} example(s): no eval split can be held out, eval reuses the training data")
    return examples
