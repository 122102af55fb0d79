"""Putting archived records back into the store kind they came from (the restorers of `memprune.archive`)."""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from memprune.archive import Archive
from memprune.stores.base import chunks, open_store


def restore_into(archive: Archive, options: dict[str, Any]) -> dict[str, Any]:
    """Re-insert the archive's records that the store lacks (a second restore does nothing); returns counts."""
    desc = archive.store
    store = open_store(desc["kind"], desc["location"], desc.get("map"))
    try:
        records = archive.records
        ids = records.column(archive.id_column).cast(pa.string())
        present_tbl = store.fetch(ids.to_pylist()) if records.num_rows else None
        present = (pa.array([], pa.string()) if present_tbl is None or present_tbl.num_rows == 0 else
                   present_tbl.column(archive.id_column).cast(pa.string()))
        todo = records.filter(pc.invert(pc.is_in(ids, present)))
        batch = int(options.get("batch", 256))
        restored = 0
        for start in chunks(range(todo.num_rows), batch):
            restored += store.insert(todo.slice(start[0], len(start)))
    finally:
        store.close()
    return {"kind": desc["kind"], "location": desc["location"], "archive": str(archive.path),
            "restored": restored, "already_present": records.num_rows - todo.num_rows}
