"""One group of a store decided in-process, and applied with the audit archive: the live path.

The service's `/v1/prune` and the Mem0 integration prune one group (a Mem0 `user_id`) at a time, as
memories are written, without a Ray Data job. `decide_group` reads the group's usable records as the export
lays them out for `memprune prune` (times and pins through the store's mapping, ordered by time, then id) and
hands them to a pruner's `prune_table` (`MemoryPruner`'s: the batch job's decision, with the store's group as
the conversation and its pin column as the pin field; or the service client's). `apply_group`
writes every dropped record whole into an archive (`memprune.archive`, restorable with `memprune restore`)
before deleting it, as `memprune prune --apply` does; a record changed or removed by someone else since the
decision, also while the apply runs, is skipped and reported (`changed since the decision` / `removed since the
decision`), never deleted nor archived.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import pyarrow as pa
import pyarrow.compute as pc

from memprune.archive import write_archive
from memprune.decision import PruneRule
from memprune.prune.inputs import TIME as BULLET_TIME
from memprune.stores.apply import archive_records, diff
from memprune.stores.base import CHANGED, NORMAL, REMOVED, Store, text_hash
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
    table = group_table(store, group, times=rule is None or rule.needs_times)
    if table.num_rows == 0:
        return table
    return pruner.prune_table(table, group_by="conversation", pin_field=PIN if "pin" in store.fields else None)


def apply_group(store: Store, decided: pa.Table, archive_dir: str | Path,
                before_delete: Callable[[], None] | None = None) -> dict[str, Any]:
    """Archive the dropped records of a `decide_group` result whole into `archive_dir`, then delete them.

    Held under `store.locked()` from the check to the last delete (a table store: its lock files, so other
    replicas, processes and `restore` wait). A dropped record whose text changed since the decision, or that left
    the group, is not touched: it is in `skipped` (id, why: CHANGED or REMOVED), checked three times: before the
    archive (`apply.diff`: id and text hash, as `memprune prune --apply` checks a decision), on the fetched record
    that goes into the archive, and at the delete itself (`Store.delete_unchanged`: a table file re-read under the
    lock, a Lance delete conditional on id and text, a Mem0 memory re-read just before its delete).
    The archive is committed before the first delete and, when the delete left some, again with the deleted alone.
    `before_delete`: called once the archive is committed, before the first delete (tests step in here)."""
    dropped = (decided.filter(pc.invert(decided.column("keep"))) if "keep" in decided.column_names
               else decided.slice(0, 0))
    if dropped.num_rows == 0:
        return {"deleted": 0, "archive": None, "skipped": []}
    group = decided.column("conversation_id")[0].as_py()
    with store.locked():
        now = scan_current(store, group)
        _, changed, missing = diff(now, pa.table({"id": dropped.column("bullet_id"), "hash": dropped.column(HASH),
                                                  "keep": dropped.column("keep")}))
        stale = {**{i: REMOVED for i in missing.column("id").to_pylist()},
                 **{i: CHANGED for i in changed.column("id").to_pylist()}}
        dropped = dropped.filter(pc.invert(pc.is_in(dropped.column("bullet_id"), pa.array(list(stale), pa.string()))))
        records = None
        if dropped.num_rows:
            expected = dict(zip(dropped.column("bullet_id").to_pylist(), dropped.column(HASH).to_pylist()))
            dec = pa.table({"id": dropped.column("bullet_id"), "score": dropped.column("score"),
                            "reason": dropped.column("reason"), "duplicate_of": dropped.column("duplicate_of"),
                            **({"superseded_by": dropped.column("superseded_by")}
                               if "superseded_by" in dropped.column_names else {})})
            records = archive_records(store, dec, list(expected), group)
            text, idcol = store.fields["text"], store.fields["id"]
            ids = records.column(idcol).cast(pa.string()).to_pylist()
            moved = set(expected) - set(ids)  # removed between the check and the fetch
            stale |= dict.fromkeys(moved, REMOVED)
            if text in records.column_names:  # changed between the check and the fetch: not the decided record
                fetched = [None if t is None else text_hash(str(t)) for t in records.column(text).to_pylist()]
                changed_now = {i for i, h in zip(ids, fetched) if h != expected[i]}
                stale |= dict.fromkeys(changed_now, CHANGED)
                moved |= changed_now
            if moved:
                expected = {i: h for i, h in expected.items() if i not in moved}
                records = records.filter(pc.invert(pc.is_in(records.column(idcol).cast(pa.string()),
                                                             pa.array(sorted(moved), pa.string()))))
        if records is None or records.num_rows == 0:
            return {"deleted": 0, "archive": None, "skipped": _skipped(stale)}
        key = fingerprint(decided.num_rows, record_key(decided.column("bullet_id").to_pylist(),
                                                       decided.column(HASH).to_pylist()))
        write_archive(archive_dir, records, id_column=idcol, store=store.describe(), fingerprint=key)
        if before_delete is not None:
            before_delete()
        deleted, left = store.delete_unchanged(group, expected)
        if left:  # the archive holds what this apply deleted, not what another writer changed or removed meanwhile
            write_archive(archive_dir, records.filter(pc.is_in(records.column(idcol).cast(pa.string()),
                                                               pa.array(deleted, pa.string()))),
                          id_column=idcol, store=store.describe(), fingerprint=key)
    return {"deleted": len(deleted), "archive": str(archive_dir) if deleted else None,
            "skipped": _skipped({**stale, **left})}


def _skipped(stale: dict[str, str]) -> list[dict[str, str]]:
    return [{"id": i, "why": why} for i, why in stale.items()]


def review_group(directory: str | Path, decided: pa.Table, store: Store, pruner: TablePruner,
                 applied: dict[str, Any] | None = None) -> str:
    """`directory/review.html` for one group's decision (`decide_group`'s table; `applied`: `apply_group`'s result,
    None for a decision not applied): the service's `/v1/prune` with `review`, and `PrunedMemory.review`."""
    from memprune.review import Layout, write_review

    rule = rule_of(pruner)
    scorer = getattr(pruner, "scorer", None)
    group = decided.column("conversation_id")[0].as_py() if decided.num_rows else ""
    kept = sum(decided.column("keep").to_pylist()) if decided.num_rows else 0
    summary = {
        "rule": {**rule.model_dump(mode="json"), "description": rule.describe()} if rule is not None
        else {"description": "the service's rule"},
        "result": {"label": f"{store.fields['group']} {group}: {kept} of {decided.num_rows} kept"},
        "store": store.describe(), "dry_run": applied is None,
        "apply": applied if applied and applied.get("archive") else None,
        "scorer": {} if scorer is None else {"path": str(getattr(scorer, "source", "") or "in memory"),
                                             "encoder": scorer.config.encoder, "stage": scorer.config.stage,
                                             "seed": scorer.config.seed},
    }
    count = getattr(pruner, "count_tokens", None)
    layout = Layout("bullet_id", ("conversation_id",), pin=PIN if PIN in decided.column_names else None,
                    time=BULLET_TIME if BULLET_TIME in decided.column_names else None)
    return write_review(directory, decided, layout, summary, str(directory), count)
