"""The `lance` store: a Lance dataset, e.g. a LanceDB table directory (`DB/NAME.lance`).

Each fragment is a partition (read on the driver, or by its own Ray Data task for a dataset past the export's
in-memory limit). Deletes and field updates are
Lance transactions (each one atomic, a new dataset version); restore appends the archived rows. The live path's
delete (`delete_unchanged`) is conditional: `id = X AND text = T` for each record still in its group with the
decided text, so a record another writer changes meanwhile (a Lance update writes a new row) is never deleted.
The location may be a storage URI (`lance:s3://b/mem.lance`): Lance reads it with its own client, given
the endpoint, region and keys of the standard environment (`memprune.storage.object_store_options`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from memprune.archive import DECISION_COLUMNS
from memprune.storage import object_store_options
from memprune.stores.base import (CHANGED, INTEGER, Partition, Store, chunks, normalize, register, sql_in,
                                  unchanged)
from memprune.stores.config import StoreError

IN_CHUNK = 1000
IF_CHUNK = 100  # records per conditional delete (each names its whole text)


def _open(location: str) -> Any:
    try:
        import lance
    except ImportError as exc:  # pragma: no cover - the stores extra installs it
        raise StoreError(f"lance:{location}: the lance store needs `pip install memprune[stores]` ({exc})") from None
    try:
        return lance.dataset(location, storage_options=object_store_options(location) or None)
    except Exception as exc:  # lance raises ValueError/OSError/its own errors for a missing or broken dataset
        raise StoreError(f"lance:{location}: cannot open as a Lance dataset: {str(exc).splitlines()[0]}") from None


def _literal(text: str) -> str:
    """A SQL string literal (quotes doubled)."""
    return "'" + text.replace("'", "''") + "'"


def _read_fragment(location: str, fragment_id: int, columns: list[str]) -> Iterator[pa.RecordBatch]:
    ds = _open(location)
    yield from ds.get_fragment(fragment_id).to_batches(columns=columns, batch_size=65_536)


@register
class LanceStore(Store):
    """A Lance dataset with `--map id=...,text=...,group=...,time=...`."""

    kind = "lance"

    def __init__(self, location: str, mapping: dict[str, str] | None = None) -> None:
        super().__init__(location, mapping)
        self.ds = _open(location)
        names = self.ds.schema.names
        for field, col in self.fields.items():
            if col not in names and field not in self.optional:
                raise StoreError(f"lance:{location}: column {col!r} (mapped to {field}) missing; columns: {', '.join(names)}")
        self.columns = [c for c in dict.fromkeys(self.fields.values()) if c in names]

    def _numeric_id(self) -> bool:
        return pa.types.is_integer(self.ds.schema.field(self.fields["id"]).type)

    def raw_partitions(self) -> list[Partition]:
        loc, cols = self.location, self.columns
        return [(lambda i=f.fragment_id: _read_fragment(loc, i, cols)) for f in self.ds.get_fragments()]

    def raw_group(self, group: str) -> list[Partition]:
        """One partition: the dataset scanned with the filter `GROUP = group` (Lance prunes fragments by it)."""
        column = self.fields["group"]
        numeric = pa.types.is_integer(self.ds.schema.field(column).type)
        if numeric and not INTEGER.fullmatch(group):
            return []  # no integer is this group
        loc, cols, where = self.location, self.columns, sql_in(column, [group], numeric)
        return [lambda: _open(loc).to_batches(columns=cols, filter=where, batch_size=65_536)]

    def fetch(self, ids: Sequence[str]) -> pa.Table:
        self.ds = _open(self.location)
        parts = [self.ds.to_table(filter=sql_in(self.fields["id"], part, self._numeric_id()))
                 for part in chunks(list(ids), IN_CHUNK)]
        return pa.concat_tables(parts) if parts else self.ds.schema.empty_table()

    def delete(self, ids: Sequence[str]) -> int:
        n = 0
        for part in chunks(list(ids), IN_CHUNK):
            self.ds = _open(self.location)
            res = self.ds.delete(sql_in(self.fields["id"], part, self._numeric_id()))
            n += int(getattr(res, "num_deleted_rows", len(part)) or 0)
        return n

    def delete_unchanged(self, group: str, expected: dict[str, str]) -> tuple[list[str], dict[str, str]]:
        """Per chunk: the records read at the latest version, then one delete whose predicate names each one still in
        `group` with the decided text by id AND text; Lance checks it against any version committed in between, so a
        record changed meanwhile is not deleted: it is CHANGED (read again when the delete removed fewer)."""
        idcol, textcol, numeric = self.fields["id"], self.fields["text"], self._numeric_id()
        deleted: list[str] = []
        left: dict[str, str] = {}
        for part in chunks(list(expected), IF_CHUNK):
            self.ds = _open(self.location)
            rows = normalize(self.ds.to_table(columns=self.columns, filter=sql_in(idcol, part, numeric)), self.mapping,
                             self.where)
            rows = rows.filter(pc.equal(rows.column("group"), group))
            now = dict(zip(rows.column("id").to_pylist(), rows.column("hash").to_pylist()))
            texts = dict(zip(rows.column("id").to_pylist(), rows.column("text").to_pylist()))
            todo, why = unchanged(now, {i: expected[i] for i in part})
            left |= why
            if not todo:
                continue
            where = " OR ".join(f"({sql_in(idcol, [i], numeric)} AND {textcol} = {_literal(texts[i])})" for i in todo)
            res = self.ds.delete(where)
            n = res.get("num_deleted_rows") if isinstance(res, dict) else getattr(res, "num_deleted_rows", None)
            if n is None or int(n) < len(todo):
                self.ds = _open(self.location)
                still = set(normalize(self.ds.to_table(columns=self.columns, filter=sql_in(idcol, todo, numeric)),
                                      self.mapping, self.where).column("id").to_pylist())
                left |= dict.fromkeys(still, CHANGED)
                todo = [i for i in todo if i not in still]
            deleted += todo
        self.ds = _open(self.location)
        return deleted, left

    def set_fields(self, values: pa.Table) -> int:
        self.ds = _open(self.location)
        idcol = self.fields["id"]
        new = [values.schema.field(c) for c in values.column_names if c != "id" and c not in self.ds.schema.names]
        if new:
            self.ds.add_columns(new)  # all-null columns, metadata only
            self.ds = _open(self.location)
        idtype = self.ds.schema.field(idcol).type
        source = values.rename_columns([idcol if c == "id" else c for c in values.column_names])
        source = source.set_column(0, idcol, pc.cast(source.column(idcol), idtype))
        for c in source.column_names[1:]:
            want = self.ds.schema.field(c).type
            source = source.set_column(source.column_names.index(c), c, pc.cast(source.column(c), want))
        self.ds.merge_insert(idcol).when_matched_update_all().execute(source)
        self.ds = _open(self.location)
        return values.num_rows

    def insert(self, records: pa.Table, archived: pa.Table | None = None) -> int:
        import lance

        self.ds = _open(self.location)
        rows = records.drop_columns([c for c in DECISION_COLUMNS if c in records.column_names])
        schema = self.ds.schema
        for f in schema:
            if f.name not in rows.column_names:
                rows = rows.append_column(f.name, pa.nulls(rows.num_rows, f.type))
        lance.write_dataset(rows.select(schema.names).cast(schema), self.location, mode="append",
                            storage_options=object_store_options(self.location) or None)
        self.ds = _open(self.location)
        return rows.num_rows
