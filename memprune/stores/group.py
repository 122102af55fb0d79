"""One group of a store decided in-process, and applied with the audit archive: the live path.

The service's `/v1/prune` and the Mem0 integration prune one group (a Mem0 `user_id`) at a time, as
memories are written, without a Ray Data job. `decide_group` reads the group's usable records in the
export's order (time, then id) and hands them to a pruner's `prune_table` (`MemoryPruner`'s: the batch
job's decision, with the store's group as the conversation; or the service client's). `apply_group`
writes every dropped record whole into an archive (`memprune.archive`, restorable with `memprune restore`)
before deleting it, as `memprune prune --apply` does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import pyarrow as pa
import pyarrow.compute as pc

from memprune.archive import write_archive
from memprune.stores.apply import archive_records
from memprune.stores.base import Store, chunks
from memprune.stores.export import fingerprint, record_key


class TablePruner(Protocol):
    """What decides a bullets table: `MemoryPruner`, or the service's HTTP client."""

    def prune_table(self, table: pa.Table, group_by: str | None = None) -> pa.Table: ...


def group_table(store: Store, group: str) -> pa.Table:
    """The usable records of `group` as a small bullets table (bullet_id, text, conversation_id, hash), in the
    export's order."""
    parts = []
    for batch in store.read():
        keep = pc.and_(pc.equal(batch.column("group"), group), pc.is_null(batch.column("reject")))
        parts.append(pa.Table.from_batches([batch]).filter(keep))
    rows = pa.concat_tables(parts) if parts else pa.table({n: pa.array([], pa.string()) for n in
                                                          ("id", "text", "group", "time", "hash")})
    rows = rows.sort_by([("time", "ascending"), ("id", "ascending")])
    return pa.table({"bullet_id": rows.column("id"), "text": rows.column("text"),
                     "conversation_id": rows.column("group"), "hash": rows.column("hash")})


def decide_group(store: Store, group: str, pruner: TablePruner) -> pa.Table:
    """`group`'s records with score, keep, reason and duplicate_of; the group is the rule's whole group."""
    table = group_table(store, group)
    if table.num_rows == 0:
        return table
    return pruner.prune_table(table, group_by="conversation")


def apply_group(store: Store, decided: pa.Table, archive_dir: str | Path, batch: int = 256) -> dict[str, Any]:
    """Archive the dropped records of a `decide_group` result whole into `archive_dir`, then delete them."""
    dropped = (decided.filter(pc.invert(decided.column("keep"))) if "keep" in decided.column_names
               else decided.slice(0, 0))
    if dropped.num_rows == 0:
        return {"deleted": 0, "archive": None}
    ids = dropped.column("bullet_id").to_pylist()
    dec = pa.table({"id": dropped.column("bullet_id"), "score": dropped.column("score"),
                    "reason": dropped.column("reason"), "duplicate_of": dropped.column("duplicate_of"),
                    **({"superseded_by": dropped.column("superseded_by")}
                       if "superseded_by" in dropped.column_names else {})})
    records = archive_records(store, dec, ids)
    key = fingerprint(decided.num_rows, record_key(decided.column("bullet_id").to_pylist(),
                                                   decided.column("hash").to_pylist()))
    write_archive(archive_dir, records, id_column=store.fields["id"], store=store.describe(), fingerprint=key)
    for part in chunks(ids, batch):
        store.delete(list(part))
    return {"deleted": len(ids), "archive": str(archive_dir)}
