"""Atomic, streaming writers for the step tables and their JSON/JSONL side outputs.

Every file is written under a temporary name in the same directory and renamed into place when
complete, so a crash never leaves a half-written table that a resume would trust. A step's outputs
as a whole are committed together by an `OutputSet` (`memprune.outputs`), with a marker (`MARKER`,
`.memprune.json`) that readers check, so a failed or killed run never leaves a mix of old and new tables that
a later step would read.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import stat
import uuid
from collections.abc import Iterable, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from memprune.schema import TABLES, SchemaError, conform_table, validate_table

TEMP = re.compile(r"^\..+\.tmp-(\d+)-[0-9a-f]{8}$")
MARKER = ".memprune.json"


def temp_name(name: str) -> str:
    """A hidden temporary name for `name` that records this process (so stale ones can be cleaned)."""
    return f".{name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_stale(directory: str | os.PathLike[str]) -> int:
    """Remove the temporary files and directories that killed runs left in `directory`; return how many."""
    d, removed = Path(directory), 0
    if not d.is_dir():
        return 0
    for entry in d.iterdir():
        m = TEMP.match(entry.name)
        if m and not _alive(int(m.group(1))):
            shutil.rmtree(entry, ignore_errors=True) if entry.is_dir() else entry.unlink(missing_ok=True)
            removed += 1
    return removed


def _file_mode() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


FILE_MODE = _file_mode()  # what a plain `open` would create (mkstemp-style temp files are 0600)


@contextmanager
def atomic_path(path: str | os.PathLike[str], keep_mode: bool = False) -> Iterator[Path]:
    """Yield a temporary path beside `path`; rename it onto `path` only if the block succeeds.

    The file gets the permissions a plain `open` would give it (0666 minus the umask); with
    `keep_mode` a file that exists keeps its own mode and owner (a user's store file rewritten).
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    before = target.stat() if keep_mode and target.exists() else None
    tmp = target.parent / temp_name(target.name)
    tmp.touch()
    try:
        yield tmp
        if tmp.exists():
            os.chmod(tmp, FILE_MODE if before is None else stat.S_IMODE(before.st_mode))
            if before is not None and hasattr(os, "chown"):
                with contextlib.suppress(OSError):  # only root may give a file to another owner
                    os.chown(tmp, before.st_uid, before.st_gid)
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
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


def write_json(path: str | os.PathLike[str] | Any, obj: Any) -> None:
    """Write `obj` as indented, key-sorted JSON, atomically (`path` may be a URI or a `Location`: one PUT)."""
    from memprune.storage import location

    text = json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
    loc = location(path)
    if not loc.local:
        loc.write_text(text)
        return
    with atomic_path(loc.path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def write_table(table: pa.Table, path: str | os.PathLike[str], name: str | None = None) -> None:
    """Validate `table` against the schema `name` (when given) and write it as Parquet, atomically."""
    if name is not None:
        validate_table(table, name, source=str(path))
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp)


def read_table(path: str | os.PathLike[str], name: str, columns: list[str] | None = None) -> pa.Table:
    """Read a step table and validate it; a missing, unfinished or unreadable file names the path (or URI)."""
    from memprune.storage import is_uri, location

    if is_uri(path):
        loc = location(path)
        if not loc.is_file():
            raise FileNotFoundError(f"{loc}: no such file (expected the {name!r} table)")
        check_committed(loc.uri)
        try:
            table = pq.read_table(loc.path, columns=columns, filesystem=loc.fs)
        except (pa.ArrowInvalid, OSError) as exc:
            raise SchemaError(f"{loc}: cannot read as Parquet: {exc}") from exc
        return _validated(table, name, loc.uri, columns)
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{p}: no such file (expected the {name!r} table)")
    if not p.is_file():
        raise SchemaError(f"{p}: is not a file (expected the {name!r} table as a Parquet file)")
    check_committed(p)
    try:
        table = pq.read_table(p, columns=columns)
    except (pa.ArrowInvalid, OSError) as exc:
        raise SchemaError(f"{p}: cannot read as Parquet: {exc}") from exc
    return _validated(table, name, str(p), columns)


def _validated(table: pa.Table, name: str, source: str, columns: list[str] | None) -> pa.Table:
    table = conform_table(table, name, source=source)
    if columns is None:
        validate_table(table, name, source=source)
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


def file_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else path.stat().st_size


def check_committed(path: str | os.PathLike[str]) -> None:
    """Refuse to read an output that a memprune step did not finish writing (see `OutputSet`).

    Without a marker beside it the file is someone else's data and is read as it is. `path` may be a URI.
    """
    from memprune.storage import location

    loc = location(path)
    if not loc.local:
        _check_committed_remote(loc)
        return
    p = Path(str(path).removeprefix("file://"))
    marker = p.parent / MARKER
    if not marker.is_file():
        return
    try:
        info = json.loads(marker.read_text(encoding="utf-8"))
    except (ValueError, OSError):
        raise SchemaError(f"{marker}: unreadable output marker; rerun the step that writes {p.parent}") from None
    _check_marker(info, str(p.parent), str(marker), p.name, file_size(p) if p.exists() else None)


def _check_committed_remote(loc: Any) -> None:
    marker = loc.parent / MARKER
    if not marker.is_file():
        return
    try:
        info = json.loads(marker.read_text())
    except ValueError:
        raise SchemaError(f"{marker}: unreadable output marker; rerun the step that writes {loc.parent}") from None
    size = loc.stamp()[0] if loc.is_file() else sum(loc.files().values()) if loc.exists() else None
    _check_marker(info, str(loc.parent), str(marker), loc.name, size)


def _check_marker(info: dict[str, Any], parent: str, marker: str, name: str, size: int | None) -> None:
    step = info.get("step", "a memprune")
    if info.get("state") != "done":
        raise SchemaError(f"{parent}: the {step} run that writes this directory did not finish (interrupted while "
                          f"committing its outputs); rerun it")
    files = info.get("files") or {}
    if name in files and size is not None and size != files[name]:
        raise SchemaError(f"{parent}/{name}: changed since the {step} run wrote it ({size} bytes, recorded "
                          f"{files[name]}); rerun the step, or delete {marker} to use the directory as your own data")
