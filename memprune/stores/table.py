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

Each file is a `memprune.stores.tablefile.TableFile` of its format (`table_parquet`, `table_text`); this module
finds the files, locks them and runs each operation over them.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from memprune import storage
from memprune.storage import Location
from memprune.stores import table_parquet, table_text  # noqa: F401  (the formats register themselves)
from memprune.stores.base import Partition, Store, register, unchanged
from memprune.stores.config import StoreError
from memprune.stores.tablefile import FILE, FILE_FORMATS, LOCATOR, POSITION, RAW, TableFile, table_file

__all__ = ["FILE", "LOCATOR", "POSITION", "RAW", "TableStore"]
LOCK_SUFFIX, LOCK_WAIT = ".memprune-lock", 120.0  # `.FILE.memprune-lock` beside each local file; seconds to wait


def _files(where: Location) -> list[Location]:
    """The store's files: the file itself, or the files of a known format below a directory (names starting with `.`
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
             if n.suffix.lower() in FILE_FORMATS and not any(part.startswith((".", "_")) for part in n.parts)]
    if not files:
        raise StoreError(f"{where}: no {', '.join(sorted(FILE_FORMATS))} files in this directory")
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


@register
class TableStore(Store):
    """Parquet / JSONL / CSV files with `--map id=...,text=...,group=...,time=...`."""

    kind = "table"

    def __init__(self, location: str, mapping: dict[str, str] | None = None) -> None:
        super().__init__(location, mapping)
        self._depth, self._fds = 0, []  # `locked`: how deep, and the lock files held
        self.files = _files(storage.location(location, "table store"))
        self.tables = [self._table(f) for f in self.files]
        required = [c for k, c in self.fields.items() if k not in self.optional]
        for t in self.tables:  # mapped columns checked up front, before any Ray task starts
            names = t.columns(required)
            if not names and t.may_lack_keys:
                continue  # no records, so no keys to check
            for field, col in self.fields.items():
                if col not in names and field not in self.optional:
                    raise StoreError(f"{t.path}: column {col!r} (mapped to {field}) missing; columns: {', '.join(names)}")

    def _table(self, path: Location) -> TableFile:
        return table_file(path, self.fields, self.mapping)

    def raw_partitions(self) -> list[Partition]:
        return [t.batches for t in self.tables]

    def raw_group(self, group: str) -> list[Partition]:
        return [(lambda t=t: t.group_batches(group)) for t in self.tables]

    def fetch(self, ids: Sequence[str]) -> pa.Table:
        """The whole records, each with its file, its position there and (CSV, JSONL) its exact text."""
        return self._fetch(set(map(str, ids)))

    def fetch_group(self, group: str, ids: Sequence[str]) -> pa.Table:
        """`fetch` of records of `group`: a CSV or JSONL file scanned for them alone (`records.scan`)."""
        return self._fetch(set(map(str, ids)), group)

    def _fetch(self, wanted: set[str], group: str | None = None) -> pa.Table:
        parts = []
        for t in self.tables:
            got = t.fetch(wanted, group)
            if got.num_rows:
                parts.append(got.append_column(FILE, pa.array([t.path.uri] * got.num_rows, pa.string())))
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
            now: dict[str, str | None] = {}
            seen = []
            for t in self.tables:
                hashes, state = t.current(group, expected)
                now.update(hashes)
                seen.append((t, state))
            todo, left = unchanged(now, expected)
            gone = {i: expected[i] for i in todo}
            for t, state in seen:
                t.cut(state, gone, now)
            return todo, left

    def delete(self, ids: Sequence[str]) -> int:
        wanted = set(map(str, ids))
        with self.locked():
            return sum(t.delete(wanted) for t in self.tables)

    def set_fields(self, values: pa.Table) -> int:
        by_id = {str(r.pop("id")): r for r in values.to_pylist()}
        with self.locked():
            return sum(t.set_fields(by_id, values) for t in self.tables)

    def insert(self, records: pa.Table, archived: pa.Table | None = None) -> int:
        """Put archived records back at their positions in their files (see `records.put_back`)."""
        archived = records if archived is None else archived
        n = 0
        with self.locked():
            for file in sorted(set(records.column(FILE).to_pylist())):
                rows = records.filter(pc.equal(records.column(FILE), file))
                of_file = archived.filter(pc.equal(archived.column(FILE), file)) if FILE in archived.column_names else rows
                self._table(storage.location(file, "archived record's file")).insert(rows, of_file)
                n += rows.num_rows
        return n
