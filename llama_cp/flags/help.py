"""The words of the flags: each flag's doc is the string under its field in ``llama_cp/config.py``,
read from the source (``inspect`` + ``ast``), so ``--help``, docs/flags.md's table and the code
say one thing. The functions take the config class (``cls``)."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
from typing import Any

from llama_cp.flags.reading import flag_names, flatten


def flag_docs(cls: type) -> list[tuple[str, Any, str]]:
    """``(flag, default, doc)`` of every flag, in declaration order; the doc is the string under
    the field in its class's source."""
    docs = {}
    for klass in (cls, *(f.default_factory for f in dataclasses.fields(cls) if f.name in cls.SECTIONS)):
        body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body
        for node, after in zip(body, body[1:]):
            if isinstance(node, ast.AnnAssign) and isinstance(after, ast.Expr):
                docs[node.target.id] = after.value.value
    flat = flatten(cls, dataclasses.asdict(cls()))
    return [(name, flat[name], docs[name]) for name in flag_names(cls)]


def help_text(cls: type, defaults: dict[str, Any] | None = None) -> str:
    """The ``--help`` text: every flag with its default and doc; ``defaults`` are a command's own
    defaults where they differ from the trainer's (the planner's)."""
    lines = ["flags (--config preset.yaml first, then --flag value; flags override the preset):"]
    for name, default, doc in flag_docs(cls):
        default = (defaults or {}).get(name, default)
        lines.append(f"  --{name} (default {shown(default)}): {doc}")
    return "\n".join(lines)


def flag_table(cls: type) -> str:
    """The markdown table of every flag of ``cls``: docs/flags.md's."""
    rows = ["| flag | default | meaning |", "|---|---|---|"]
    for name, default, doc in flag_docs(cls):
        rows.append(f"| `--{name}` | `{shown(default)}` | {doc} |")
    return "\n".join(rows)


def shown(default: Any) -> str:
    """A default as --help and docs/flags.md show it: a tuple comma-separated, None (a switch left
    to the run) as auto."""
    if isinstance(default, tuple):
        return ",".join(default)
    return "auto" if default is None else str(default)
