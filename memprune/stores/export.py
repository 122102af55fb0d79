"""Read a store into memprune's bullets layout, partitioned on Ray Data, and fingerprint it.

1. normal form: each partition of the store (a Ray Data read task per partition, `StoreDatasource`;
   a store of one partition (a single file) and stores that allow one reader only, like a local Qdrant,
   stream on the driver) -> Parquet;
2. one streaming pass on the driver: rejects (counted, with their reasons), duplicate ids, the
   fingerprint (count + order-free sum of per-record hashes of id and text);
3. Ray Data: usable rows -> bullets columns (`bullet_id`=id, `conversation_id`=group, `time` (with
   `check_times`: the store's time in epoch seconds, null when empty: what retention and expiry read), `memprune_pin` (`--map pin=COL` as a boolean:
   the job's `rule.pin_field`), plus `memprune_time`, `memprune_hash`) -> sort by (group, time, id) ->
   Parquet for `memprune prune` (up to `sort_in_memory` rows one pyarrow sort on the driver, beyond that
   the Ray Data sort).

With `check_times` (the rule forgets or expires) every usable record's time must parse as
`memprune.prune.lifecycle` parses times; a pin value must be true/false/1/0 (or null). Either is one
`StoreError` naming the store, the record id and the column, raised before the prune job starts.

The sort makes groups contiguous (the prune job then streams) and makes the tie order (earlier
input position) the same whatever store the records came from.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from memprune.prune.lifecycle import TIME as BULLET_TIME, LifecycleError, epoch_seconds
from memprune.schema import BULLETS
from memprune.storage import Location, location
from memprune.stores.base import NORMAL, Store, bad_pin, pin_flags
from memprune.stores.config import StoreError

TIME, HASH, PIN = "memprune_time", "memprune_hash", "memprune_pin"
SORT_KEYS = ["conversation_id", TIME, "bullet_id"]
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")  # a time given as Unix seconds (a numeric column read as text)
STAGED = pa.schema([*BULLETS, pa.field(BULLET_TIME, pa.float64()), pa.field(PIN, pa.bool_()),
                    pa.field(TIME, pa.string()), pa.field(HASH, pa.string())])


def record_key(ids: list[str], hashes: list[str | None]) -> int:
    """Order-free sum (mod 2**64) of 64-bit digests of (id, text hash): the content part of a fingerprint."""
    total = 0
    for i, h in zip(ids, hashes):
        total += int.from_bytes(hashlib.blake2b(f"{i}\0{h or ''}".encode(), digest_size=8).digest(), "little")
    return total % 2**64


def fingerprint(count: int, key: int) -> str:
    """The store fingerprint: record count and the order-free content sum."""
    return f"{count}-{key:016x}"


def store_datasource(store: Store, parts: list[Callable[[], Iterator[pa.RecordBatch]]]) -> Any:
    """A Ray Data `Datasource` with one read task per partition of `store` (`parts`: its `partitions()`), in the
    normal form."""
    from ray.data.block import BlockMetadata
    from ray.data.datasource import Datasource, ReadTask

    def make(part: Callable[[], Iterator[pa.RecordBatch]]) -> Callable[[], Iterator[pa.Table]]:
        def read() -> Iterator[pa.Table]:
            for batch in part():
                yield pa.Table.from_batches([batch], schema=NORMAL)
        return read

    class StoreSource(Datasource):
        """The partitions of one memprune store, normalized (id, text, group, time, hash, reject)."""

        def get_name(self) -> str:
            return f"ReadStore[{store.kind}]"

        def estimate_inmemory_data_size(self) -> int | None:
            return None

        def get_read_tasks(self, parallelism: int, per_task_row_limit: int | None = None, data_context: Any = None) -> list[Any]:
            meta = BlockMetadata(num_rows=None, size_bytes=None, exec_stats=None, input_files=None)
            return [ReadTask(make(p), meta, schema=NORMAL) for p in parts]

    return StoreSource()


@dataclass
class Export:
    """A store read into the bullets layout: where, how many rows, rejects, fingerprint, timings."""

    bullets: Location
    records: int
    usable: int
    rejects: list[dict[str, Any]] = field(default_factory=list)
    rejected_without_id: int = 0
    fingerprint: str = ""
    timing: dict[str, float] = field(default_factory=dict)


def store_times(values: pa.Array | pa.ChunkedArray, column: str, ids: list[Any]) -> np.ndarray:
    """Normal-form times (text) as epoch seconds, NaN unknown (empty); numeric text is Unix seconds; a value that
    is not a time is a `LifecycleError` naming `column` and the record."""
    vals = [None if t is None or t == "" else float(t) if NUMBER.fullmatch(t) else t for t in values.to_pylist()]
    return epoch_seconds(vals, column, ids)


def to_bullets(batch: pa.Table, times: bool = False) -> pa.Table:
    """Usable normal-form rows as bullets columns (one session per group; no speaker, no evidence); with `times`
    the store's times as epoch seconds in `time` (checked by `check_lives` first), else `time` is null."""
    batch = batch.filter(pc.is_null(batch.column("reject")))
    n = batch.num_rows
    time = batch.column("time")
    own_time = (pa.array(store_times(time, "time", batch.column("id").to_pylist()), pa.float64(), from_pandas=True)
                if times else pa.nulls(n, pa.float64()))
    return pa.table([batch.column("id"), batch.column("group"), pa.array(np.zeros(n, np.int32)),
                     pa.array([""] * n, pa.string()), batch.column("text"),
                     pa.array([[] for _ in range(n)], pa.list_(pa.string())), own_time, pin_flags(batch.column("pin")),
                     time, batch.column("hash")], schema=STAGED)


def check_lives(store: Store, batch: pa.RecordBatch, check_times: bool) -> int:
    """Raise a `StoreError` for the first pin value that is not true/false, or (`check_times`) the first usable
    record's time that is not a time; returns how many records carry a pin value."""
    usable = batch.filter(pc.is_null(batch.column("reject")))
    if "pin" in store.fields:
        pins = usable.column("pin")
        bad = bad_pin(pins)
        if bad is not None:
            raise StoreError(f"{store.where}: record {usable.column('id')[bad].as_py()!r}: column "
                             f"{store.fields['pin']!r} (mapped to pin) is {pins[bad].as_py()!r}, not true/false; "
                             "nothing was changed")
    if check_times:
        try:
            store_times(usable.column("time"), store.fields["time"], usable.column("id").to_pylist())
        except LifecycleError as exc:
            raise StoreError(f"{store.where}: {exc}; nothing was changed") from None
    return len(batch) - batch.column("pin").null_count


def _parquet_files(directory: Location) -> list[Location]:
    return [directory / n for n in sorted(directory.files()) if n.endswith(".parquet") and "/" not in n]


def export(store: Store, work: str | os.PathLike[str] | Location, io_cpus: float = 0.1, sort_in_memory: int = 200_000,
           check_times: bool = False) -> Export:
    """Read `store` into `work/bullets/` (sorted bullets layout) with rejects and fingerprint; see the module doc.
    `work` is a local directory or a prefix on object storage (the Ray Data tasks write there directly)."""
    import ray

    work = location(work)
    work.delete()
    normal, bullets = work / "normal", work / "bullets"
    if work.local:  # object storage has no directories to make
        for d in (normal, bullets):
            d.fs.create_dir(d.path, recursive=True)
    timing: dict[str, float] = {}
    t0 = time.perf_counter()
    parts = store.partitions() if store.parallel else [store.read]
    if len(parts) > 1:  # one Ray Data read task per partition
        ray.data.read_datasource(store_datasource(store, parts), num_cpus=io_cpus).write_parquet(
            normal.path, filesystem=normal.fs, ray_remote_args={"num_cpus": io_cpus})
    else:  # one reader only, or one partition (a task would read it alone, after starting a worker): here
        with pq.ParquetWriter((normal / "part-00000.parquet").path, NORMAL, filesystem=normal.fs) as writer:
            for part in parts:
                for batch in part():
                    writer.write_batch(batch)
    timing["read_s"] = time.perf_counter() - t0
    t1 = time.perf_counter()
    files = _parquet_files(normal)
    count, usable, key, without_id = 0, 0, 0, 0
    rejects: list[dict[str, Any]] = []
    id_hashes: list[np.ndarray] = []
    pins = 0
    for f in files:
        columns = ["id", "hash", "reject", "group", "time", "pin"]
        for batch in pq.ParquetFile(f.path, filesystem=f.fs).iter_batches(columns=columns, batch_size=65_536):
            pins += check_lives(store, batch, check_times)
            ids, hashes, reject = batch.column(0).to_pylist(), batch.column(1).to_pylist(), batch.column(2).to_pylist()
            keep = [i is not None and i != "" for i in ids]
            without_id += len(ids) - sum(keep)
            kept_ids = [i for i, k in zip(ids, keep) if k]
            key = (key + record_key(kept_ids, [h for h, k in zip(hashes, keep) if k])) % 2**64
            count += len(kept_ids)
            id_hashes.append(pd.util.hash_array(np.asarray(kept_ids, dtype=object)))
            for i, r, g in zip(ids, reject, batch.column(3).to_pylist()):
                if r is not None:
                    rejects.append({"id": i, "group": g, "reason": r})
                else:
                    usable += 1
    hashes_all = np.concatenate(id_hashes) if id_hashes else np.zeros(0, np.uint64)
    uniq, counts = np.unique(hashes_all, return_counts=True)
    if (counts > 1).any():
        dup = set(uniq[counts > 1][:1].tolist())
        for f in files:
            ids = pq.read_table(f.path, columns=["id"], filesystem=f.fs).column(0).to_pylist()
            for i in ids:
                if i and int(pd.util.hash_array(np.asarray([i], dtype=object))[0]) in dup:
                    raise StoreError(f"{store.where}: duplicate id {i!r} (column {store.fields['id']!r}); "
                                     "every record needs its own id to get one decision")
    if "pin" in store.fields and store.schemaless and count and not pins:
        raise StoreError(f"{store.where}: --map pin={store.fields['pin']}: no record has the key "
                         f"{store.fields['pin']!r}; nothing was changed")
    timing["scan_s"] = time.perf_counter() - t1
    t2 = time.perf_counter()
    if usable and usable <= sort_in_memory:  # small enough: one driver-side sort beats a distributed one
        table = to_bullets(pa.concat_tables([pq.read_table(f.path, schema=NORMAL, filesystem=f.fs) for f in files]),
                           check_times)
        pq.write_table(table.sort_by([(k, "ascending") for k in SORT_KEYS]), (bullets / "part-00000.parquet").path,
                       filesystem=bullets.fs)
    elif usable:
        ds = ray.data.read_parquet(normal.path, filesystem=normal.fs, ray_remote_args={"num_cpus": io_cpus})
        ds = ds.map_batches(functools.partial(to_bullets, times=check_times), batch_format="pyarrow", batch_size=None,
                            num_cpus=io_cpus)
        ds.sort(SORT_KEYS).write_parquet(bullets.path, filesystem=bullets.fs, ray_remote_args={"num_cpus": io_cpus})
        _rename_in_order(bullets)
    else:
        pq.write_table(STAGED.empty_table(), (bullets / "part-00000.parquet").path, filesystem=bullets.fs)
    timing["sort_s"] = time.perf_counter() - t2
    return Export(bullets, count + without_id, usable, rejects, without_id, fingerprint(count, key), timing)


def _rename_in_order(directory: Location) -> None:
    """Ray writes sorted blocks under names that do not sort in block order; order files by their first key (renamed
    through the filesystem: a copy and a delete on object storage)."""
    firsts = []
    for p in _parquet_files(directory):
        t = pq.read_table(p.path, columns=SORT_KEYS, filesystem=p.fs)
        if t.num_rows == 0:
            p.delete()
            continue
        firsts.append((tuple(t.column(k)[0].as_py() for k in SORT_KEYS), p.name, p))
    for i, (_, _, p) in enumerate(sorted(firsts)):
        p.fs.move(p.path, (directory / f"part-{i:05d}.parquet").path)


def scan_current(store: Store, group: str | None = None) -> pa.Table:
    """(id, hash) of every record the store holds now (streamed on the driver), or of one `group`'s, for the apply
    check."""
    ids: list[pa.Array] = []
    hashes: list[pa.Array] = []
    for batch in store.read() if group is None else store.read_group(group):
        ok = pc.and_(pc.is_valid(batch.column(0)), pc.not_equal(pc.fill_null(batch.column(0), ""), ""))
        b = batch.filter(ok)
        ids.append(b.column(0))
        hashes.append(b.column(4))
    if not ids:
        return pa.table({"id": pa.array([], pa.string()), "hash": pa.array([], pa.string())})
    return pa.table({"id": pa.concat_arrays(ids), "hash": pa.concat_arrays(hashes)})
