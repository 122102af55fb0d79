"""The pruned store as the memory evaluations read it: bullet id -> keep flag, and what its report says.

A pruned store is what `memprune prune` writes (`DIR/pruned/part-*.parquet` next to `DIR/prune.json`), a
directory of such Parquet files, or one file, on a local disk or a storage URI (read through its filesystem, no
copy); only `bullet_id` and `keep` are read. Both dialogue-eval and qa-eval read it here, so a store that one
accepts the other accepts too, with the same error lines.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from memprune.errors import MemPruneError
from memprune.storage import Location, directory


class PrunedStoreError(MemPruneError):
    """The pruned store cannot be read or does not cover the evaluated memory; the message names the file or row."""


def pruned_files(path: str | Path) -> list[Path] | list[Location]:
    """The Parquet files of a pruned store: `DIR/pruned/part-*.parquet`, a dir of Parquet files, or one file."""
    p = directory(path, "--pruned")
    if isinstance(p, Location):
        return _remote_files(p)
    if p.is_file():
        return [p]
    if not p.exists():
        raise PrunedStoreError(f"{p}: pruned store not found (give a `memprune prune` output directory)")
    if (p / "pruned").is_dir():
        p = p / "pruned"
    files = sorted(f for f in p.glob("*.parquet") if not f.name.startswith((".", "_")))
    if not files:
        raise PrunedStoreError(f"{p}: no Parquet files here (expected the pruned store of `memprune prune`)")
    return files


def _remote_files(loc: Location) -> list[Location]:
    """`pruned_files` of a store on object storage: one listing, the same layouts and errors."""
    if loc.is_file():
        return [loc]
    names = loc.files()
    if not names:
        raise PrunedStoreError(f"{loc}: pruned store not found (give a `memprune prune` output directory)")
    prefix = "pruned/" if any(n.startswith("pruned/") for n in names) else ""
    files = sorted(n for n in names if n.startswith(prefix) and n.endswith(".parquet")
                   and "/" not in n[len(prefix):] and not n[len(prefix):].startswith((".", "_")))
    if not files:
        where = loc / prefix.rstrip("/") if prefix else loc
        raise PrunedStoreError(f"{where}: no Parquet files here (expected the pruned store of `memprune prune`)")
    return [loc / n for n in files]


def _source(file: Path | Location) -> tuple[Any, Any]:
    """(path, filesystem) for pyarrow's readers: a `Location`'s own, or a local path and None."""
    return (file.path, file.fs) if isinstance(file, Location) else (file, None)


def _check_schema(file: Path | Location) -> None:
    """A `PrunedStoreError` unless `file` is Parquet with a string `bullet_id` and a bool `keep`."""
    try:
        where, filesystem = _source(file)
        schema = pq.read_schema(where, filesystem=filesystem)
    except (pa.ArrowInvalid, OSError) as exc:
        raise PrunedStoreError(f"{file}: cannot read as Parquet: {exc}") from exc
    for col, typ in (("bullet_id", pa.string()), ("keep", pa.bool_())):
        if col not in schema.names:
            raise PrunedStoreError(f"{file}: column {col!r} missing (not a pruned store: run `memprune prune`)")
        if not schema.field(col).type.equals(typ):
            raise PrunedStoreError(f"{file}: column {col!r} has type {schema.field(col).type}, expected {typ}")


def _store_rule(files: list[Path] | list[Location]) -> dict[str, Any] | None:
    """The pruning rule of the store's `prune.json` (as prune.json records it: flat, with its `label`) if it has one."""
    report = files[0].parent.parent / "prune.json" if files[0].parent.name == "pruned" else None
    if report is None or not report.is_file():
        return None
    try:
        rule = json.loads(report.read_bytes().decode("utf-8")).get("rule") or {}
    except (ValueError, OSError, MemPruneError):
        return None
    return {k: v for k, v in rule.items() if k not in ("description", "keys")}


def load_keep(path: str | Path) -> tuple[dict[str, bool], dict[str, Any]]:
    """bullet id -> keep flag of a pruned store, and what the report says about it (files, counts, rule)."""
    files = pruned_files(path)
    keep: dict[str, bool] = {}
    for f in files:
        _check_schema(f)
        where, filesystem = _source(f)
        table = pq.read_table(where, columns=["bullet_id", "keep"], filesystem=filesystem)
        ids, flags = table.column("bullet_id").to_pylist(), table.column("keep").to_pylist()
        for i, (bid, flag) in enumerate(zip(ids, flags)):
            if bid is None or flag is None:
                raise PrunedStoreError(f"{f}: row {i}: {'bullet_id' if bid is None else 'keep'} is null")
            if bid in keep:
                raise PrunedStoreError(f"{f}: row {i}: bullet_id {bid!r} appears twice in the pruned store")
            keep[bid] = bool(flag)
    shown = str(path) if isinstance(files[0], Location) else str(Path(path))
    info: dict[str, Any] = {"path": shown, "files": [str(f) for f in files], "bullets": len(keep),
                            "kept": sum(keep.values())}
    rule = _store_rule(files)
    if rule is not None:
        info["rule"] = rule
    return keep, info


def missing_from_store(keep: Mapping[str, bool], bullet_ids: Iterable[str], store: str, policy: str,
                       what: str) -> list[str]:
    """The memory bullets absent from the pruned store, sorted; with `policy` "error" any is a `PrunedStoreError`
    naming the store (`pruned_missing: drop` counts them as not kept instead)."""
    missing = sorted({b for b in bullet_ids if b not in keep})
    if missing and policy == "error":
        raise PrunedStoreError(f"{store}: {len(missing)} memory bullet(s) of {what} are not in the pruned store, e.g. "
                               f"{missing[0]!r} (was it pruned from another bullets table? set pruned_missing: drop "
                               f"to count them as not kept)")
    return missing
