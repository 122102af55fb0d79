"""Read a store into memprune's bullets layout and fingerprint it.

1. read: the store's partitions in the normal form, streamed on the driver, while the usable rows number at most
   `sort_in_memory` (200k): they are held in one in-memory table, with no copy written and read again and no Ray
   task to start. Past that many (a big store never has to fit in driver memory), the rows held are written to
   normal-form Parquet under `work/normal`, the partition being read goes on there, and the partitions left are
   read by Ray Data read tasks, one per partition (`StoreDatasource`; a store that allows one reader only, like a
   local Qdrant, and the last partition stream on the driver to the end);
2. the scan, on the driver as the batches come (the Parquet written by Ray's read tasks: after them): rejects (counted,
   with their reasons), duplicate ids, the fingerprint (count + order-free sum of per-record hashes of id and
   text), the pin and time checks;
3. usable rows -> bullets columns (`bullet_id`=id, `conversation_id`=group, `time` (with
   `check_times`: the store's time in epoch seconds, null when empty: what retention and expiry read), `memprune_pin` (`--map pin=COL` as a boolean:
   the job's `rule.pin_field`), plus `memprune_time`, `memprune_hash`) -> sort by (group, time, id) ->
   Parquet under `work/bullets` for `memprune prune` (held rows: one pyarrow sort on the driver; spilled: the Ray
   Data sort of the normal-form Parquet).

Either way the same records give the same bullets, rejects, fingerprint and errors.

With `check_times` (the rule forgets or expires) every usable record's time must parse as
`memprune.times` parses times; a pin value must be true/false/1/0 (or null). Either is one
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

from memprune.prune.inputs import TIME as BULLET_TIME
from memprune.times import TimeError, epoch_seconds
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
    spilled: bool = False  # more usable rows than `sort_in_memory`: read through normal-form Parquet, Ray Data sort


def store_times(values: pa.Array | pa.ChunkedArray, column: str, ids: list[Any]) -> np.ndarray:
    """Normal-form times (text) as epoch seconds, NaN unknown (empty); numeric text is Unix seconds; a value that
    is not a time is a `TimeError` naming `column` and the record."""
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
        except TimeError as exc:
            raise StoreError(f"{store.where}: {exc}; nothing was changed") from None
    return len(batch) - batch.column("pin").null_count


def _parquet_files(directory: Location) -> list[Location]:
    return [directory / n for n in sorted(directory.files()) if n.endswith(".parquet") and "/" not in n]


@dataclass
class _Scan:
    """The driver's pass over normal-form batches, in read order: rejects, duplicate ids, the fingerprint, pin and
    time checks (`check_lives`); `add` takes a batch with at least id, hash, reject, group, time and pin."""

    store: Store
    check_times: bool
    count: int = 0
    usable: int = 0
    key: int = 0
    without_id: int = 0
    pins: int = 0
    rejects: list[dict[str, Any]] = field(default_factory=list)
    id_hashes: list[np.ndarray] = field(default_factory=list)
    seconds: float = 0.0

    def add(self, batch: pa.RecordBatch | pa.Table) -> None:
        t0 = time.perf_counter()
        self.pins += check_lives(self.store, batch, self.check_times)
        ids, hashes = batch.column("id").to_pylist(), batch.column("hash").to_pylist()
        keep = [i is not None and i != "" for i in ids]
        self.without_id += len(ids) - sum(keep)
        kept_ids = [i for i, k in zip(ids, keep) if k]
        self.key = (self.key + record_key(kept_ids, [h for h, k in zip(hashes, keep) if k])) % 2**64
        self.count += len(kept_ids)
        self.id_hashes.append(pd.util.hash_array(np.asarray(kept_ids, dtype=object)))
        for i, r, g in zip(ids, batch.column("reject").to_pylist(), batch.column("group").to_pylist()):
            if r is not None:
                self.rejects.append({"id": i, "group": g, "reason": r})
            else:
                self.usable += 1
        self.seconds += time.perf_counter() - t0

    def finish(self, ids: Callable[[], Iterator[pa.Array | pa.ChunkedArray]]) -> None:
        """Raise a `StoreError` for a duplicate id (`ids`: every id column read again, to name it) or a pin key no
        record of a schemaless store has."""
        t0 = time.perf_counter()
        hashes_all = np.concatenate(self.id_hashes) if self.id_hashes else np.zeros(0, np.uint64)
        uniq, counts = np.unique(hashes_all, return_counts=True)
        if (counts > 1).any():
            dup = uniq[counts > 1][:1]
            for column in ids():
                named = [i for i in column.to_pylist() if i]
                hit = np.flatnonzero(np.isin(pd.util.hash_array(np.asarray(named, dtype=object)), dup))
                if len(hit):
                    raise StoreError(f"{self.store.where}: duplicate id {named[hit[0]]!r} (column "
                                     f"{self.store.fields['id']!r}); every record needs its own id to get one decision")
        if "pin" in self.store.fields and self.store.schemaless and self.count and not self.pins:
            raise StoreError(f"{self.store.where}: --map pin={self.store.fields['pin']}: no record has the key "
                             f"{self.store.fields['pin']!r}; nothing was changed")
        self.seconds += time.perf_counter() - t0


def export(store: Store, work: str | os.PathLike[str] | Location, io_cpus: float = 0.1, sort_in_memory: int = 200_000,
           check_times: bool = False) -> Export:
    """Read `store` into `work/bullets/` (sorted bullets layout) with rejects and fingerprint; see the module doc.
    `work` is a local directory or a prefix on object storage (the Ray Data tasks write there directly)."""
    work = location(work)
    work.delete()
    normal, bullets = work / "normal", work / "bullets"
    if work.local:  # object storage has no directories to make
        for d in (normal, bullets):
            d.fs.create_dir(d.path, recursive=True)
    timing: dict[str, float] = {}
    t0 = time.perf_counter()
    scan = _Scan(store, check_times)
    parts = store.partitions() if store.parallel else [store.read]
    held: list[pa.RecordBatch] | None = []  # the usable rows while they fit in memory (None: spilled)
    spill = normal / "part-driver.parquet"
    writer: pq.ParquetWriter | None = None
    rest: list[Callable[[], Iterator[pa.RecordBatch]]] = []
    for k, part in enumerate(parts):
        if writer is not None and len(parts) - k > 1:  # spilled: the partitions left go to Ray Data read tasks
            rest = parts[k:]
            break
        for batch in part():
            scan.add(batch)
            if writer is not None:
                writer.write_batch(batch)
                continue
            held.append(batch.filter(pc.is_null(batch.column("reject"))))
            if scan.usable > sort_in_memory:  # too many for the driver: spill what it holds, stream the rest
                writer = pq.ParquetWriter(spill.path, NORMAL, filesystem=spill.fs)
                for b in held:
                    writer.write_batch(b)
                held = None
    if writer is not None:
        writer.close()
    if rest:
        import ray

        ray.data.read_datasource(store_datasource(store, rest), num_cpus=io_cpus).write_parquet(
            normal.path, filesystem=normal.fs, ray_remote_args={"num_cpus": io_cpus})
    timing["read_s"] = time.perf_counter() - t0 - scan.seconds
    files = [f for f in _parquet_files(normal) if f.name != spill.name]  # what Ray Data wrote: not scanned yet
    for f in files:
        columns = ["id", "hash", "reject", "group", "time", "pin"]
        for batch in pq.ParquetFile(f.path, filesystem=f.fs).iter_batches(columns=columns, batch_size=65_536):
            scan.add(batch)
    if held is not None:
        rejected = pa.array([r["id"] for r in scan.rejects], pa.string())
        scan.finish(lambda: iter([*(b.column("id") for b in held), rejected]))
    else:
        scan.finish(lambda: (pq.read_table(f.path, columns=["id"], filesystem=f.fs).column(0)
                             for f in [spill, *files] if f.exists()))
    timing["scan_s"] = scan.seconds
    t2 = time.perf_counter()
    if held is not None and scan.usable:  # small enough: one driver-side sort beats a distributed one
        table = to_bullets(pa.Table.from_batches(held, schema=NORMAL), check_times)
        pq.write_table(table.sort_by([(k, "ascending") for k in SORT_KEYS]), (bullets / "part-00000.parquet").path,
                       filesystem=bullets.fs)
    elif scan.usable:
        import ray

        ds = ray.data.read_parquet(normal.path, filesystem=normal.fs, ray_remote_args={"num_cpus": io_cpus})
        ds = ds.map_batches(functools.partial(to_bullets, times=check_times), batch_format="pyarrow", batch_size=None,
                            num_cpus=io_cpus)
        ds.sort(SORT_KEYS).write_parquet(bullets.path, filesystem=bullets.fs, ray_remote_args={"num_cpus": io_cpus})
        _rename_in_order(bullets)
    else:
        pq.write_table(STAGED.empty_table(), (bullets / "part-00000.parquet").path, filesystem=bullets.fs)
    timing["sort_s"] = time.perf_counter() - t2
    return Export(bullets, scan.count + scan.without_id, scan.usable, scan.rejects, scan.without_id,
                  fingerprint(scan.count, scan.key), timing, spilled=held is None)


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
