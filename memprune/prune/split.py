"""`--emit split`: the kept bullets as their own store, the dropped ones as an archive; and restoring from it.

After a prune, `kept/` holds the kept bullets with exactly the input's columns (a store to use as
it is) and `dropped/` is a `memprune.archive` archive of the others, each with its score, reason,
`duplicate_of` and input position, under the run's fingerprint. `restore_bullets` (registered for
the archive store kind `bullets`) puts archived bullets back into a store, at their input positions
when the store is the kept store of that run (restoring everything gives back the input exactly).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from memprune.archive import (
    DECISION_COLUMNS,
    DUPLICATE_OF,
    SUPERSEDED_BY,
    REASON,
    SCORE,
    Archive,
    read_archive,
    register_restorer,
    write_archive,
)
from memprune.io import MARKER, check_committed, temp_name, write_json
from memprune.outputs import OutputSet
from memprune.decision import PruneError
from memprune.storage import is_uri

STORE_KIND = "bullets"
KEPT_DIR, DROPPED_DIR = "kept", "dropped"
POSITION = "memprune_position"


def input_positions(ids: pa.Array | pa.ChunkedArray, input_ids: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """The input row of each id in `ids` (every id must be in `input_ids`)."""
    pos = pc.index_in(ids, value_set=pa.chunked_array(input_ids).combine_chunks() if isinstance(input_ids, pa.ChunkedArray)
                      else input_ids)
    if pos.null_count:
        raise PruneError(f"{pos.null_count} bullet(s) of the pruned store are not in the input")
    return pos.to_numpy(zero_copy_only=False).astype(np.int64)


def write_split(pruned: pa.Table, input_ids: pa.ChunkedArray, columns: list[str], staging: Path, final: Path,
                fingerprint: str, store: dict[str, Any]) -> dict[str, Any]:
    """Write `kept/` (kept rows, input columns, input order) and the `dropped/` archive into `staging`."""
    order = np.argsort(input_positions(pruned.column("bullet_id"), input_ids), kind="stable")
    pruned = pruned.take(pa.array(order))
    positions = input_positions(pruned.column("bullet_id"), input_ids)
    keep = pruned.column("keep").to_numpy(zero_copy_only=False)
    kept = pruned.filter(pa.array(keep)).select(columns)
    with OutputSet(staging / KEPT_DIR, "prune-kept") as outputs:
        pq.write_table(kept, outputs.path("part-00000.parquet"))
    dropped = pruned.filter(pa.array(~keep))
    records = (dropped.select(columns)
               .append_column(SCORE, dropped.column("score"))
               .append_column(REASON, dropped.column("reason"))
               .append_column(DUPLICATE_OF, dropped.column("duplicate_of"))
               .append_column(SUPERSEDED_BY, dropped.column("superseded_by") if "superseded_by" in dropped.column_names
                              else pa.nulls(dropped.num_rows, pa.string()))
               .append_column(POSITION, pa.array(positions[~keep], pa.int64())))
    description = {"kind": STORE_KIND, "provider": __name__, **store, "kept": str(final / KEPT_DIR),
                   "rows": pruned.num_rows, "columns": columns}
    write_archive(staging / DROPPED_DIR, records, id_column="bullet_id", store=description, fingerprint=fingerprint)
    return {"kept": {"path": str(final / KEPT_DIR), "rows": kept.num_rows},
            "dropped": {"path": str(final / DROPPED_DIR), "rows": records.num_rows, "fingerprint": fingerprint}}


def _read_store(path: Path) -> pa.Table:
    files = sorted(path.glob("*.parquet"))
    if not files:
        raise PruneError(f"{path}: no Parquet files to restore into")
    for f in files:
        check_committed(f)
    return pa.concat_tables([pq.read_table(f) for f in files])


def _replace_store(path: Path, table: pa.Table) -> None:
    """Swap the store at `path` for one file holding `table`; refresh the size its parent's marker records."""
    with OutputSet(path.parent / temp_name(path.name), "restore") as outputs:
        pq.write_table(table, outputs.path("part-00000.parquet"))
    new = outputs.out
    old = path.parent / temp_name(path.name + "-old")
    os.replace(path, old)
    os.replace(new, path)
    shutil.rmtree(old, ignore_errors=True)
    marker = path.parent / MARKER
    if marker.is_file():  # the directory is an output of a step: record its new size, so readers accept it
        import json

        info = json.loads(marker.read_text(encoding="utf-8"))
        if isinstance(info.get("files"), dict) and path.name in info["files"]:
            info["files"][path.name] = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
            write_json(marker, info)


def restore_bullets(archive: Archive, options: dict[str, Any]) -> dict[str, Any]:
    """Put archived bullets back into a bullets store (`into`, default the run's kept store).

    Rows go to their input positions when the store holds exactly the run's other rows (the kept
    store, possibly after earlier restores); else they are appended. Ids already present are skipped.
    """
    store = archive.store
    where = str(options.get("into") or store["kept"])
    if is_uri(where):
        raise PruneError(f"{where}: a bullets store on object storage cannot be restored into in place; copy it to a "
                         "local directory and give that as --into")
    target = Path(where)
    if not target.is_dir():
        raise PruneError(f"{target}: no such store directory to restore into")
    current = _read_store(target)
    columns = list(store["columns"])
    missing = [c for c in columns if c not in current.column_names]
    if missing:
        raise PruneError(f"{target}: column {missing[0]!r} of the archived bullets is missing in this store")
    present = set(current.column("bullet_id").to_pylist())
    ids = archive.records.column("bullet_id").to_pylist()
    new = archive.records.filter(pa.array([i not in present for i in ids], pa.bool_()))
    full = read_archive(archive.path)
    absent_all = full.records.filter(pa.array([i not in present for i in full.records.column("bullet_id").to_pylist()],
                                              pa.bool_()))
    restored = new.select(columns).cast(current.select(columns).schema)
    merged = pa.concat_tables([current, restored], promote_options="default")  # other columns of the store: null
    in_order = current.num_rows == store["rows"] - absent_all.num_rows and POSITION in full.records.column_names
    if in_order:
        holes = absent_all.column(POSITION).to_numpy()
        current_pos = np.setdiff1d(np.arange(store["rows"]), holes, assume_unique=True)
        pos = np.concatenate([current_pos, new.column(POSITION).to_numpy()])
        merged = merged.take(pa.array(np.argsort(pos, kind="stable")))
    _replace_store(target, merged)
    return {"store": str(target), "restored": new.num_rows, "already_present": archive.records.num_rows - new.num_rows,
            "rows": merged.num_rows, "placement": "input positions" if in_order else "appended",
            "fingerprint": archive.manifest["fingerprint"], "decision_columns": list(DECISION_COLUMNS)}


register_restorer(STORE_KIND, restore_bullets)
