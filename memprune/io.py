"""Atomic, streaming writers for the stage tables and their JSON/JSONL side outputs.

Every file is written under a temporary name in the same directory and renamed into
place when complete, so a crash never leaves a half-written table that a resume would
trust.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Iterable, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from memprune.schema import TABLES, SchemaError, validate_table


@contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path beside `path`; rename it onto `path` only if the block succeeds."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def jsonable(obj: Any) -> Any:
    """Plain JSON values, recursively: NaN/inf -> None, numpy scalars -> Python, sets sorted, enums -> value."""
    if isinstance(obj, Mapping):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, (set, frozenset)):
        return sorted((jsonable(v) for v in obj), key=str)
    if isinstance(obj, (bool, np.bool_)):
        return bool(obj)
    if isinstance(obj, (int, np.integer)):
        return int(obj)
    if isinstance(obj, (float, np.floating)):
        return float(obj) if math.isfinite(obj) else None
    if obj is None or isinstance(obj, str):
        return obj
    return getattr(obj, "value", str(obj))


def write_json(path: str | os.PathLike[str], obj: Any) -> None:
    """Write `obj` as indented, key-sorted JSON, atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def write_table(table: pa.Table, path: str | os.PathLike[str], name: str | None = None) -> None:
    """Validate `table` against the schema `name` (when given) and write it as Parquet, atomically."""
    if name is not None:
        validate_table(table, name, source=str(path))
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp)


def read_table(path: str | os.PathLike[str], name: str, columns: list[str] | None = None) -> pa.Table:
    """Read a stage table and validate it; a missing or unreadable file names the path."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{p}: no such file (expected the {name!r} table)")
    try:
        table = pq.read_table(p, columns=columns)
    except (pa.ArrowInvalid, OSError) as exc:
        raise SchemaError(f"{p}: cannot read as Parquet: {exc}") from exc
    if columns is None:
        validate_table(table, name, source=str(p))
    return table


class _AtomicFile:
    """A file written under a temporary name: `close()` renames it onto `path`, `abort()` discards it.

    Used as a context manager, an exception in the block aborts it, so a failed run leaves no half file.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._ctx = atomic_path(self.path)
        self._tmp = self._ctx.__enter__()

    def _finish(self) -> None:
        """Close the underlying writer (subclasses)."""

    def close(self) -> None:
        self._finish()
        self._ctx.__exit__(None, None, None)

    def abort(self) -> None:
        self._finish()
        try:
            self._ctx.__exit__(RuntimeError, RuntimeError("aborted"), None)
        except RuntimeError:
            pass

    def __enter__(self) -> Any:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


class TableSink(_AtomicFile):
    """Stream rows into one Parquet file with a fixed schema, in bounded memory.

    Rows are buffered and flushed as row groups of `batch_rows`; the file appears
    under its final name only when `close()` succeeds.
    """

    def __init__(self, path: str | os.PathLike[str], schema: pa.Schema, batch_rows: int = 50_000) -> None:
        super().__init__(path)
        self.schema = schema
        self.batch_rows = batch_rows
        self.rows = 0
        self._buffer: list[dict[str, Any]] = []
        self._writer = pq.ParquetWriter(self._tmp, schema)

    def write(self, row: Mapping[str, Any]) -> None:
        self._buffer.append(dict(row))
        if len(self._buffer) >= self.batch_rows:
            self.flush()

    def write_many(self, rows: Iterable[Mapping[str, Any]]) -> None:
        for row in rows:
            self.write(row)

    def write_table(self, table: pa.Table) -> None:
        """Append a whole batch already in this sink's schema as one row group (no per-row dicts)."""
        self.flush()
        self._writer.write_table(table)
        self.rows += table.num_rows

    def flush(self) -> None:
        if self._buffer:
            self._writer.write_table(pa.Table.from_pylist(self._buffer, schema=self.schema))
            self.rows += len(self._buffer)
            self._buffer = []

    def close(self) -> None:
        self.flush()
        super().close()

    def _finish(self) -> None:
        self._writer.close()


def table_sink(path: str | os.PathLike[str], name: str, batch_rows: int = 50_000) -> TableSink:
    """A `TableSink` for the named stage table."""
    return TableSink(path, TABLES[name], batch_rows=batch_rows)


class JsonlSink(_AtomicFile):
    """Append JSON lines to a file that is renamed into place on close (atomic)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        super().__init__(path)
        self.count = 0
        self._fh: IO[str] = open(self._tmp, "w", encoding="utf-8")

    def write(self, obj: Mapping[str, Any]) -> None:
        self._fh.write(json.dumps(obj, ensure_ascii=False, sort_keys=True) + "\n")
        self.count += 1

    def _finish(self) -> None:
        self._fh.close()


def write_jsonl(path: str | os.PathLike[str], rows: Iterable[Mapping[str, Any]]) -> int:
    """Write `rows` as JSON lines, atomically; return how many were written."""
    with JsonlSink(path) as sink:
        for row in rows:
            sink.write(row)
    return sink.count


def write_text(path: str | os.PathLike[str], text: str) -> None:
    """Write `text` (UTF-8), atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def write_summary(out: str | os.PathLike[str], name: str, summary: Mapping[str, Any], markdown: str) -> None:
    """A stage's two reports: `OUT/<name>.json` (machine) and `OUT/<name>.md` (human), each atomic."""
    write_json(Path(out) / f"{name}.json", summary)
    write_text(Path(out) / f"{name}.md", markdown)
