"""Parquet files of a `table` store: read through their filesystem (only the mapped columns; one group filtered by
the reader), rewritten whole with their own schema and compression codec."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from memprune.archive import DECISION_COLUMNS
from memprune.storage import Location
from memprune.stores.base import INTEGER, STRINGS, normalize
from memprune.stores.config import StoreError
from memprune.stores.tablefile import BATCH, LOCATOR, POSITION, TableFile, complement, register_format, replace


def _unreadable(path: Location, exc: Exception) -> StoreError:
    return StoreError(f"{path}: cannot read as parquet: {str(exc).splitlines()[0]}")


def _mapped(names: list[str], fields: dict[str, str]) -> list[str]:
    """The columns of `names` that `fields` maps (what a read needs: a Parquet read projects on them)."""
    return [c for c in dict.fromkeys(fields.values()) if c in names]


@register_format
class ParquetFile(TableFile):
    suffixes = (".parquet",)

    def _table(self) -> pa.Table:
        try:
            return pq.read_table(self.path.path, filesystem=self.path.fs)
        except (pa.ArrowInvalid, OSError) as exc:
            raise _unreadable(self.path, exc) from None

    def _file(self) -> pq.ParquetFile:
        return pq.ParquetFile(self.path.path, filesystem=self.path.fs)

    def _ids(self, table: pa.Table) -> pa.Array:
        name = self.fields["id"]
        if name not in table.column_names:
            raise StoreError(f"{self.path}: column {name!r} (mapped to id) missing")
        return pc.cast(table.column(name), pa.string())

    def _write(self, table: pa.Table) -> None:
        """Replace the file with `table` (its schema), in the file's own compression codec."""
        codec = "snappy"
        if self.path.exists():
            meta = self._file().metadata
            if meta.num_row_groups and meta.num_columns:
                codec = {"UNCOMPRESSED": "none", "LZ4_RAW": "lz4"}.get(meta.row_group(0).column(0).compression,
                                                                      meta.row_group(0).column(0).compression.lower())
        buffer = pa.BufferOutputStream()
        pq.write_table(table, buffer, compression=codec)
        replace(self.path, buffer.getvalue().to_pybytes())

    def columns(self, wanted: list[str]) -> list[str]:
        try:
            return self._file().schema_arrow.names
        except (pa.ArrowInvalid, OSError) as exc:
            raise _unreadable(self.path, exc) from None

    def batches(self) -> Iterator[pa.RecordBatch]:
        try:
            file = self._file()
            yield from file.iter_batches(batch_size=BATCH, columns=_mapped(file.schema_arrow.names, self.fields))
        except (pa.ArrowInvalid, OSError) as exc:
            raise _unreadable(self.path, exc) from None

    def group_batches(self, group: str) -> Iterator[pa.RecordBatch]:
        """Filtered by the reader (row groups whose statistics exclude the group are skipped) where the group column is
        text or integers."""
        import pyarrow.dataset as pads

        try:
            data = pads.dataset(self.path.path, format="parquet", filesystem=self.path.fs)
            column, columns = self.fields["group"], _mapped(data.schema.names, self.fields)
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
            raise _unreadable(self.path, exc) from None

    def fetch(self, wanted: set[str], group: str | None) -> pa.Table:
        table = self._table()
        mask = pc.is_in(self._ids(table), pa.array(sorted(wanted), pa.string()))
        got = table.filter(mask)
        return got.append_column(POSITION, pa.array(np.flatnonzero(mask.to_numpy(zero_copy_only=False)), pa.int64()))

    def current(self, group: str, expected: dict[str, str]) -> tuple[dict[str, str | None], Any]:
        table = self._table()
        rows = normalize(table, self.mapping, str(self.path))
        mine = pc.equal(rows.column("group"), group)
        ids, hashes = rows.column("id"), rows.column("hash")
        return dict(zip(ids.filter(mine).to_pylist(), hashes.filter(mine).to_pylist())), (table, ids, hashes, mine)

    def cut(self, state: Any, gone: dict[str, str], now: dict[str, str | None]) -> None:
        table, ids, hashes, mine = state
        if not gone:
            return
        decided = pc.take(pa.array(list(gone.values()), pa.string()), pc.index_in(ids, pa.array(list(gone), pa.string())))
        hit = pc.fill_null(pc.and_(mine, pc.equal(hashes, decided)), False)
        if pc.sum(hit).as_py():
            self._write(table.filter(pc.invert(hit)))

    def delete(self, wanted: set[str]) -> int:
        table = self._table()
        mask = pc.is_in(self._ids(table), pa.array(sorted(wanted), pa.string()))
        hits = pc.sum(mask).as_py() or 0
        if hits:
            self._write(table.filter(pc.invert(mask)))
        return hits

    def set_fields(self, by_id: dict[str, dict[str, Any]], values: pa.Table) -> int:
        table = self._table()
        pos = pc.index_in(self._ids(table), value_set=values.column("id").cast(pa.string()))
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
        self._write(table)
        return hits

    def insert(self, rows: pa.Table, archived: pa.Table) -> None:
        rows = rows.drop_columns([c for c in (*DECISION_COLUMNS, *LOCATOR) if c in rows.column_names and c != POSITION])
        if not self.path.exists():
            self._write(rows.drop_columns([c for c in (POSITION,) if c in rows.column_names]))
            return
        table = self._table()
        new = rows.drop_columns([POSITION]) if POSITION in rows.column_names else rows
        for f in table.schema:
            if f.name not in new.column_names:
                new = new.append_column(f.name, pa.nulls(new.num_rows, f.type))
        new = new.select(table.column_names).cast(table.schema)
        if POSITION not in rows.column_names:  # an archive from before positions: append
            self._write(pa.concat_tables([table, new]))
            return
        absent = self.absent(set(self._ids(table).to_pylist()), archived)
        where = np.concatenate([complement(table.num_rows, absent), np.asarray(rows.column(POSITION).to_pylist(), np.int64)])
        self._write(pa.concat_tables([table, new]).take(np.argsort(where, kind="stable")))
