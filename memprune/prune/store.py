"""The bullets store on disk: its Parquet files, their schema, the block plan, reading and writing back.

Before anything runs, the driver scans only the group-key columns of the input (a few MB per
million rows) and checks whether every group's rows are adjacent (contiguous). `ingest` and
`synth` write bullets session by session, so they are. The plan then cuts the store into
blocks of about `block_rows` rows *at group boundaries*, so that every block holds whole
groups and can be decided on its own. The output store is written to a temporary directory
and swapped into place, so a failed run never leaves half a store.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from memprune.io import check_committed
from memprune.decision import PruneError
from memprune.prune.scoring import HELPERS, OUTPUT_COLUMNS
from memprune.prune.stats import stable_hash
from memprune.schema import BULLETS, compatible
from memprune.storage import Location, location

REQUIRED = tuple(f.name for f in BULLETS)
NOT_NULL = tuple(f.name for f in BULLETS if not f.nullable)
STORE_DIR = "pruned"


@dataclass(frozen=True)
class StoreFile:
    """One Parquet file of the input store: path, rows, first global row, row-group offsets."""

    path: str
    num_rows: int
    offset: int
    row_group_starts: tuple[int, ...]


def parquet_file(path: str | os.PathLike[str] | Location) -> pq.ParquetFile:
    """A Parquet file of the store, local or on object storage (a path or a URI)."""
    loc = location(path)
    return pq.ParquetFile(loc.path) if loc.local else pq.ParquetFile(loc.fs.open_input_file(loc.path))


def read_parquet(path: str | os.PathLike[str] | Location, columns: list[str] | None = None) -> pa.Table:
    loc = location(path)
    return pq.read_table(loc.path, columns=columns, filesystem=loc.fs)


def store_ids(files: list[Any]) -> pa.ChunkedArray:
    """Every bullet id of the store's `files` (each with a `path`), in order, as strings."""
    return pa.chunked_array([c for f in files for c in read_parquet(f.path, columns=["bullet_id"])
                             .column(0).cast(pa.string()).chunks], pa.string())


def list_store_files(input: str | os.PathLike[str]) -> list[Any]:
    """The store's Parquet files: a file; a corpus dir's bullets.parquet; else every *.parquet in the dir, sorted.
    Local files come back as Paths, files on object storage as their URIs."""
    loc = location(input, "--input")
    if loc.local:
        p = Path(input) if not str(input).startswith("file://") else Path(loc.path)
        if p.is_file():
            return [p]
        if not p.exists():
            raise PruneError(f"{p}: no such file or directory")
        check_committed(p)  # a store directory another step wrote, e.g. OUT/pruned
        if (p / "bullets.parquet").is_file():
            return [p / "bullets.parquet"]
        files = sorted(f for f in p.rglob("*.parquet") if f.is_file() and not any(part.startswith((".", "_")) for part in f.relative_to(p).parts))
        if not files:
            raise PruneError(f"{p}: no Parquet files in this directory")
        return files
    loc.check_reachable()
    if loc.is_file():
        return [loc.uri]
    listing = loc.files()
    if not listing:
        raise PruneError(f"{loc}: no such object or prefix")
    check_committed(loc)
    if "bullets.parquet" in listing:
        return [str(loc / "bullets.parquet")]
    names = sorted(n for n in listing if n.endswith(".parquet") and not any(part.startswith((".", "_"))
                                                                            for part in n.split("/")))
    if not names:
        raise PruneError(f"{loc}: no Parquet files under this prefix")
    return [str(loc / n) for n in names]


def open_store(files: Sequence[Path], columns: list[str] | None) -> tuple[list[StoreFile], pa.Schema, list[str]]:
    """Check every file's footer and schema; return the files, the read schema and notes.

    The BULLETS columns must be present with their types (or a compatible encoding, e.g. the
    large_string of pandas, cast on read); all files must agree on the columns that are carried.
    Errors name the file and the column.
    """
    infos: list[StoreFile] = []
    read_schema: pa.Schema | None = None
    notes: list[str] = []
    offset = 0
    for path in files:
        check_committed(path)
        try:
            pf = parquet_file(path)
            schema = pf.schema_arrow
        except (pa.ArrowInvalid, OSError) as exc:
            raise PruneError(f"{path}: cannot read as Parquet: {exc}") from exc
        for f in BULLETS:
            if f.name not in schema.names:
                raise PruneError(f"{path}: column {f.name!r} missing (not a bullets table)")
            got = schema.field(f.name).type
            if not compatible(got, f.type):
                raise PruneError(f"{path}: column {f.name!r} has type {got}, expected {f.type}")
        wanted = list(REQUIRED) + [
            n for n in schema.names if n not in REQUIRED and n not in OUTPUT_COLUMNS and n not in HELPERS
            and (columns is None or n in columns)
        ]
        if columns is not None:
            absent = [c for c in columns if c not in schema.names]
            if absent:
                raise PruneError(f"{path}: column {absent[0]!r} (named in `columns`) missing")
        replaced = [n for n in OUTPUT_COLUMNS if n in schema.names]
        if replaced and not notes:
            notes.append(f"input already has {', '.join(replaced)}: replaced by this run's values")
        file_schema = pa.schema([BULLETS.field(n) if n in REQUIRED else schema.field(n) for n in wanted])
        if read_schema is None:
            read_schema = file_schema
        elif [(f.name, f.type) for f in file_schema] != [(f.name, f.type) for f in read_schema]:
            for a in read_schema:
                if a.name not in file_schema.names:
                    raise PruneError(f"{path}: column {a.name!r} missing (present in {files[0]})")
                if not file_schema.field(a.name).type.equals(a.type):
                    raise PruneError(f"{path}: column {a.name!r} has type {file_schema.field(a.name).type}, "
                                     f"but {a.type} in {files[0]}")
            extra = [n for n in file_schema.names if n not in read_schema.names]
            raise PruneError(f"{path}: column {extra[0]!r} is not in {files[0]} (all files must share the columns)")
        md = pf.metadata
        starts, acc = [], 0
        leaf = {md.schema.column(j).path: j for j in range(md.num_columns)}
        for i in range(md.num_row_groups):
            starts.append(acc)
            rg = md.row_group(i)
            for name in NOT_NULL:
                j = leaf.get(name)
                st = rg.column(j).statistics if j is not None else None
                if st is not None and st.has_null_count and st.null_count:
                    raise PruneError(f"{path}: column {name!r} has {st.null_count} null value(s) in rows "
                                     f"{acc}-{acc + rg.num_rows - 1} (a required column)")
            acc += rg.num_rows
        infos.append(StoreFile(str(path), md.num_rows, offset, tuple(starts)))
        offset += md.num_rows
    assert read_schema is not None
    return infos, read_schema, notes


@dataclass
class Plan:
    """Where the blocks of the store start and end, and whether groups are contiguous."""

    files: list[StoreFile]
    keys: tuple[str, ...]
    rows: int
    blocks: list[tuple[int, int]]
    contiguous: bool
    mode: Literal["contiguous", "shuffle"]
    runs: int
    reason: str
    scan_s: float = 0.0


def _check_items(column: pa.Array, path: str, first_row: int) -> None:
    """Refuse null items inside the evidence lists (the schema's lists hold turn ids, never nulls)."""
    items = pc.list_flatten(column)
    if items.null_count:
        parent = pc.list_parent_indices(column).to_numpy()
        at = first_row + int(parent[np.flatnonzero(items.is_null().to_numpy(zero_copy_only=False))[0]])
        raise PruneError(f"{path}: column 'evidence' has {items.null_count} null item(s) inside its lists, "
                         f"the first at row {at}")


def _check_unique_ids(files: Sequence[StoreFile], hashes: np.ndarray) -> None:
    """Refuse a store in which a bullet_id appears twice (the two rows would get conflicting decisions)."""
    uniq, counts = np.unique(hashes, return_counts=True)
    for h in uniq[counts > 1]:
        (fa, ra), (fb, rb) = (_locate(files, int(r)) for r in np.flatnonzero(hashes == h)[:2])
        ids = [read_parquet(f, columns=["bullet_id"]).column(0)[r].as_py() for f, r in ((fa, ra), (fb, rb))]
        if ids[0] == ids[1]:  # not a hash collision
            raise PruneError(f"{fa}: duplicate bullet_id {ids[0]!r} (row {ra}, again in {fb} row {rb}); "
                             "every bullet must have one id to get one decision")


def _key_values(batch: pa.RecordBatch, keys: Sequence[str]) -> list[np.ndarray]:
    return [batch.column(k).to_numpy(zero_copy_only=False) for k in keys]


def plan_store(
    files: Sequence[StoreFile], keys: Sequence[str], block_rows: int,
    grouping: Literal["auto", "contiguous", "shuffle"] = "auto", limit_rows: int | None = None,
) -> Plan:
    """Scan only the key columns (streaming): find group runs, check contiguity, cut blocks at group boundaries.

    A group is contiguous when its rows form one run. Runs are compared by a 64-bit hash
    of the key: a collision can only make the plan fall back to the shuffle (safe), never
    treat a split group as whole.
    """
    started = time.perf_counter()
    total = sum(f.num_rows for f in files)
    limit = total if limit_rows is None else min(limit_rows, total)
    run_starts: list[np.ndarray] = []
    run_hashes: list[np.ndarray] = []
    id_hashes: list[np.ndarray] = []
    prev: tuple[Any, ...] | None = None
    end = total  # first row not taken (limit rounded up to the end of a group)
    done = False
    for f in files:
        if done:
            break
        pf = parquet_file(f.path)
        row = f.offset
        try:
            batches = pf.iter_batches(columns=list(dict.fromkeys([*keys, "bullet_id", "evidence"])), batch_size=65_536)
            for batch in batches:
                _check_items(batch.column("evidence"), f.path, row - f.offset)
                id_hashes.append(pd.util.hash_array(batch.column("bullet_id").to_numpy(zero_copy_only=False)))
                vals = _key_values(batch, keys)
                n = batch.num_rows
                change = np.zeros(n, dtype=bool)
                for v in vals:
                    change[1:] |= v[1:] != v[:-1]
                first_key = tuple(v[0] for v in vals) if n else None
                if n:
                    change[0] = prev is None or first_key != prev
                idx = np.flatnonzero(change)
                if limit < total and row + n > limit:
                    beyond = idx[row + idx >= limit]
                    if len(beyond):  # the first run starting at/after the limit ends the plan
                        end = row + int(beyond[0])
                        idx = idx[idx < beyond[0]]
                        done = True
                run_starts.append(row + idx)
                run_hashes.append(np.fromiter((stable_hash(tuple(v[i] for v in vals)) for i in idx), dtype=np.int64, count=len(idx)))
                if n:
                    prev = tuple(v[n - 1] for v in vals)
                row += n
                if done:
                    break
        except (pa.ArrowInvalid, OSError) as exc:
            raise PruneError(f"{f.path}: cannot read the key columns {list(keys)}: {exc}") from exc
    starts = np.concatenate(run_starts) if run_starts else np.zeros(0, dtype=np.int64)
    hashes = np.concatenate(run_hashes) if run_hashes else np.zeros(0, dtype=np.int64)
    rows = end
    _check_unique_ids(files, np.concatenate(id_hashes)[:rows] if id_hashes else np.zeros(0, dtype=np.uint64))
    n_runs = len(starts)
    uniq, counts = np.unique(hashes, return_counts=True)
    contiguous = len(uniq) == n_runs
    if contiguous:
        reason = f"every group is one run of adjacent rows ({n_runs} groups)"
    else:
        dup = uniq[counts > 1][0]
        at = np.flatnonzero(hashes == dup)[:2]
        a, b = (_locate(files, int(starts[i])) for i in at)
        reason = (f"{len(hashes) - len(uniq)} group(s) are split into several runs, e.g. the group at {a[0]} row {a[1]} "
                  f"appears again at {b[0]} row {b[1]}")
    if grouping == "contiguous" and not contiguous:
        raise PruneError(f"grouping 'contiguous' requested but {reason}; use grouping auto or shuffle")
    mode: Literal["contiguous", "shuffle"] = "contiguous" if contiguous and grouping != "shuffle" else "shuffle"
    if mode == "shuffle" and contiguous:
        reason = "grouping 'shuffle' requested"
    blocks: list[tuple[int, int]] = []
    if rows:
        if mode == "contiguous":
            cut = 0
            for s in starts[1:]:
                if s - cut >= block_rows:
                    blocks.append((cut, int(s)))
                    cut = int(s)
            blocks.append((cut, rows))
        else:
            blocks = [(a, min(a + block_rows, rows)) for a in range(0, rows, block_rows)]
    return Plan(list(files), tuple(keys), rows, blocks, contiguous, mode, n_runs, reason,
                scan_s=time.perf_counter() - started)


def bytes_per_row(files: Sequence[StoreFile], columns: Sequence[str]) -> float:
    """Uncompressed bytes per row of `columns`, from the Parquet footers (no data read)."""
    total, rows = 0, 0
    wanted = set(columns)
    for f in files:
        md = parquet_file(f.path).metadata
        for i in range(md.num_row_groups):
            rg = md.row_group(i)
            rows += rg.num_rows
            for j in range(rg.num_columns):
                col = rg.column(j)
                if col.path_in_schema.split(".")[0] in wanted:
                    total += col.total_uncompressed_size
    return total / rows if rows else 0.0


def block_rows_for(block_rows: int, row_bytes: float, max_block_bytes: int) -> int:
    """`block_rows`, lowered so a block stays well under Ray Data's block size limit (a split would cut groups)."""
    if row_bytes <= 0:
        return block_rows
    return max(1, min(block_rows, int(max_block_bytes / 4 / row_bytes)))


def _locate(files: Sequence[StoreFile], row: int) -> tuple[str, int]:
    """(file path, row within the file) of a global row index."""
    for f in files:
        if f.offset <= row < f.offset + f.num_rows:
            return f.path, row - f.offset
    return files[-1].path, row - files[-1].offset


def read_rows(files: Sequence[StoreFile], start: int, stop: int, schema: pa.Schema) -> pa.Table:
    """Global rows [start, stop) of the store with the columns of `schema`; nulls in required columns raise."""
    parts: list[pa.Table] = []
    for f in files:
        a, b = max(start, f.offset), min(stop, f.offset + f.num_rows)
        if a >= b:
            continue
        la, lb = a - f.offset, b - f.offset
        rgs = [i for i, s in enumerate(f.row_group_starts)
               if s < lb and (f.row_group_starts[i + 1] if i + 1 < len(f.row_group_starts) else f.num_rows) > la]
        try:
            t = parquet_file(f.path).read_row_groups(rgs, columns=schema.names)
        except (pa.ArrowInvalid, OSError) as exc:
            raise PruneError(f"{f.path}: cannot read rows {la}-{lb - 1}: {exc}".replace("\n", " ")) from exc
        t = t.slice(la - f.row_group_starts[rgs[0]], lb - la)
        for name in NOT_NULL:
            nulls = t.column(name).null_count
            if nulls:
                i = int(np.flatnonzero(t.column(name).is_null().to_numpy(zero_copy_only=False))[0])
                raise PruneError(f"{f.path}: column {name!r} is null at row {la + i} ({nulls} null(s) in rows {la}-{lb - 1})")
        try:
            parts.append(t.select(schema.names).cast(schema))
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
            raise PruneError(f"{f.path}: rows {la}-{lb - 1} cannot be read as a bullets table: "
                             f"{str(exc).splitlines()[0]}") from None
    return pa.concat_tables(parts) if len(parts) > 1 else parts[0]



def finalize_files(tmp: Location) -> list[Location]:
    """Rename Ray's output files (sorted = write order = input order) to part-00000.parquet, ... (on object
    storage, where there is no rename: a server-side copy, then the original is deleted)."""
    names = sorted(n for n in tmp.files() if n.endswith(".parquet") and "/" not in n)
    out = []
    for i, name in enumerate(names):
        source, target = tmp / name, tmp / f"part-{i:05d}.parquet"
        if tmp.local:
            os.replace(source.path, target.path)
        elif name != target.name:
            source.copy_to(target)
            source.delete()
        out.append(target)
    return out


def read_pruned(out: str | os.PathLike[str]) -> pa.Table:
    """The pruned store written by `run_prune` into `out` (a directory or a URI; all part files, in order)."""
    store = location(out) / STORE_DIR
    names = sorted(n for n in store.files() if n.startswith("part-") and n.endswith(".parquet"))
    if not names:
        raise PruneError(f"{store}: no pruned store here")
    return pa.concat_tables([read_parquet(store / n) for n in names])