"""Reading a configuration: every leaf field of :class:`~llama_cp.config.TrainConfig` is a flag of
the same name; a YAML preset may be flat or nested by section; flags override the preset, the
preset overrides the defaults; an unknown name is an error that lists the close matches.

The functions take the config class (``cls``): ``TrainConfig.from_flags`` and its kin call them.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import typing
from typing import Any, Literal

import yaml


def flag_names(cls: type) -> dict[str, str | None]:
    """Flag name -> the section holding it (None for a top-level field)."""
    names: dict[str, str | None] = {}
    for f in dataclasses.fields(cls):
        if f.name in cls.SECTIONS:
            for leaf in dataclasses.fields(f.default_factory()):
                names[leaf.name] = f.name
        else:
            names[f.name] = None
    return names


def flatten(cls: type, values: dict[str, Any]) -> dict[str, Any]:
    """Flag name -> value of a config nested by section (``to_dict()``, a checkpoint's config.yaml,
    a preset); flat entries pass through (every flag name is unique)."""
    flat: dict[str, Any] = {}
    for key, value in values.items():
        if key in cls.SECTIONS and isinstance(value, dict):
            flat.update(value)
        else:
            flat[key] = value
    return flat


def from_flags(cls: type, config: str | None = None, **flags: Any):
    """A validated ``cls``: its defaults, then the YAML preset ``config``, then ``flags``; names and
    types are checked as they are set."""
    values: dict[str, Any] = {}
    if config is not None:
        with open(config) as f:
            preset = yaml.safe_load(f) or {}
        values.update(flatten(cls, preset))
    values.update(flags)
    cfg = cls()
    if config is not None and "model_name" not in values:
        raise ValueError(
            f"--config {config} names no model, and its settings are written for one (a preset run alone would "
            "train the embedded demo model): add --model_name /path/to/model (a local HF directory or hub id), or "
            "model_name: in the preset"
        )
    names = flag_names(cls)
    for name, value in values.items():
        if name not in names:
            close = difflib.get_close_matches(name, names, n=3, cutoff=0.6)
            hint = f"; did you mean {', '.join('--' + c for c in close)}?" if close else ""
            raise ValueError(f"unknown flag --{name}{hint} (run with --help for the list)")
        section = names[name]
        target = getattr(cfg, section) if section else cfg
        setattr(target, name, coerce(type(target), name, value))
    cfg.validate()
    return cfg


def field_type(cls: type, name: str):
    """The annotated type of field ``name`` of dataclass ``cls``."""
    return _type_hints(cls)[name]


@functools.lru_cache(maxsize=None)
def _type_hints(cls: type) -> dict[str, Any]:
    """``typing.get_type_hints(cls)``, evaluated once a class: it compiles every field's annotation (strings
    under ``from __future__ import annotations``), and a config reads it once a flag it coerces or checks."""
    return typing.get_type_hints(cls)


def coerce(cls: type, name: str, value: Any) -> Any:
    """A flag value (fire may hand over str, int, tuple) converted to the type of field ``name``."""
    kind = field_type(cls, name)
    origin = typing.get_origin(kind)
    try:
        if kind == bool | None:  # a switch with an auto setting (None): --activation_checkpointing auto
            if value is None or (isinstance(value, str) and value.lower() == "auto"):
                return None
            kind = bool
        if kind is bool:
            if isinstance(value, str):
                if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
                    raise ValueError(value)
                return value.lower() in ("true", "1", "yes")
            return bool(value)
        if kind is int:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError(value)
            return int(value)
        if kind is float:
            return float(value)
        if origin is tuple:
            items = value.split(",") if isinstance(value, str) else list(value)
            return tuple(str(item).strip() for item in items if str(item).strip())
        if kind is str and isinstance(value, (tuple, list)):  # fire reads --dataset a.jsonl,b.jsonl as a tuple
            return ",".join(str(item) for item in value)
        if kind is str and isinstance(value, dict):  # a YAML mapping or fire's parse of a JSON object
            return json.dumps(value)
        if kind is str or origin is Literal:
            if isinstance(value, bool):  # --resume / --resume true / YAML `resume: true`
                return "true" if value else "false"
            value = str(value)
            choices = typing.get_args(kind)
            return value.lower() if value not in choices and value.lower() in choices else value
    except (TypeError, ValueError):
        raise ValueError(f"--{name} expects {getattr(kind, '__name__', kind)}, got {value!r}") from None
    return value
