"""Benchmark the live path on a big CSV/JSONL table store: one group decided and applied (`memprune.stores.group`).

`/v1/prune` and `PrunedMemory` open the store, read one group (`decide_group`) and, with apply, check it, archive
the dropped records and delete them (`apply_group`). This measures those three steps on one file of `--records`
memories (`mid`, `memory`, `user`, `created`; `--per-group` memories per user, so about records/per-group users),
as JSONL and as CSV, built once under `--out`. The decision is fixed and cheap (a user's newest `--keep`
memories kept, the rest dropped: `NewestPruner` below, no scorer), so the figures are the store's I/O, not the
encoder's. Each step runs `--repeat` times on a different user (median reported); the load average is printed.

    python bench/group_bench.py --records 100000 1000000 --out /tmp/group-bench

Run it with another checkout first on PYTHONPATH to measure that code (e.g. `git archive COMMIT | tar -x -C DIR`),
as the before/after of a change. Prints one line per store and step, and writes OUT/group_bench.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc


class NewestPruner:
    """Keep each group's newest `keep` records (by time, then id), drop the rest: a `TablePruner` with no model."""

    def __init__(self, keep: int) -> None:
        self.keep = keep

    def prune_table(self, table: pa.Table, group_by: str | None = None, pin_field: str | None = None) -> pa.Table:
        n = table.num_rows
        keep = [i >= n - self.keep for i in range(n)]  # `decide_group` hands the rows sorted by time, then id
        return (table.append_column("score", pa.array([1.0] * n, pa.float64()))
                .append_column("keep", pa.array(keep))
                .append_column("reason", pa.array([None if k else "top_k" for k in keep], pa.string()))
                .append_column("duplicate_of", pa.nulls(n, pa.string())))


def build(path: Path, fmt: str, records: int, per_group: int) -> None:
    """One file of `records` memories, user u{i // per_group}, in shuffled order (a group's lines spread out); CSV
    written by the csv module (a quarter of the texts hold a comma, so those are quoted), JSONL by json.dumps."""
    if path.exists():
        return
    import csv

    import numpy as np

    order = np.random.default_rng(0).permutation(records)
    tmp = path.with_suffix(path.suffix + ".part")
    with open(tmp, "w", encoding="utf-8", newline="") as fh:
        writer = csv.writer(fh, lineterminator="\n")
        if fmt == "csv":
            writer.writerow(["mid", "memory", "user", "created"])
        for i in order:
            again = ", again" if i % 4 == 0 else ""
            text = f"Memory {i}: the user mentioned item {i * 7919 % 100003}{again} on day {i % 365}."
            row = [f"m{i}", text, f"u{i // per_group}", f"2024-{1 + i % 12:02d}-{1 + i % 28:02d}T10:00:00"]
            if fmt == "csv":
                writer.writerow(row)
            else:
                fh.write(json.dumps(dict(zip(["mid", "memory", "user", "created"], row))) + "\n")
    os.replace(tmp, path)


def median_seconds(runs: list[float]) -> float:
    return round(statistics.median(runs), 3)


def bench_store(path: Path, repeat: int, keep: int, work: Path) -> dict[str, float | int]:
    from memprune.stores.base import open_store
    from memprune.stores.group import apply_group, decide_group

    mapping = {"id": "mid", "text": "memory", "group": "user", "time": "created"}
    opened, decided_s, applied, deleted = [], [], [], 0
    for r in range(repeat):
        group = f"u{17 + 101 * r}"
        t0 = time.perf_counter()
        store = open_store("table", str(path), mapping)
        t1 = time.perf_counter()
        decided = decide_group(store, group, NewestPruner(keep))
        t2 = time.perf_counter()
        done = apply_group(store, decided, work / f"archive-{path.suffix[1:]}-{r}")
        t3 = time.perf_counter()
        opened.append(t1 - t0)
        decided_s.append(t2 - t1)
        applied.append(t3 - t2)
        deleted += done["deleted"]
        assert decided.num_rows > keep and done["deleted"] == int(pc.sum(pc.invert(decided.column("keep"))).as_py())
    return {"open_s": median_seconds(opened), "decide_s": median_seconds(decided_s), "apply_s": median_seconds(applied),
            "deleted": deleted}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--records", type=int, nargs="+", default=[100_000])
    p.add_argument("--formats", nargs="+", default=["jsonl", "csv"], choices=["jsonl", "csv"])
    p.add_argument("--per-group", type=int, default=20)
    p.add_argument("--keep", type=int, default=5)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--out", type=Path, default=Path("runs/group-bench"))
    a = p.parse_args()
    import memprune

    a.out.mkdir(parents=True, exist_ok=True)
    results = []
    for n in a.records:
        for fmt in a.formats:
            source = a.out / f"mem-{n}.{fmt}"
            build(source, fmt, n, a.per_group)
            work = a.out / f"work-{n}-{fmt}-{os.getpid()}"
            shutil.rmtree(work, ignore_errors=True)
            work.mkdir()
            path = work / source.name
            shutil.copyfile(source, path)  # every run starts from the same file
            figures = bench_store(path, a.repeat, a.keep, work)
            row = {"records": n, "format": fmt, "bytes": source.stat().st_size, **figures,
                   "load_1m": round(os.getloadavg()[0], 2), "memprune": str(Path(memprune.__file__).parent)}
            results.append(row)
            print(f"{n:>8} {fmt:5} open {row['open_s']:7.3f} s  decide {row['decide_s']:7.3f} s  "
                  f"apply {row['apply_s']:7.3f} s  (median of {a.repeat}; load {row['load_1m']})", flush=True)
            shutil.rmtree(work, ignore_errors=True)
    (a.out / "group_bench.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
