"""YAML configs with `key=value` overrides, validated by each stage's pydantic model.

Jobs (`jobs/<stage>.py`) and the CLI share this: `load_config(path, ["train.epochs=3"], Model)`.
Override values are parsed as YAML scalars (`3` -> int, `true` -> bool, `[0,1]` -> list);
dotted keys reach into nested sections.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, TypeVar

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, ValidationError

from memprune.errors import MemPruneError

M = TypeVar("M", bound=BaseModel)


class ConfigModel(BaseModel):
    """Base of every config model: unknown keys are errors, and so are NaN and infinite numbers."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


# A local path or a storage URI (s3://..., gs://..., file://...), kept as written: a Path would make s3://b of it s3:/b.
Place = Annotated[str, BeforeValidator(lambda v: os.fspath(v) if isinstance(v, os.PathLike) else v)]


class ConfigError(MemPruneError):
    """A config file or override is unreadable or invalid; the message names the file and key."""


def parse_overrides(items: list[str] | None) -> dict[str, Any]:
    """`["a.b=1", "c=x"]` -> `{"a": {"b": 1}, "c": "x"}`."""
    out: dict[str, Any] = {}
    for item in items or []:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {item!r} is not key=value")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError as exc:
            raise ConfigError(f"override {item!r}: value is not valid YAML: {exc}") from exc
        node = out
        parts = key.strip().split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {part!r} is set to a scalar elsewhere")
        node[parts[-1]] = value
    return out


def merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """Deep-merge `extra` into a copy of `base` (dicts merge, everything else replaces)."""
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def read_yaml(path: str | Path) -> dict[str, Any]:
    """A YAML mapping from `path`; errors name the file."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{p}: config file not found")
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{p}: not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: the top level must be a mapping, got {type(data).__name__}")
    return data


def nest(values: dict[str, Any] | None) -> dict[str, Any]:
    """`{"a.b": 1}` -> `{"a": {"b": 1}}`: typed values (CLI options) under dotted keys, not parsed."""
    tree: dict[str, Any] = {}
    for key, value in (values or {}).items():
        node = tree
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return tree


def validate(model: type[M], data: dict[str, Any], where: str, prefix: str = "") -> M:
    """`model.model_validate(data)`, with errors as one `ConfigError` naming `where` and each key."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(f"{prefix}{'.'.join(str(p) for p in e['loc']) or '<top>'}: {e['msg']}" for e in exc.errors())
        raise ConfigError(f"{where}: invalid config: {problems}") from exc


def load_config(
    path: str | Path | None, overrides: list[str] | None, model: type[M], values: dict[str, Any] | None = None
) -> M:
    """Read `path` (optional), apply `key=value` overrides, then typed dotted-key `values`; validate."""
    data = read_yaml(path) if path is not None else {}
    data = merge(merge(data, parse_overrides(overrides)), nest(values))
    return validate(model, data, str(path) if path is not None else "options")
