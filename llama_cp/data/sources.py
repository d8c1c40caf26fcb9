"""Where examples come from: local files and directories (``FILE_BUILDERS``), directories
written by ``Dataset.save_to_disk``, and hub datasets, read with ``datasets`` and checked;
and the train / eval split of each (a real eval split, or a held-out tail).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path

import datasets

from llama_cp.config import PASSKEY, check_dataset_path
from llama_cp.data.formats import check_required_values, detect_format
from llama_cp.data.passkey import DEFAULT_PASSKEY_SAMPLES, PASSKEY_DIGITS, passkey_examples

#: Local file extensions and the ``datasets`` builder that reads them. A ``.txt``
#: file is one document (the whole file), which is what long-context data wants.
FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".txt": "text"}
#: Fraction of the documents of a local or hub dataset held out for the eval split.
EVAL_FRACTION = 0.05


def load_examples(
    dataset: str,
    split: str = "train",
    seed: int = 0,
    num_passkey: int = DEFAULT_PASSKEY_SAMPLES,
    passkey_digits: int = PASSKEY_DIGITS,
    passkey_lengths: Sequence[int] | None = None,
) -> datasets.Dataset:
    """The examples of ``split`` ("train" or "eval") of ``--dataset``.

    - ``"passkey"``: ``num_passkey`` draws of the synthetic task
      (``llama_cp.data.passkey.passkey_examples``: its columns, and what the
      passkey arguments do);
    - a local .json / .jsonl / .parquet / .txt file, a directory of such files,
      or a directory written by ``Dataset.save_to_disk``;
    - anything else is a hub id for ``datasets.load_dataset``.

    Files have no splits: eval is the last ~5% of the documents and train the
    rest (a single text document is cut at 95% of its characters instead). A
    hub dataset with a "validation" or "test" split uses it for eval.
    """
    split = _check_split(split)
    if dataset == PASSKEY:
        return passkey_examples(split, seed, num_passkey, passkey_digits, passkey_lengths)
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
