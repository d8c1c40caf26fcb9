"""Long real text that every machine with llama-cp has: the source files and documentation of the
installed Python packages. Written by people, never by a model, and offline.

    write_long_text("data/long_text", min_chars=100_000)   # train.jsonl, eval.jsonl (held-out packages)

Used for perplexity by length and for the context-extension recipe (configs/smollm2_extend_32k.yaml).
A document is one file, as it is on disk. The eval set holds whole packages that the train set
does not: a package goes to eval when the sha256 of its name ends in 0 (about one in 16). So two
machines with the same packages get the same split, and the eval text was never trained on.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from collections.abc import Iterator
from importlib import metadata

from llama_cp.files import write_text

#: Files read as documents: source code and documentation.
TEXT_SUFFIXES = (".py", ".md", ".rst", ".txt", ".pyi")


def installed_documents(min_chars: int) -> Iterator[dict]:
    """Every installed file of TEXT_SUFFIXES with at least ``min_chars`` characters, as
    ``{"text", "package", "path"}``, in the order of package and path names."""
    seen = set()
    for distribution in sorted(metadata.distributions(), key=lambda d: (d.metadata["Name"] or "").lower()):
        package = (distribution.metadata["Name"] or "").lower()
        if not package or package in seen:
            continue
        seen.add(package)
        for file in sorted(distribution.files or [], key=str):
            if not str(file).endswith(TEXT_SUFFIXES):
                continue
            path = str(file.locate())
            try:
                if os.path.getsize(path) < min_chars:
                    continue
                with open(path, encoding="utf-8") as f:
                    text = f.read()
            except (OSError, UnicodeDecodeError):
                continue
            if len(text) >= min_chars:
                yield {"text": text, "package": package, "path": str(file)}


def held_out(package: str) -> bool:
    """Whether ``package``'s files are eval documents (see the module's docstring)."""
    return hashlib.sha256(package.encode()).hexdigest().endswith("0")


def write_long_text(output_dir: str, min_chars: int = 100_000, max_documents: int = 0,
                    passkeys: int = 0, seed: int = 0) -> dict[str, int]:
    """``output_dir``/train.jsonl and eval.jsonl (:func:`installed_documents`, eval = the held-out
    packages; ``max_documents`` > 0: at most that many in each), and with ``passkeys`` > 0
    passkeys.jsonl: that many retrieval rows (a 5-digit key at a random depth, filling the row:
    llama_cp/data/passkey.py) to mix in. Each file is written under a temporary name and renamed.
    Returns the number of rows of each file."""
    os.makedirs(output_dir, exist_ok=True)
    split = {"train": [], "eval": []}
    for document in installed_documents(min_chars):
        part = split["eval" if held_out(document["package"]) else "train"]
        if not max_documents or len(part) < max_documents:
            part.append(document)
    if passkeys:
        rng = random.Random(seed)
        split["passkeys"] = [{"passkey": f"{rng.randrange(10**5):05d}", "depth": round(rng.random(), 3)}
                             for _ in range(passkeys)]
    for name, rows in split.items():
        if not rows:
            raise ValueError(f"no installed file of at least {min_chars} characters for {name}.jsonl: "
                             "lower --min_chars")
        write_text(os.path.join(output_dir, f"{name}.jsonl"), "".join(json.dumps(row) + "\n" for row in rows))
    return {name: len(rows) for name, rows in split.items()}
