"""What prepared rows depend on, and so where they are kept: the key of a dataset's rows (its
sources' content, the tokenizer, the packing flags), hashed into the name of their directory
under the cache (``llama_cp/data/prepared.py`` prepares and finds them there).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import datasets

from llama_cp.data.grammar import Source
from llama_cp.data.mixture import DataSpec
from llama_cp.data.sources import is_saved_dataset, load_hub_dataset, local_files

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

#: Version of the files' layout (Note [Prepared rows] in row_files.py); a change makes every cache key new.
#: 2: a checksum per row (``<split>.rowsums``) and the files' sizes in summary.json.
LAYOUT_VERSION = 2
#: Version of how examples become documents; a change that trains other tokens makes every cache key new,
#: so no run reuses rows an older llama-cp made. 2: a row's tools go to the chat template (Note [A row's
#: tools]), Mistral's tool calls are trained whole. (1: the key had no such entry.)
DOCUMENT_VERSION = 2


def dataset_fingerprint(source: Source | str) -> dict[str, Any]:
    """What identifies a source's content without reading it: every local file's path, size
    and modification time; for a hub id, datasets' fingerprint of each split it loads."""
    source = Source(source) if isinstance(source, str) else source
    path = Path(source.path).expanduser()
    if path.exists():
        if is_saved_dataset(path) or source.hub_options() or path.is_dir() and (path / "README.md").exists():
            files = sorted(file for file in path.rglob("*") if file.is_file()  # not .git/ and the like
                           and not any(part.startswith(".") for part in file.relative_to(path).parts))
        else:
            files = local_files(path)[1]
        return {"files": [[str(file.absolute()), file.stat().st_size, file.stat().st_mtime_ns] for file in files]}
    loaded = load_hub_dataset(source)
    parts = loaded.items() if isinstance(loaded, datasets.DatasetDict) else [("train", loaded)]
    return {"hub": source.path, "splits": {name: part._fingerprint for name, part in parts}}


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """sha256 of the tokenizer's whole definition (vocabulary, merges, normalizer, special
    tokens) and its chat template: two tokenizers with one fingerprint encode alike."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    definition = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    extra = [type(tokenizer).__name__, tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id,
             getattr(tokenizer, "chat_template", None)]
    return hashlib.sha256((definition + json.dumps(extra, default=str)).encode()).hexdigest()


def cache_key(
    dataset: str | DataSpec, tokenizer: PreTrainedTokenizerBase, context_length: int, cp: int, truncate: bool = False,
    objective: str = "sft",
) -> dict[str, Any]:
    """Everything the prepared rows depend on; ``key_hash`` of it names their directory: the
    data flags (sources, options, weights, eval set, seed, ...) and each source's content. The
    example format (text / instruction / chat ...) is read from the files, so it changes with them.
    ``objective`` "dpo": rows of whole (chosen, rejected) pairs (Note [Packed preference pairs])."""
    spec = DataSpec(dataset) if isinstance(dataset, str) else dataset
    sources = dict.fromkeys([*spec.sources("train"), *spec.sources("eval")])
    return {
        "layout": LAYOUT_VERSION,
        "documents": DOCUMENT_VERSION,
        "data": spec.key(),
        "dataset": [dataset_fingerprint(source) for source in sources],
        "tokenizer": {"name": getattr(tokenizer, "name_or_path", ""), "sha256": tokenizer_fingerprint(tokenizer)},
        "context_length": context_length,
        "cp": cp,
        # Note [Packed rows]: continued in the next row, positions going on; or cut at context_length
        "long_documents": "truncate" if truncate else "split",
        **({"objective": objective} if objective != "sft" else {}),  # SFT keys as before: their caches stay valid
    }


def key_hash(key: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]


def default_cache_dir() -> str:
    """``--data_cache_dir ""``: a llama_cp folder in datasets' cache (HF_DATASETS_CACHE / HF_HOME)."""
    return os.path.join(str(datasets.config.HF_DATASETS_CACHE), "llama_cp")
