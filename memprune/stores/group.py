"""One group of a store decided in-process, and applied with the audit archive: the live path.

The service's `/v1/prune` and the Mem0 integration prune one group (a Mem0 `user_id`) at a time, as
memories are written, without a Ray Data job. `decide_group` reads the group's usable records as the export
lays them out for `memprune prune` (times and pins through the store's mapping, ordered by time, then id) and
hands them to a pruner's `prune_table` (`MemoryPruner`'s: the batch job's decision, with the store's group as
the conversation and its pin column as the pin field; or the service client's). `apply_group`
writes every dropped record whole into an archive (`memprune.archive`, restorable with `memprune restore`)
before deleting it, as `memprune prune --apply` does; a record changed or removed by someone else since the
decision is skipped and reported, never deleted.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import pyarrow as pa
import pyarrow.compute as pc

from memprune.archive import write_archive
from memprune.prune import PruneRule
from memprune.stores.apply import archive_records, diff
from memprune.stores.base import NORMAL, Store, chunks
from memprune.stores.config import StoreError
from memprune.stores.export import (HASH, PIN, SORT_KEYS, check_lives, fingerprint, record_key, scan_current,
                                     to_bullets)


class TablePruner(Protocol):
    """What decides a bullets table: `MemoryPruner`, or the service's HTTP client."""

    def prune_table(self, table: pa.Table, group_by: str | None = None, pin_field: str | None = None) -> pa.Table: ...


def rule_of(pruner: Any) -> PruneRule | None:
    """The rule `pruner` decides with (a `ServiceClient`'s as a `PruneRule`); None: the server's, unknown here."""
    rule = getattr(pruner, "rule", None)
    return PruneRule.of(**rule) if isinstance(rule, dict) else rule


def group_table(store: Store, group: str, times: bool = False) -> pa.Table:
    """The usable records of `group` in the export's bullets layout and order (`memprune prune`'s: the store's time
    and pin through its mapping; with `times` the time as epoch seconds, checked as the export checks it)."""
    rows = pa.Table.from_batches(list(store.read_group(group)), schema=NORMAL)
    check_lives(store, rows, times)
    return to_bullets(rows, times).sort_by([(k, "ascending") for k in SORT_KEYS])


def decide_group(store: Store, group: str, pruner: TablePruner) -> pa.Table:
    """`group`'s records with score, keep, reason and duplicate_of: the decision `memprune prune` makes on them
    (the group is the rule's whole group; the store's pin column pins)."""
    rule = rule_of(pruner)
    if rule is not None and rule.pin_field is not None:
        raise StoreError(f"rule.pin_field {rule.pin_field}: a store's pins are a column (Mem0: a metadata key) in its "
                         f"map: map pin={rule.pin_field}; nothing was changed")
    table = group_table(store, group, times=rule is None or rule.retention.on or rule.supersede.on)
    if table.num_rows == 0:
        return table
    return pruner.prune_table(table, group_by="conversation", pin_field=PIN if "pin" in store.fields else None)


def apply_group(store: Store, decided: pa.Table, archive_dir: str | Path, batch: int = 256) -> dict[str, Any]:
    """Archive the dropped records of a `decide_group` result whole into `archive_dir`, then delete them.

    A dropped record whose text changed since the decision, or that left the group, is not touched: it is in
    `skipped` (id, why), checked as `memprune prune --apply` checks a decision (`apply.diff`: id and text hash)."""
    dropped = (decided.filter(pc.invert(decided.column("keep"))) if "keep" in decided.column_names
               else decided.slice(0, 0))
    if dropped.num_rows == 0:
        return {"deleted": 0, "archive": None, "skipped": []}
    now = scan_current(store, decided.column("conversation_id")[0].as_py())
    _, changed, missing = diff(now, pa.table({"id": dropped.column("bullet_id"), "hash": dropped.column(HASH),
                                              "keep": dropped.column("keep")}))
    stale = {**{i: "removed since the decision" for i in missing.column("id").to_pylist()},
             **{i: "changed since the decision" for i in changed.column("id").to_pylist()}}
    dropped = dropped.filter(pc.invert(pc.is_in(dropped.column("bullet_id"), pa.array(list(stale), pa.string()))))
    skipped = [{"id": i, "why": why} for i, why in stale.items()]
    if dropped.num_rows == 0:
        return {"deleted": 0, "archive": None, "skipped": skipped}
    ids = dropped.column("bullet_id").to_pylist()
    dec = pa.table({"id": dropped.column("bullet_id"), "score": dropped.column("score"),
                    "reason": dropped.column("reason"), "duplicate_of": dropped.column("duplicate_of"),
                    **({"superseded_by": dropped.column("superseded_by")}
                       if "superseded_by" in dropped.column_names else {})})
    records = archive_records(store, dec, ids)
    key = fingerprint(decided.num_rows, record_key(decided.column("bullet_id").to_pylist(),
                                                   decided.column(HASH).to_pylist()))
    write_archive(archive_dir, records, id_column=store.fields["id"], store=store.describe(), fingerprint=key)
    for part in chunks(ids, batch):
        store.delete(list(part))
    return {"deleted": len(ids), "archive": str(archive_dir), "skipped": skipped}
