"""`--apply`: change a store as a decision says, safely.

The decision (`OUT/decision.parquet`, `OUT/prune.json`) records each record's id and text hash
and the store's fingerprint. Apply first compares the store as it is now: any record added,
changed, or removed other than by this apply is a refusal (one line, nothing changed). In
`delete` mode every dropped record still in the store is written whole to `OUT/archive/` (one
committed archive, `memprune.archive`) before the first delete; deletes then run in batches.
A crash anywhere leaves a store that is the decision minus some archived dropped records,
which the check accepts, so a rerun finishes the deletes; once done, a rerun deletes nothing.
`flag` mode sets `memprune_keep` and `memprune_score` on every decided record (idempotent).
The whole apply holds `Store.locked()` (a local table store's lock files), so memprune's other writers wait.
"""

from __future__ import annotations

import os
import time
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from memprune.archive import DUPLICATE_OF, REASON, SCORE, SUPERSEDED_BY, read_archive, write_archive
from memprune.io import write_json
from memprune.storage import Location, location
from memprune.stores.base import Store, chunks
from memprune.stores.config import StoreError, StoreOptions
from memprune.stores.export import scan_current

ARCHIVE_DIR = "archive"


def diff(current: pa.Table, decision: pa.Table) -> tuple[pa.Table, pa.Table, pa.Table]:
    """(added ids, changed ids, missing decision rows) between the store now and the decision (both: id, hash;
    the decision also keep)."""
    dec = decision.select(["id", "hash", "keep"]).rename_columns(["id", "dhash", "keep"])
    joined = current.join(dec, "id", join_type="full outer")
    cur_ids = pc.is_in(joined.column("id"), current.column("id"))
    dec_ids = pc.is_in(joined.column("id"), decision.column("id"))
    added = joined.filter(pc.and_(cur_ids, pc.invert(dec_ids)))
    both = joined.filter(pc.and_(cur_ids, dec_ids))
    changed = both.filter(pc.invert(pc.fill_null(pc.equal(both.column("hash"), both.column("dhash")),
                                                 pc.and_(pc.is_null(both.column("hash")), pc.is_null(both.column("dhash"))))))
    missing = decision.filter(pc.invert(pc.is_in(decision.column("id"), current.column("id"))))
    return added, changed, missing


def apply_decision(store: Store, out: str | os.PathLike[str] | Location, summary: dict[str, Any],
                   options: StoreOptions) -> dict[str, Any]:
    """Apply the decision in `out` (a directory or a URI) to `store` (mode `options.apply`), holding `store.locked()`
    from the check to the last write; writes and returns `OUT/apply.json`."""
    with store.locked():
        return _apply_decision(store, out, summary, options)


def _apply_decision(store: Store, out: str | os.PathLike[str] | Location, summary: dict[str, Any],
                    options: StoreOptions) -> dict[str, Any]:
    started = time.perf_counter()
    mode = options.apply
    out = location(out)
    decision = pq.read_table((out / "decision.parquet").path, filesystem=out.fs)
    decided = decision.filter(pc.is_valid(decision.column("score")))
    current = scan_current(store)
    added, changed, missing = diff(current, decision)
    archive_dir = out / ARCHIVE_DIR
    dropped = decided.filter(pc.invert(decided.column("keep")))
    stray = missing.filter(pc.invert(pc.is_in(missing.column("id"), dropped.column("id"))))
    has_archive = (archive_dir / "archive.json").is_file()
    gone_ok = mode == "delete" and has_archive
    if added.num_rows or changed.num_rows or stray.num_rows or (missing.num_rows and not gone_ok):
        first = (added.column("id") if added.num_rows else changed.column("id") if changed.num_rows
                 else missing.column("id"))[0].as_py()
        raise StoreError(
            f"{store.where}: the store changed since the decision in {out} ({added.num_rows} added, {changed.num_rows} "
            f"changed, {missing.num_rows} removed record(s), e.g. id {first!r}); nothing was changed. Decide again: "
            f"`memprune prune` with a new --out")
    todo_ids = dropped.filter(pc.is_in(dropped.column("id"), current.column("id"))).column("id").to_pylist()
    result: dict[str, Any] = {"mode": mode, "store": store.describe(), "fingerprint": summary["store"]["fingerprint"],
                              "decided": decided.num_rows, "dropped": dropped.num_rows}
    if mode == "delete":
        if not has_archive:
            records = archive_records(store, dropped, todo_ids)
            write_archive(str(archive_dir), records, id_column=_id_column(store), store=store.describe(),
                          fingerprint=summary["store"]["fingerprint"])
        else:
            archive = read_archive(str(archive_dir)).records
            archived = set(archive.column(_id_column(store)).cast(pa.string()).to_pylist())
            lacking = [i for i in [*todo_ids, *missing.column("id").to_pylist()] if i not in archived]
            if lacking:
                raise StoreError(f"{archive_dir}: does not hold dropped record {lacking[0]!r}; this archive belongs to "
                                 "another decision; nothing was changed")
        deleted = 0
        for part in chunks(todo_ids, options.batch):
            deleted += store.delete(list(part))
        result |= {"deleted": len(todo_ids), "already_deleted": missing.num_rows, "archive": str(archive_dir),
                   "kept": decided.num_rows - dropped.num_rows}
    else:
        values = pa.table({"id": decided.column("id"), "memprune_keep": decided.column("keep"),
                           "memprune_score": decided.column("score")})
        flagged = 0
        for start in chunks(range(values.num_rows), options.batch):
            flagged += store.set_fields(values.slice(start[0], len(start)))
        result |= {"flagged": flagged, "flagged_drop": dropped.num_rows}
    result["seconds"] = round(time.perf_counter() - started, 3)
    write_json(out / "apply.json", result)
    return result


def _id_column(store: Store) -> str:
    return store.fields["id"]


def archive_records(store: Store, dropped: pa.Table, ids: list[str], group: str | None = None) -> pa.Table:
    """The whole records of `ids` from the store plus the decision columns the archive keeps (`dropped`: id, score,
    reason[, duplicate_of])); `group`: all of them are that group's (`Store.fetch_group`), and one the store no
    longer holds is left out (removed by someone else while a live apply runs), else it is an error."""
    parts = [store.fetch(list(part)) if group is None else store.fetch_group(group, list(part))
             for part in chunks(ids, 1024)]
    records = pa.concat_tables(parts, promote_options="permissive") if parts else store.fetch([])
    idcol = _id_column(store)
    if records.num_rows != len(ids) and group is None:
        raise StoreError(f"{store.where}: {len(ids)} dropped record(s) to archive, the store returned {records.num_rows}; "
                         "nothing was changed")
    pos = pc.index_in(records.column(idcol).cast(pa.string()), value_set=dropped.column("id"))
    def link(name: str) -> pa.ChunkedArray | pa.Array:  # duplicate_of / superseded_by (a decision may lack them)
        col = name.removeprefix("memprune_")
        return dropped.column(col) if col in dropped.column_names else pa.nulls(dropped.num_rows, pa.string())

    records = records.append_column(SCORE, pc.take(dropped.column("score"), pos))
    records = records.append_column(REASON, pc.take(dropped.column("reason"), pos))
    for name in (DUPLICATE_OF, SUPERSEDED_BY):
        records = records.append_column(name, pc.take(link(name).cast(pa.string()), pos))
    return records
