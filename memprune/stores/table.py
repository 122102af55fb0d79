"""The `table` store: Parquet, JSONL or CSV files (or a directory of them) with a column mapping.

Each file is a partition. Writes rewrite a whole file atomically (temp file + rename), so a
crash leaves every file either old or new and a rerun finishes the rest. Archived records keep
the file they came from (`memprune_file`) so `restore` appends them to it again.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pcsv
import pyarrow.json as pjson
import pyarrow.parquet as pq

from memprune.archive import DECISION_COLUMNS, Archive, register_restorer
from memprune.io import atomic_path, jsonable
from memprune.stores.base import Partition, Store, register
from memprune.stores.config import StoreError

FORMATS = {".parquet": "parquet", ".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl", ".csv": "csv"}
FILE = "memprune_file"


def _format(path: Path) -> str:
    fmt = FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise StoreError(f"{path}: not a Parquet, JSONL or CSV file (suffix {path.suffix or 'none'})")
    return fmt


def read_file(path: Path) -> pa.Table:
    """One whole file of the table store as Arrow."""
    fmt = _format(path)
    try:
        if fmt == "parquet":
            return pq.read_table(path)
        if fmt == "jsonl":
            return pjson.read_json(path) if path.stat().st_size else pa.table({})
        return pcsv.read_csv(path)
    except (pa.ArrowInvalid, OSError) as exc:
        raise StoreError(f"{path}: cannot read as {fmt}: {str(exc).splitlines()[0]}") from None


def _columns(path: Path) -> list[str]:
    """The column names of a file (Parquet: its footer; CSV: its header; JSONL: the keys of its records)."""
    fmt = _format(path)
    try:
        if fmt == "parquet":
            return pq.ParquetFile(path).schema_arrow.names
        if fmt == "csv":
            return pcsv.open_csv(path).schema.names
    except (pa.ArrowInvalid, OSError) as exc:
        raise StoreError(f"{path}: cannot read as {fmt}: {str(exc).splitlines()[0]}") from None
    return read_file(path).column_names


def _batches(path: Path) -> Iterator[pa.RecordBatch]:
    """Stream a file's records (Parquet and CSV in batches; JSONL whole, as pyarrow reads it)."""
    fmt = _format(path)
    try:
        if fmt == "parquet":
            yield from pq.ParquetFile(path).iter_batches(batch_size=65_536)
        elif fmt == "csv":
            yield from pcsv.open_csv(path)
        else:
            yield from read_file(path).to_batches(max_chunksize=65_536)
    except (pa.ArrowInvalid, OSError) as exc:
        raise StoreError(f"{path}: cannot read as {fmt}: {str(exc).splitlines()[0]}") from None


def _write_file(path: Path, table: pa.Table) -> None:
    """Replace a file of the store with `table`, atomically, in the file's own format."""
    fmt = _format(path)
    with atomic_path(path) as tmp:
        if fmt == "parquet":
            pq.write_table(table, tmp)
        elif fmt == "csv":
            pcsv.write_csv(table, tmp)
        else:
            with open(tmp, "w", encoding="utf-8") as fh:
                for row in table.to_pylist():
                    fh.write(json.dumps(jsonable(row), ensure_ascii=False) + "\n")


@register
class TableStore(Store):
    """Parquet / JSONL / CSV files with `--map id=...,text=...,group=...,time=...`."""

    kind = "table"

    def __init__(self, location: str, mapping: dict[str, str] | None = None) -> None:
        super().__init__(location, mapping)
        p = Path(location)
        if p.is_file():
            self.files = [p]
        elif p.is_dir():
            self.files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in FORMATS
                                and not any(part.startswith((".", "_")) for part in f.relative_to(p).parts))
            if not self.files:
                raise StoreError(f"{p}: no Parquet, JSONL or CSV files in this directory")
        else:
            raise StoreError(f"table:{location}: no such file or directory")
        for f in self.files:  # mapped columns checked up front, before any Ray task starts
            names = _columns(f)
            for field, col in self.fields.items():
                if col not in names and not (field == "time" and "time" not in self.mapping["_given"]):
                    raise StoreError(f"{f}: column {col!r} (mapped to {field}) missing; columns: {', '.join(names)}")

    def raw_partitions(self) -> list[Partition]:
        return [(lambda f=f: _batches(f)) for f in self.files]

    def _id_column(self, table: pa.Table, path: Path) -> pa.Array:
        name = self.fields["id"]
        if name not in table.column_names:
            raise StoreError(f"{path}: column {name!r} (mapped to id) missing")
        return pc.cast(table.column(name), pa.string())

    def _rewrite(self, ids: Sequence[str], change) -> int:  # type: ignore[no-untyped-def]
        """Apply `change(table, mask)` to every file holding some of `ids`; returns the rows matched."""
        wanted = pa.array(sorted(set(map(str, ids))), pa.string())
        n = 0
        for path in self.files:
            table = read_file(path)
            mask = pc.is_in(self._id_column(table, path), wanted)
            hits = pc.sum(mask).as_py() or 0
            if hits:
                _write_file(path, change(table, mask))
                n += hits
        return n

    def fetch(self, ids: Sequence[str]) -> pa.Table:
        wanted = pa.array(sorted(set(map(str, ids))), pa.string())
        parts = []
        for path in self.files:
            table = read_file(path)
            got = table.filter(pc.is_in(self._id_column(table, path), wanted))
            if got.num_rows:
                parts.append(got.append_column(FILE, pa.array([str(path)] * got.num_rows, pa.string())))
        if not parts:
            return pa.table({self.fields["id"]: pa.array([], pa.string()), FILE: pa.array([], pa.string())})
        return pa.concat_tables(parts, promote_options="permissive")

    def delete(self, ids: Sequence[str]) -> int:
        return self._rewrite(ids, lambda t, mask: t.filter(pc.invert(mask)))

    def set_fields(self, values: pa.Table) -> int:
        ids = values.column("id").cast(pa.string())
        n = 0
        for path in self.files:
            table = read_file(path)
            own = self._id_column(table, path)
            pos = pc.index_in(own, value_set=ids)
            if not (pc.sum(pc.is_valid(pos)).as_py() or 0):
                continue
            for name in values.column_names:
                if name == "id":
                    continue
                new = pc.take(values.column(name), pos)
                if name in table.column_names:
                    old = table.column(name).cast(new.type)
                    new = pc.if_else(pc.is_valid(pos), new, old)
                    table = table.set_column(table.column_names.index(name), name, new)
                else:
                    table = table.append_column(name, new)
            _write_file(path, table)
            n += pc.sum(pc.is_valid(pos)).as_py() or 0
        return n

    def insert(self, records: pa.Table) -> int:
        n = 0
        drop = [c for c in (*DECISION_COLUMNS, FILE) if c in records.column_names]
        for file in sorted(set(records.column(FILE).to_pylist())):
            path = Path(file)
            rows = records.filter(pc.equal(records.column(FILE), file)).drop_columns(drop)
            if path.exists():
                table = read_file(path)
                if table.num_columns:
                    rows = rows.select([c for c in table.column_names if c in rows.column_names])
                    missing = [c for c in table.column_names if c not in rows.column_names]
                    for c in missing:
                        rows = rows.append_column(c, pa.nulls(rows.num_rows, table.schema.field(c).type))
                    rows = rows.select(table.column_names).cast(table.schema)
                    rows = pa.concat_tables([table, rows])
            _write_file(path, rows)
            n += records.filter(pc.equal(records.column(FILE), file)).num_rows
        return n


def restore_table(archive: Archive, options: dict) -> dict:  # type: ignore[type-arg]
    """The `table` restorer: append archived records to their files again (ids already there are skipped)."""
    from memprune.stores.restore import restore_into

    return restore_into(archive, options)


register_restorer("table", restore_table)
