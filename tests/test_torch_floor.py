"""Every torch.distributed name the package uses exists in the lowest torch setup.cfg admits.

The package's code (llama_cp/, recipes/, benchmarks/) is read with ``ast``: ``dist.NAME`` (for
``import torch.distributed as dist`` and other aliases), ``torch.distributed.x.NAME`` chains,
``from torch.distributed.x import NAME``. Each name is looked up in two places:

- the running torch (on CI's floors job that is torch 2.10.0);
- ``torch_floor_names.json``: the names of each of those modules in torch 2.10.0, written by
  ``python tests/test_torch_floor.py --write`` in a venv with .ci/floors.txt installed. So the
  main job (torch 2.13) catches a 2.13-only name too, e.g. ``dist.all_gather_single``.

Names torch renamed are called through llama_cp/parallel/collectives.py, which looks them up as
strings (Note [Collective names across torch versions]); this test does not see those.
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
SNAPSHOT = pathlib.Path(__file__).with_name("torch_floor_names.json")
FLOOR_TORCH = "2.10.0"
PACKAGE_DIRS = ("llama_cp", "recipes", "benchmarks")


def _dotted(node: ast.AST) -> str | None:
    """``a.b.c`` for a chain of attributes on a name, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def used_names() -> dict[str, set[str]]:
    """module -> the names the package's code takes from it, for modules under torch.distributed."""
    return {module: set(names) for module, names in _read_names().items()}


@functools.lru_cache(maxsize=None)
def _read_names() -> dict[str, frozenset[str]]:
    """used_names, read once a process: the three tests read the same files (a second each)."""
    used: dict[str, set[str]] = {}
    for path in sorted(p for d in PACKAGE_DIRS for p in (ROOT / d).rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        aliases = {"torch": "torch"}  # local name -> module
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith("torch.distributed"):
                        aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else "torch"
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch.distributed"):
                for a in node.names:
                    used.setdefault(node.module, set()).add(a.name)
        inner = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
        for node in ast.walk(tree):  # each whole chain once: the outermost attribute of it
            if not isinstance(node, ast.Attribute) or id(node) in inner:
                continue
            chain = _dotted(node)
            if chain is None or chain.split(".")[0] not in aliases:
                continue
            head, *rest = chain.split(".")
            module = aliases[head]
            for attr in rest:  # down through submodules to the first name that is not one
                if f"{module}.{attr}".startswith("torch.distributed") and _is_module(f"{module}.{attr}"):
                    module = f"{module}.{attr}"
                    continue
                if module.startswith("torch.distributed"):
                    used.setdefault(module, set()).add(attr)
                break
    return {module: frozenset(names) for module, names in used.items()}


def test_names_exist_in_running_torch():
    missing = []
    for module, names in used_names().items():
        found = importlib.import_module(module)
        missing += [f"{module}.{n}" for n in sorted(names) if not hasattr(found, n)]
    assert not missing, f"the package uses names this torch lacks: {missing}"


def test_names_exist_in_floor_torch():
    floor = json.loads(SNAPSHOT.read_text())
    assert floor["torch"] == FLOOR_TORCH
    unrecorded, missing = [], []
    for module, names in used_names().items():
        if module not in floor["modules"]:
            unrecorded.append(module)
            continue
        missing += [f"{module}.{n}" for n in sorted(names) if n not in floor["modules"][module]]
    assert not unrecorded, (f"{unrecorded} not recorded for torch {FLOOR_TORCH}: run `python "
                            f"tests/test_torch_floor.py --write` with .ci/floors.txt installed")
    assert not missing, (f"torch {FLOOR_TORCH}, the lowest setup.cfg admits, lacks {missing}: call them "
                         f"through llama_cp/parallel/collectives.py (Note [Collective names across torch versions])")


def test_the_reader_sees_what_it_must():
    """The reader finds the uses this test exists for (a reader that finds nothing passes always)."""
    used = used_names()
    assert {"all_reduce", "batch_isend_irecv", "P2POp", "new_group"} <= used["torch.distributed"]
    assert "fully_shard" in used["torch.distributed.fsdp"]
    assert "save" in used.get("torch.distributed.checkpoint", set())


if __name__ == "__main__" and "--write" in sys.argv:
    import torch

    assert torch.__version__.split("+")[0] == FLOOR_TORCH, torch.__version__
    modules = {m: sorted(dir(importlib.import_module(m))) for m in sorted(used_names())}
    SNAPSHOT.write_text(json.dumps({"torch": FLOOR_TORCH, "modules": modules}, indent=0) + "\n")
    print(f"wrote {SNAPSHOT}: {len(modules)} modules")
