"""The store interface: records as Arrow batches with id, text, group (and time), partitioned; writes back.

Every store kind reads its raw records in partitions (`raw_partitions`: callables, each streaming
Arrow batches, picklable so a Ray Data read task can run one); `normalize` turns a raw batch into
the normal form every step uses (`NORMAL`): `id`, `text`, `group`, `time` (strings), `hash` (of the
text: what the apply fingerprint compares), `reject` (why a row cannot be used, else null) and `pin`
(with `--map pin=COL`: the column's value as text, `true`/`false`/`1`/`0`, null = not pinned; `pin_flags`
reads it; the export checks every value before any work).
Writes go through `fetch` (whole records for the archive), `delete`, `set_fields` and `insert`; the live path
(`memprune.stores.group`) holds `locked()` around its check and writes and deletes with `delete_unchanged`.
"""

from __future__ import annotations

import contextlib
import hashlib
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from memprune.archive import Archive, read_archive, register_restorer
from memprune.stores.config import FIELDS, StoreError

NORMAL = pa.schema([
    pa.field("id", pa.string()), pa.field("text", pa.string()), pa.field("group", pa.string()),
    pa.field("time", pa.string()), pa.field("hash", pa.string()), pa.field("reject", pa.string()),
    pa.field("pin", pa.string()),
])
PIN_TRUE, PIN_FALSE = ("true", "1"), ("false", "0", "")  # a pin value's text, lower-cased (null: not pinned)
INTEGER = re.compile(r"-?[0-9]+")  # a group that an integer group column can hold (`raw_group`)
KIND_NAME = re.compile(r"^[a-z][a-z0-9_-]*$")  # what a store kind may be called (`table`, `mem0`, ...)
STRINGS = (pa.types.is_string, pa.types.is_large_string, pa.types.is_string_view)
REJECT = "__memprune_reject"  # a raw batch's optional column: why its reader could not use a row (null: usable)
Partition = Callable[[], Iterator[pa.RecordBatch]]
CHANGED, REMOVED = "changed since the decision", "removed since the decision"  # why a dropped record was left


def text_hash(text: str) -> str:
    """16 hex digits of the SHA-256 of a record's text (the per-record part of the store fingerprint)."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def _as_string(col: pa.ChunkedArray | pa.Array, name: str, field: str, where: str, text_only: bool) -> pa.Array:
    """A column as `string`: string/large_string/string_view as they are; ids and times may also be numbers/dates,
    a pin a boolean or an integer."""
    t = col.type
    if any(f(t) for f in STRINGS):
        return pc.cast(col, pa.string())
    if pa.types.is_null(t):
        return pa.nulls(len(col), pa.string())
    if field == "pin":
        if pa.types.is_boolean(t) or pa.types.is_integer(t):
            return pc.cast(col, pa.string())
        raise StoreError(f"{where}: column {name!r} (mapped to pin) has type {t}; expected a boolean column")
    if not text_only and (pa.types.is_integer(t) or pa.types.is_temporal(t) or pa.types.is_floating(t)):
        return pc.cast(col, pa.string())
    raise StoreError(f"{where}: column {name!r} (mapped to {field}) has type {t}; expected a string column")


def normalize(batch: pa.RecordBatch | pa.Table, mapping: dict[str, str], where: str) -> pa.Table:
    """A raw batch in the normal form (`NORMAL`); a missing mapped column is an error naming it and `where`.

    Rows with a null or empty id or a null text get a `reject` reason (they are never decided nor
    touched), as do rows the reader names in a `REJECT` column; a null group becomes the empty group, a null time
    the empty time.
    """
    names = batch.schema.names
    cols: dict[str, pa.Array] = {}
    for field in FIELDS:
        name = mapping.get(field)
        if name is None:
            continue
        if name not in names:
            if field in mapping.get("_optional", "").split(","):
                continue  # the kind's default time column is optional
            raise StoreError(f"{where}: column {name!r} (mapped to {field}) missing; columns: {', '.join(names)}")
        col = batch.column(names.index(name))
        cols[field] = _as_string(col, name, field, where, text_only=field == "text")
    n = batch.num_rows
    ids = cols["id"]
    text = cols["text"]
    reject = np.full(n, None, dtype=object)
    bad_id = np.asarray(pc.fill_null(pc.equal(ids, ""), True), dtype=bool) if n else np.zeros(0, bool)
    bad_text = np.asarray(text.is_null(), dtype=bool) if n else np.zeros(0, bool)
    reject[bad_text] = f"text ({mapping['text']}) is null"
    reject[bad_id] = f"id ({mapping['id']}) is null or empty"
    if REJECT in names:  # the reader's own reasons (e.g. bytes that are not UTF-8) win
        hint = np.asarray(batch.column(names.index(REJECT)).to_pylist(), dtype=object)
        reject = np.where(hint != None, hint, reject)  # noqa: E711  (element-wise)
    texts = text.to_pylist()
    hashes = [None if t is None else text_hash(t) for t in texts]
    group = pc.fill_null(cols["group"], "") if "group" in cols else pa.array([""] * n, pa.string())
    time = pc.fill_null(cols["time"], "") if "time" in cols else pa.array([""] * n, pa.string())
    pin = cols["pin"] if "pin" in cols else pa.nulls(n, pa.string())
    return pa.table([ids, text, group, time, pa.array(hashes, pa.string()), pa.array(reject, pa.string()), pin],
                    schema=NORMAL)


def bad_pin(values: pa.Array | pa.ChunkedArray) -> int | None:
    """The position of the first pin value (normal-form text) that is not true/false/1/0, else None."""
    lowered = pc.utf8_lower(values)
    ok = pc.or_kleene(pc.is_null(values), pc.is_in(lowered, pa.array([*PIN_TRUE, *PIN_FALSE], pa.string())))
    bad = np.flatnonzero(~np.asarray(ok, dtype=bool))
    return int(bad[0]) if len(bad) else None


def pin_flags(values: pa.Array | pa.ChunkedArray) -> pa.Array:
    """The pinned flags of normal-form pin values (true/1, any case; null, false, 0 and empty: not pinned)."""
    flags = pc.fill_null(pc.is_in(pc.utf8_lower(values), pa.array(PIN_TRUE, pa.string())), False)
    return flags.combine_chunks() if isinstance(flags, pa.ChunkedArray) else flags


class Store(ABC):
    """One external memory store: read in partitions, and the four writes an apply and a restore need."""

    kind: ClassVar[str]
    defaults: ClassVar[dict[str, str]] = {"id": "id", "text": "text", "group": "group", "time": "time"}
    parallel: ClassVar[bool] = True  # partitions may be read by separate Ray tasks
    schemaless: ClassVar[bool] = False  # records may lack a mapped key (Mem0 metadata): checked after the read

    def __init__(self, location: str, mapping: dict[str, str] | None = None) -> None:
        self.location = location
        fields = {**self.defaults, **(mapping or {})}
        # A time column is optional under the kind's default name (also when a mapping read back names it).
        self.optional = {"time"} if fields["time"] == self.defaults["time"] else set()
        self.mapping = {**fields, "_optional": ",".join(sorted(self.optional))}

    @property
    def fields(self) -> dict[str, str]:
        """The column mapping in force (field -> store column)."""
        return {k: v for k, v in self.mapping.items() if not k.startswith("_")}

    def describe(self) -> dict[str, Any]:
        """What the archive manifest and the decision record about this store.

        `kind` picks the restorer; `provider` is the module that registers it, so `memprune.archive.restore`
        finds it in a fresh interpreter.
        """
        return {"kind": self.kind, "location": self.location, "map": self.fields, "provider": type(self).__module__}

    @abstractmethod
    def raw_partitions(self) -> list[Partition]:
        """Callables that each stream one partition's raw records as Arrow batches."""

    def raw_group(self, group: str) -> list[Partition] | None:
        """Callables streaming the raw records of one group only, filtered by the store itself (a Parquet or Lance
        filter, a Mem0 payload filter); None when the kind cannot filter (`read_group` then filters a whole read)."""
        return None

    def partitions(self) -> list[Partition]:
        """Callables that each stream one partition in the normal form."""
        return self._normal(self.raw_partitions())

    def _normal(self, parts: list[Partition]) -> list[Partition]:
        mapping, where = self.mapping, self.where

        def wrap(part: Partition) -> Partition:
            def read() -> Iterator[pa.RecordBatch]:
                for batch in part():
                    yield from normalize(batch, mapping, where).to_batches()
            return read
        return [wrap(p) for p in parts]

    def read(self) -> Iterator[pa.RecordBatch]:
        """Every record in the normal form, partition after partition (streaming)."""
        for part in self.partitions():
            yield from part()

    def read_group(self, group: str) -> Iterator[pa.RecordBatch]:
        """The records of `group` in the normal form; the store is asked for that group only where it can be."""
        parts = self.raw_group(group)
        for batch in self.read() if parts is None else (b for p in self._normal(parts) for b in p()):
            yield batch.filter(pc.equal(batch.column("group"), group))

    @property
    def where(self) -> str:
        """How errors name this store."""
        return f"{self.kind}:{self.location}"

    @abstractmethod
    def fetch(self, ids: Sequence[str]) -> pa.Table:
        """The whole records with `ids` (every column, metadata, vectors where the store has them)."""

    @abstractmethod
    def delete(self, ids: Sequence[str]) -> int:
        """Delete the records with `ids`; returns how many were deleted."""

    def locked(self) -> AbstractContextManager[None]:
        """Hold the store against memprune's other writers (other replicas, processes, `restore`) for a check and the
        writes that follow it; re-entrant. The default holds nothing: a kind without a lock of its own."""
        return contextlib.nullcontext()

    def fetch_group(self, group: str, ids: Sequence[str]) -> pa.Table:
        """`fetch` of `ids`, records of `group` (a kind may read that group alone to find them)."""
        return self.fetch(ids)

    def delete_unchanged(self, group: str, expected: dict[str, str]) -> tuple[list[str], dict[str, str]]:
        """Delete each record of `expected` (id -> its text hash as decided) that is still in `group` with that text,
        checked as late as the kind allows; returns (deleted ids, {id: CHANGED or REMOVED} for those left alone).

        The default reads the group again right before deleting (a kind with a conditional delete does better)."""
        now: dict[str, str | None] = {}
        for batch in self.read_group(group):
            now.update(zip(batch.column("id").to_pylist(), batch.column("hash").to_pylist()))
        todo, left = unchanged(now, expected)
        if todo:
            self.delete(todo)
        return todo, left

    @abstractmethod
    def set_fields(self, values: pa.Table) -> int:
        """Set columns/metadata (`values`: `id` + memprune_* columns) on the records with those ids."""

    @abstractmethod
    def insert(self, records: pa.Table, archived: pa.Table | None = None) -> int:
        """Put archived records (as `fetch` returned them) back; returns how many.

        `archived`: every record of the archive (a superset of `records`), for stores that put records
        back where they were (a table file's order).
        """

    def close(self) -> None:
        """Release the store (locks, clients)."""


def unchanged(now: dict[str, str | None], expected: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """(ids of `expected` whose hash `now` still has, {id: CHANGED/REMOVED} for the rest); `now`: id -> text hash of
    the group's records as the store holds them."""
    todo = [i for i, h in expected.items() if i in now and now[i] == h]
    left = {i: CHANGED if i in now else REMOVED for i, h in expected.items() if not (i in now and now[i] == h)}
    return todo, left


_KINDS: dict[str, type[Store]] = {}


def register(cls: type[Store]) -> type[Store]:
    """Class decorator: make a store kind openable by `open_store` and its archives restorable."""
    _KINDS[cls.kind] = cls
    register_restorer(cls.kind, restore_into)
    return cls


def restore_into(archive: Archive, options: dict[str, Any]) -> dict[str, Any]:
    """The restorer of every store kind: re-insert the archive's records that the store lacks (again: nothing)."""
    desc = archive.store
    store = open_store(desc["kind"], desc["location"], desc.get("map"))
    try:
        return restore_to(store, archive, int(options.get("batch", 256)))
    finally:
        store.close()


def restore_to(store: Store, archive: Archive, batch: int = 256) -> dict[str, Any]:
    """Re-insert into the open `store` the archive's records it lacks; the restorer's summary."""
    desc = archive.store
    records = archive.records
    ids = records.column(archive.id_column).cast(pa.string())
    present_tbl = store.fetch(ids.to_pylist()) if records.num_rows else None
    present = (pa.array([], pa.string()) if present_tbl is None or present_tbl.num_rows == 0 else
               present_tbl.column(archive.id_column).cast(pa.string()))
    todo = records.filter(pc.invert(pc.is_in(ids, present)))
    every = read_archive(archive.path).records  # where each archived record stood, also those not restored now
    restored = 0
    for start in chunks(range(todo.num_rows), batch):
        restored += store.insert(todo.slice(start[0], len(start)), every)
    return {"kind": desc["kind"], "location": desc["location"], "archive": str(archive.path),
            "restored": restored, "already_present": records.num_rows - todo.num_rows}


def kinds() -> list[str]:
    """The registered store kinds (`memprune.stores` registers its own when imported, a plugin by `@register`)."""
    return sorted(_KINDS)


def split_input(text: str) -> tuple[str, str] | None:
    """(kind, location) of a `KIND:LOCATION` store input; None for a bare path (memprune's own bullets table).

    An existing path, and a storage URI (`s3://...`, a bullets Parquet store on object storage), are bare paths;
    `foo:bar` with an unregistered kind `foo` is an error.
    """
    from memprune.storage import is_uri

    if is_uri(text) or Path(text).exists() or ":" not in text:
        return None
    kind, _, location = text.partition(":")
    if len(kind) == 1 or not KIND_NAME.match(kind):  # a drive letter, or a path with a colon: not a store kind
        return None
    if kind not in _KINDS:
        raise StoreError(f"--input {text}: unknown store kind {kind!r} (known: {', '.join(kinds())}; "
                         "or give a bullets Parquet path)")
    if not location:
        raise StoreError(f"--input {text}: the {kind} store needs a location after '{kind}:'")
    return kind, location


def open_store(kind: str, location: str, mapping: dict[str, str] | None = None) -> Store:
    """Open a store of `kind` at `location` with the column mapping."""
    if kind not in _KINDS:
        raise StoreError(f"unknown store kind {kind!r} (known: {', '.join(kinds())})")
    return _KINDS[kind](location, mapping)


def sql_in(column: str, ids: Sequence[str], numeric: bool) -> str:
    """A SQL `column IN (...)` predicate (strings quoted, quotes doubled)."""
    vals = ", ".join(str(int(i)) if numeric else "'" + str(i).replace("'", "''") + "'" for i in ids)
    return f"{column} IN ({vals})"


def chunks(items: Sequence[Any], n: int) -> Iterator[Sequence[Any]]:
    """`items` in slices of at most `n`."""
    for i in range(0, len(items), n):
        yield items[i:i + n]
