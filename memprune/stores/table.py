"""The `table` store: Parquet, JSONL or CSV files (or a directory of them) with a column mapping.

The location is a local path or a storage URI (`s3://b/mem.csv`, `s3://b/mem/`; `memprune.storage`): each
file is read where it lives through its filesystem (a Parquet file: only the mapped columns; on the driver, or a
Ray Data read task per file for a store past `export`'s in-memory limit), never copied first.
Each file is a partition. A write changes only the records it names and nothing else: CSV and
JSONL files are edited record by record in their own text (`memprune.stores.records`: no type
inference, no re-serialisation), Parquet files are filtered with their own schema and codec. Every
rewrite is atomic: on a local disk temp file + rename, keeping the file's mode and owner; on object
storage one PUT of the whole new object (only the files that change), with the same bytes. A crash
leaves each file either old or new and a rerun finishes the rest. Archived records keep the file they came from
(`memprune_file`), their position in it (`memprune_position`) and, for CSV and JSONL, their exact
text (`memprune_raw`), so `restore` puts each one back where it was, byte for byte. A file that is a symbolic link
is read, locked, rewritten and restored as its target: the link stays a link to the pruned file.

Writers on a local disk hold an exclusive lock (`flock`) on `.NAME.memprune-lock` beside each file (created on the
first write, never removed): a live apply (`memprune.stores.group`) holds it from its check to its last delete and
rewrites each file from its bytes as re-read under the lock, deleting a record only where its text and group are
still the decided ones; other replicas, processes and `restore` wait. Files on object storage have no lock: the
delete re-reads and re-checks each record, which narrows the window to its single read and PUT.
One group's records (the live path: `read_group`, `fetch_group`, `delete_unchanged`) are found without parsing the
rest: a Parquet file filtered by the reader, a CSV file's other rows never turned into records, a JSONL line that
cannot hold the group never decoded (`records.scan`).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from memprune import storage
from memprune.archive import DECISION_COLUMNS
from memprune.io import atomic_path
from memprune.storage import Location
from memprune.stores import records as rec
from memprune.stores.base import (INTEGER, REJECT, STRINGS, Partition, Store, normalize, register, text_hash,
                                  unchanged)
from memprune.stores.config import StoreError

FORMATS = {".parquet": "parquet", ".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl", ".csv": "csv"}
FILE, POSITION, RAW = "memprune_file", "memprune_position", "memprune_raw"
LOCATOR = (FILE, POSITION, RAW)
BATCH = 65_536
LOCK_SUFFIX, LOCK_WAIT = ".memprune-lock", 120.0  # `.FILE.memprune-lock` beside each local file; seconds to wait


def _format(path: Location) -> str:
    suffix = Path(path.name).suffix
    fmt = FORMATS.get(suffix.lower())
    if fmt is None:
        raise StoreError(f"{path}: not a Parquet, JSONL or CSV file (suffix {suffix or 'none'})")
    return fmt


def _parse(path: Location, id_column: str) -> rec.RecordFile:
    """A CSV or JSONL file as record chunks; a record that cannot be parsed is one error naming the file."""
    data = _read(path)
    return _records(path, lambda: rec.parse(data, _format(path), id_column))


def _group_value(value: Any, where: str, column: str) -> str:
    """A record's group as the normal form has it (`_text_value`; null: the empty group)."""
    text = value if value is None or isinstance(value, str) else _text_value(value, where, column, "group")
    return "" if text is None else text


def _needle(group: str) -> str | None:
    """Text every JSONL line without a backslash holding `group` contains, and a cell every CSV record of `group`
    has (None: no such text). A string is written as it is; a JSON number as its digits only where `group` is an
    integer (3.0 may be written 3e0)."""
    if group == "":
        return None  # a record without the key is in the empty group
    if not INTEGER.fullmatch(group):
        try:
            float(group)
            return None
        except ValueError:
            pass
    return group


def _scan_group(path: Location, fields: dict[str, str], group: str,
                ids: set[str] | None = None) -> tuple[str, list[str], list[rec.Found]]:
    """A CSV or JSONL file's text, columns and the records of `group` (of `ids` only, when given) found in it."""
    data, column, where = _read(path), fields["group"], str(path)

    def keep(row: dict[str, Any]) -> bool:
        if ids is not None and rec.id_text(row.get(fields["id"])) not in ids:
            return False
        return _group_value(row.get(column), where, column) == group
    return _records(path, lambda: rec.scan(data, _format(path), fields["id"], keep, _needle(group)))


def _parquet(path: Location) -> pa.Table:
    try:
        return pq.read_table(path.path, filesystem=path.fs)
    except (pa.ArrowInvalid, OSError) as exc:
        raise StoreError(f"{path}: cannot read as parquet: {str(exc).splitlines()[0]}") from None


def _parquet_file(path: Location) -> pq.ParquetFile:
    return pq.ParquetFile(path.path, filesystem=path.fs)


def _columns(path: Location, id_column: str, wanted: Sequence[str] = ()) -> list[str]:
    """The column names of a file (Parquet: its footer; CSV: its header; JSONL: every key of its records, or, when
    each of `wanted` is the key of a record found by its text, `wanted` alone: no whole parse to check a mapping)."""
    fmt = _format(path)
    if fmt == "parquet":
        try:
            return _parquet_file(path).schema_arrow.names
        except (pa.ArrowInvalid, OSError) as exc:
            raise StoreError(f"{path}: cannot read as parquet: {str(exc).splitlines()[0]}") from None
    data = _read(path)
    if fmt == "csv":
        return _records(path, lambda: rec.csv_header(data))
    if wanted and all(_has_key(data, key) for key in wanted):
        return list(wanted)
    return _records(path, lambda: rec.parse(data, fmt, id_column)).columns


def _has_key(data: bytes, key: str) -> bool:
    """Whether a JSONL record (one of the first few lines holding `key`'s JSON text) has the top-level key `key`."""
    needle = json.dumps(key, ensure_ascii=False).encode(rec.ENCODING, rec.ERRORS)
    at = data.find(needle)
    for _ in range(8):
        if at < 0:
            return False
        start, end = data.rfind(b"\n", 0, at) + 1, data.find(b"\n", at)
        try:
            obj = json.loads(data[start:None if end < 0 else end].decode(rec.ENCODING, rec.ERRORS))
        except json.JSONDecodeError:
            obj = None
        if isinstance(obj, dict) and key in obj:
            return True
        at = data.find(needle, len(data) if end < 0 else end)
    return False


def _read(path: Location) -> bytes:
    try:
        return Path(path.path).read_bytes() if path.local else path.read_bytes()
    except OSError as exc:
        raise StoreError(f"{path}: cannot read: {exc.strerror or exc}") from None


def _records(path: Location, parse: Callable[[], Any]) -> Any:
    """`parse()` of a CSV or JSONL file's records; a record that cannot be parsed is one error naming the file."""
    try:
        return parse()
    except rec.RecordError as exc:
        raise StoreError(f"{path}: {exc}") from None


def _text_value(value: Any, where: str, column: str, field: str) -> str | None:
    """A JSONL value of a mapped field as text: strings as they are; ids, groups and times may be numbers."""
    if value is None or isinstance(value, str):
        return value
    if field != "text" and isinstance(value, (int, float)):
        return json.dumps(value)
    raise StoreError(f"{where}: field {column!r} (mapped to {field}) is a JSON {type(value).__name__}; "
                     "expected a string")


def _text_batches(path: Location, fields: dict[str, str]) -> Iterator[pa.RecordBatch]:
    """The mapped columns of a CSV or JSONL file as string batches (what `normalize` reads)."""
    rf = _parse(path, fields["id"])
    yield from _chunk_batches(path, rf.fmt, rf.columns, [c for _, c in rf.records()], fields)


def _chunk_batches(path: Location, fmt: str, columns: list[str], chunks: list[rec.Chunk],
                   fields: dict[str, str]) -> Iterator[pa.RecordBatch]:
    """The mapped columns of CSV or JSONL records as string batches."""
    rf = rec.RecordFile(fmt, "", [], columns)
    # JSONL records without a mapped key name none: each then has every mapped column (null where absent).
    present = [(f, c) for f, c in fields.items() if c in rf.columns or rf.fmt == "jsonl"]
    for start in range(0, max(len(chunks), 1), BATCH):
        part = chunks[start:start + BATCH]
        cols: dict[str, list[str | None]] = {}
        for field, col in present:
            if rf.fmt == "csv":
                cols[col] = [c.fields.get(col) for c in part]
            else:
                cols[col] = [_text_value(c.fields.get(col), f"{path}: record {start + k + 1}", col, field)
                             for k, c in enumerate(part)]
        reject: list[str | None] = [None] * len(part)
        for field, col in present:  # bytes that are not UTF-8 (read with surrogateescape): the record is rejected
            values = cols[col]
            for k, value in enumerate(values):
                at = None if value is None else next((i for i, ch in enumerate(value) if "\udc80" <= ch <= "\udcff"), None)
                if at is not None:
                    reject[k] = reject[k] or (f"{col} ({field}) is not UTF-8 text: byte 0x{ord(value[at]) - 0xDC00:02X} "
                                              f"at character {at}; convert the file to UTF-8 (iconv -t utf-8)")
                    values[k] = value.encode(rec.ENCODING, rec.ERRORS).decode(rec.ENCODING, "replace")
        out = {k: pa.array(v, pa.string()) for k, v in cols.items()}
        if any(reject):
            out[REJECT] = pa.array(reject, pa.string())
        yield pa.RecordBatch.from_pydict(out)


def _mapped(names: Sequence[str], fields: dict[str, str]) -> list[str]:
    """The columns of `names` that `fields` maps (what a read needs: a Parquet read projects on them)."""
    return [c for c in dict.fromkeys(fields.values()) if c in names]


def _batches(path: Location, fields: dict[str, str]) -> Iterator[pa.RecordBatch]:
    """Stream a file's mapped columns (Parquet in batches with its own types, only those columns read; CSV and JSONL
    as text)."""
    if _format(path) != "parquet":
        yield from _text_batches(path, fields)
        return
    try:
        file = _parquet_file(path)
        yield from file.iter_batches(batch_size=BATCH, columns=_mapped(file.schema_arrow.names, fields))
    except (pa.ArrowInvalid, OSError) as exc:
        raise StoreError(f"{path}: cannot read as parquet: {str(exc).splitlines()[0]}") from None


def _group_batches(path: Location, fields: dict[str, str], group: str) -> Iterator[pa.RecordBatch]:
    """The records of one group (mapped columns): a Parquet file filtered by the reader (row groups whose statistics
    exclude it are skipped) where its group column is text or integers; a CSV or JSONL file scanned for the group's
    records alone (`records.scan`)."""
    fmt = _format(path)
    if fmt != "parquet":
        _, columns, found = _scan_group(path, fields, group)
        yield from _chunk_batches(path, fmt, columns, [f.chunk for f in found], fields)
        return
    import pyarrow.dataset as pads

    try:
        data = pads.dataset(path.path, format="parquet", filesystem=path.fs)
        column, columns = fields["group"], _mapped(data.schema.names, fields)
        kind = data.schema.field(column).type
        if pa.types.is_integer(kind):
            if not INTEGER.fullmatch(group):
                return  # no integer is this group
            value: Any = int(group)
        elif any(f(kind) for f in STRINGS):
            value = group
        else:
            yield from data.to_batches(columns=columns, batch_size=BATCH)
            return
        yield from data.to_batches(columns=columns, filter=pads.field(column) == value, batch_size=BATCH)
    except (pa.ArrowInvalid, OSError) as exc:
        raise StoreError(f"{path}: cannot read as parquet: {str(exc).splitlines()[0]}") from None


def _replace(path: Location, data: bytes) -> None:
    """Replace a file of the store with `data` whole: temp file + rename keeping its mode and owner on a local disk,
    one PUT of the new object on object storage."""
    if not path.local:
        path.write_bytes(data)
        return
    try:
        with atomic_path(path.path, keep_mode=True) as tmp:
            tmp.write_bytes(data)
    except PermissionError as exc:  # an immutable or read-only file or directory: this file is left as it was
        raise StoreError(f"{path}: cannot replace it ({exc.strerror}: an immutable or read-only file or directory?); "
                         "it is unchanged; make it writable and rerun, which resumes") from None


def _write_text(path: Location, rf: rec.RecordFile) -> None:
    _replace(path, rec.encode(rf.render()))


def _write_parquet(path: Location, table: pa.Table) -> None:
    """Replace a Parquet file of the store with `table` (its schema), in the file's own compression codec."""
    codec = "snappy"
    if path.exists():
        meta = _parquet_file(path).metadata
        if meta.num_row_groups and meta.num_columns:
            codec = {"UNCOMPRESSED": "none", "LZ4_RAW": "lz4"}.get(meta.row_group(0).column(0).compression,
                                                                  meta.row_group(0).column(0).compression.lower())
    buffer = pa.BufferOutputStream()
    pq.write_table(table, buffer, compression=codec)
    _replace(path, buffer.getvalue().to_pybytes())


def _files(where: Location) -> list[Location]:
    """The store's files: the file itself, or the Parquet/JSONL/CSV files below a directory (names starting with `.`
    or `_` skipped), in path order; a missing bucket, object or directory is one line."""
    missing = StoreError(f"table:{where}: no such file or directory")
    if where.local:  # spelled as before: the archive records each record's file
        root = Path(where.uri.removeprefix("file://"))
        if root.is_file():
            return [storage.location(str(_real(root)))]
        if not root.is_dir():
            raise missing
        names = sorted(f.relative_to(root) for f in root.rglob("*") if f.is_file())
        at = lambda n: storage.location(str(_real(root / n)))  # noqa: E731
    else:
        where.check_reachable()
        if where.is_file():
            return [where]
        names = [Path(n) for n in sorted(where.files())]
        if not names:
            raise missing
        at = lambda n: where / str(n)  # noqa: E731
    files = [at(n) for n in names
             if n.suffix.lower() in FORMATS and not any(part.startswith((".", "_")) for part in n.parts)]
    if not files:
        raise StoreError(f"{where}: no Parquet, JSONL or CSV files in this directory")
    return files


def _real(path: Path) -> Path:
    """A store file that is a symbolic link is its target: the lock, the rewrite and a restore reach the real file
    (readers through the link see the change) and the link stays a link."""
    return path.resolve(strict=True) if path.is_symlink() else path


def _lock(path: Path) -> int:
    """An open descriptor holding the exclusive lock of `path`'s lock file (`.NAME.memprune-lock` beside it)."""
    lock = path.parent / f".{path.name}{LOCK_SUFFIX}"
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as exc:
        raise StoreError(f"{path}: cannot create its lock file {lock}: {exc.strerror or exc}; "
                         "nothing was changed") from None
    deadline = time.monotonic() + LOCK_WAIT
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() > deadline:
                os.close(fd)
                raise StoreError(f"{path}: another writer has held its lock {lock} for {LOCK_WAIT:.0f} s; "
                                 "nothing was changed") from None
            time.sleep(0.05)


def _complement(n: int, absent: set[int]) -> np.ndarray:
    """The first `n` positions not in `absent`: where the records in a file now stood before the archived left."""
    return np.setdiff1d(np.arange(n + len(absent)), np.fromiter(absent, np.int64, len(absent)))[:n]


@register
class TableStore(Store):
    """Parquet / JSONL / CSV files with `--map id=...,text=...,group=...,time=...`."""

    kind = "table"

    def __init__(self, location: str, mapping: dict[str, str] | None = None) -> None:
        super().__init__(location, mapping)
        self._depth, self._fds = 0, []  # `locked`: how deep, and the lock files held
        self.files = _files(storage.location(location, "table store"))
        for f in self.files:  # mapped columns checked up front, before any Ray task starts
            names = _columns(f, self.fields["id"], [c for k, c in self.fields.items() if k not in self.optional])
            if not names and _format(f) == "jsonl":
                continue  # no records, so no keys to check
            for field, col in self.fields.items():
                if col not in names and field not in self.optional:
                    raise StoreError(f"{f}: column {col!r} (mapped to {field}) missing; columns: {', '.join(names)}")

    def raw_partitions(self) -> list[Partition]:
        fields = self.fields
        return [(lambda f=f: _batches(f, fields)) for f in self.files]

    def raw_group(self, group: str) -> list[Partition]:
        fields = self.fields
        return [(lambda f=f: _group_batches(f, fields, group)) for f in self.files]

    def _parquet_ids(self, table: pa.Table, path: Location) -> pa.Array:
        name = self.fields["id"]
        if name not in table.column_names:
            raise StoreError(f"{path}: column {name!r} (mapped to id) missing")
        return pc.cast(table.column(name), pa.string())

    def fetch(self, ids: Sequence[str]) -> pa.Table:
        """The whole records, each with its file, its position there and (CSV, JSONL) its exact text."""
        return self._fetch(set(map(str, ids)))

    def fetch_group(self, group: str, ids: Sequence[str]) -> pa.Table:
        """`fetch` of records of `group`: a CSV or JSONL file scanned for them alone (`records.scan`)."""
        return self._fetch(set(map(str, ids)), group)

    def _fetch(self, wanted: set[str], group: str | None = None) -> pa.Table:
        parts = []
        for path in self.files:
            if _format(path) == "parquet":
                table = _parquet(path)
                mask = pc.is_in(self._parquet_ids(table, path), pa.array(sorted(wanted), pa.string()))
                got = table.filter(mask)
                got = got.append_column(POSITION, pa.array(np.flatnonzero(mask.to_numpy(zero_copy_only=False)), pa.int64()))
            else:
                if group is None:
                    rf = _parse(path, self.fields["id"])
                    fmt, columns, hits = rf.fmt, rf.columns, [(p, c) for p, c in rf.records() if c.id in wanted]
                else:
                    _, columns, found = _scan_group(path, self.fields, group, wanted)
                    fmt, hits = _format(path), [(f.position, f.chunk) for f in found]
                cols = columns if fmt == "csv" else [c for c in dict.fromkeys(self.fields.values()) if c in columns]
                got = pa.table({**{col: pa.array([rec.id_text(c.fields.get(col)) if col == self.fields["id"] else
                                                  _cell_text(c.fields.get(col)) for _, c in hits], pa.string())
                                   for col in cols},
                                POSITION: pa.array([p for p, _ in hits], pa.int64()),
                                RAW: pa.array([c.text for _, c in hits], pa.string())})
            if got.num_rows:
                parts.append(got.append_column(FILE, pa.array([path.uri] * got.num_rows, pa.string())))
        if not parts:
            return pa.table({self.fields["id"]: pa.array([], pa.string()), FILE: pa.array([], pa.string())})
        try:
            return pa.concat_tables(parts, promote_options="permissive")
        except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
            raise StoreError(f"{self.where}: its files give column types that do not combine into one archive "
                             f"({str(exc).splitlines()[0]}); prune each file as its own store") from None

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the lock file of every local file of the store (in path order; re-entrant for this object, which one
        thread uses at a time); waits up to `LOCK_WAIT` seconds for another writer, then one error line."""
        if self._depth == 0:
            self._fds = []
            try:
                for path in self.files:
                    if path.local:
                        self._fds.append(_lock(Path(path.path)))
            except BaseException:
                self._unlock()
                raise
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if self._depth == 0:
                self._unlock()

    def _unlock(self) -> None:
        for fd in self._fds:
            os.close(fd)  # closing the descriptor releases its lock
        self._fds = []

    def delete_unchanged(self, group: str, expected: dict[str, str]) -> tuple[list[str], dict[str, str]]:
        """Under the lock, each file re-read: delete the records of `expected` still in `group` with their decided
        text; a file is rewritten from the bytes just read (CSV and JSONL cut record by record, nothing else
        parsed or moved)."""
        with self.locked():
            seen: list[tuple[Location, Any]] = []
            now: dict[str, str | None] = {}
            for path in self.files:
                if _format(path) == "parquet":
                    table = _parquet(path)
                    rows = normalize(table, self.mapping, str(path))
                    mine = pc.equal(rows.column("group"), group)
                    ids, hashes = rows.column("id"), rows.column("hash")
                    now.update(zip(ids.filter(mine).to_pylist(), hashes.filter(mine).to_pylist()))
                    seen.append((path, (table, ids, hashes, mine)))
                else:
                    text, _, found = _scan_group(path, self.fields, group, set(expected))
                    for f in found:
                        body = f.chunk.fields.get(self.fields["text"])
                        now[f.chunk.id] = None if body is None else text_hash(
                            _text_value(body, f"{path}: record {f.position + 1}", self.fields["text"], "text"))
                    seen.append((path, (text, found)))
            todo, left = unchanged(now, expected)
            gone = {i: expected[i] for i in todo}
            for path, got in seen:
                if _format(path) == "parquet":
                    table, ids, hashes, mine = got
                    if not gone:
                        continue
                    decided = pc.take(pa.array(list(gone.values()), pa.string()),
                                      pc.index_in(ids, pa.array(list(gone), pa.string())))
                    hit = pc.fill_null(pc.and_(mine, pc.equal(hashes, decided)), False)
                    if pc.sum(hit).as_py():
                        _write_parquet(path, table.filter(pc.invert(hit)))
                else:
                    text, found = got
                    cut = [f for f in found if f.chunk.id in gone and now.get(f.chunk.id) == gone[f.chunk.id]]
                    if cut:
                        _replace(path, rec.encode(rec.cut(text, cut)))
            return todo, left

    def delete(self, ids: Sequence[str]) -> int:
        with self.locked():
            return self._delete(ids)

    def set_fields(self, values: pa.Table) -> int:
        with self.locked():
            return self._set_fields(values)

    def insert(self, records: pa.Table, archived: pa.Table | None = None) -> int:
        """Put archived records back at their positions in their files (see `records.put_back`)."""
        with self.locked():
            return self._insert(records, archived)

    def _delete(self, ids: Sequence[str]) -> int:
        wanted = set(map(str, ids))
        n = 0
        for path in self.files:
            if _format(path) == "parquet":
                table = _parquet(path)
                mask = pc.is_in(self._parquet_ids(table, path), pa.array(sorted(wanted), pa.string()))
                hits = pc.sum(mask).as_py() or 0
                if hits:
                    _write_parquet(path, table.filter(pc.invert(mask)))
            else:
                rf = _parse(path, self.fields["id"])
                kept = rec.without(rf, wanted)
                hits = len(rf.chunks) - len(kept.chunks)
                if hits:
                    _write_text(path, kept)
            n += hits
        return n

    def _set_fields(self, values: pa.Table) -> int:
        by_id = {str(r.pop("id")): r for r in values.to_pylist()}
        n = 0
        for path in self.files:
            if _format(path) == "parquet":
                n += self._set_parquet(path, values)
                continue
            rf = _parse(path, self.fields["id"])
            mine = {c.id: by_id[c.id] for _, c in rf.records() if c.id in by_id}
            if mine:
                _write_text(path, rec.set_fields(rf, mine))
                n += len(mine)
        return n

    def _set_parquet(self, path: Location, values: pa.Table) -> int:
        table = _parquet(path)
        pos = pc.index_in(self._parquet_ids(table, path), value_set=values.column("id").cast(pa.string()))
        hits = pc.sum(pc.is_valid(pos)).as_py() or 0
        if not hits:
            return 0
        for name in values.column_names:
            if name == "id":
                continue
            new = pc.take(values.column(name), pos)
            if name in table.column_names:
                old = table.column(name).cast(new.type)
                table = table.set_column(table.column_names.index(name), name, pc.if_else(pc.is_valid(pos), new, old))
            else:
                table = table.append_column(name, new)
        _write_parquet(path, table)
        return hits

    def _insert(self, records: pa.Table, archived: pa.Table | None = None) -> int:
        archived = records if archived is None else archived
        n = 0
        for file in sorted(set(records.column(FILE).to_pylist())):
            path = storage.location(file, "archived record's file")
            rows = records.filter(pc.equal(records.column(FILE), file))
            of_file = archived.filter(pc.equal(archived.column(FILE), file)) if FILE in archived.column_names else rows
            if _format(path) == "parquet":
                self._insert_parquet(path, rows, of_file)
            else:
                self._insert_text(path, rows, of_file)
            n += rows.num_rows
        return n

    def _absent(self, present: set[str], archived: pa.Table) -> set[int]:
        """Positions of the file's archived records that the file does not hold now."""
        ids = archived.column(self.fields["id"]).cast(pa.string()).to_pylist()
        return {p for i, p in zip(ids, archived.column(POSITION).to_pylist()) if i not in present}

    def _insert_text(self, path: Location, rows: pa.Table, archived: pa.Table) -> None:
        idcol = self.fields["id"]
        fmt = _format(path)
        columns = [c for c in rows.column_names if c not in (*DECISION_COLUMNS, *LOCATOR)]
        if path.exists():
            rf = _parse(path, idcol)
        else:  # the whole file went away: start it again (CSV: the header from the archive's columns)
            rf = rec.RecordFile(fmt, rec.serialise(fmt, columns, dict(zip(columns, columns))) if fmt == "csv" else "",
                                [], columns)
        ids = rows.column(idcol).cast(pa.string()).to_pylist()
        if RAW not in rows.column_names or POSITION not in rows.column_names:  # an archive from before positions
            chunks = [rec.Chunk(i, rec.serialise(fmt, rf.columns, r)) for i, r in zip(ids, rows.select(columns).to_pylist())]
            _write_text(path, rec.RecordFile(fmt, rf.head, [*rf.chunks, *chunks], rf.columns))
            return
        present = {c.id for _, c in rf.records()}
        restored = list(zip(rows.column(POSITION).to_pylist(), ids, rows.column(RAW).to_pylist()))
        _write_text(path, rec.put_back(rf, restored, self._absent(present, archived)))

    def _insert_parquet(self, path: Location, rows: pa.Table, archived: pa.Table) -> None:
        rows = rows.drop_columns([c for c in (*DECISION_COLUMNS, *LOCATOR) if c in rows.column_names and c != POSITION])
        if not path.exists():
            _write_parquet(path, rows.drop_columns([c for c in (POSITION,) if c in rows.column_names]))
            return
        table = _parquet(path)
        new = rows.drop_columns([POSITION]) if POSITION in rows.column_names else rows
        for f in table.schema:
            if f.name not in new.column_names:
                new = new.append_column(f.name, pa.nulls(new.num_rows, f.type))
        new = new.select(table.column_names).cast(table.schema)
        if POSITION not in rows.column_names:  # an archive from before positions: append
            _write_parquet(path, pa.concat_tables([table, new]))
            return
        present = set(self._parquet_ids(table, path).to_pylist())
        where = np.concatenate([_complement(table.num_rows, self._absent(present, archived)),
                                np.asarray(rows.column(POSITION).to_pylist(), np.int64)])
        _write_parquet(path, pa.concat_tables([table, new]).take(np.argsort(where, kind="stable")))


def _cell_text(value: Any) -> str | None:
    """A JSONL value as a readable archive cell (the exact record is in memprune_raw)."""
    if value is None or isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False)
