"""Resumable judging shards shared by the LLM-backed judges (pairwise, listwise, likelihood).

A shard covers the plan positions `[a, b)` (pairs in judging order) for every sample of the judge
and is one Parquet file under the label work dir (`WorkDir.piece`), written atomically when the
shard is finished. Its rows follow `JUDGED` (one per (sample, pos), sorted), and its schema
metadata carries the shard's cost counters (LLM calls, prompt and generated tokens, lists, ...),
so a reused shard still counts in `label.json`. A rerun trusts a shard only when it holds exactly
the expected rows; anything else is judged again.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from memprune.io import atomic_path
from memprune.work import WorkDir

STATS_KEY = b"memprune.shard_stats"

# One judged (sample, pair) row of a shard. `score` is in [0, 1] (null with `error`); the likelihood
# judge stores its raw `gain` instead and maps it later; listwise rows say where the bullet stood.
JUDGED = pa.schema(
    [
        pa.field("pos", pa.int64(), nullable=False),
        pa.field("sample", pa.int32(), nullable=False),
        pa.field("score", pa.float64()),
        pa.field("gain", pa.float64()),
        pa.field("error", pa.string()),
        pa.field("judge_mode", pa.string(), nullable=False),
        pa.field("attempts", pa.int32()),
        pa.field("tokens_in", pa.int64()),
        pa.field("tokens_out", pa.int64()),
        pa.field("raw", pa.string()),
        pa.field("list_position", pa.int32()),
        pa.field("list_size", pa.int32()),
        pa.field("order_scores", pa.list_(pa.float64())),
    ]
)

Compute = Callable[[int, int], tuple[pa.Table, dict[str, int]]]


def judged_table(rows: list[dict[str, Any]]) -> pa.Table:
    """`JUDGED` rows from dicts (missing keys are null), sorted by (sample, pos)."""
    table = pa.Table.from_pylist([{f.name: r.get(f.name) for f in JUDGED} for r in rows], schema=JUDGED)
    return table.sort_by([("sample", "ascending"), ("pos", "ascending")])


def expected_keys(a: int, b: int, samples: int) -> tuple[np.ndarray, np.ndarray]:
    """The (sample, pos) columns a finished shard of positions [a, b) holds, in order."""
    return np.repeat(np.arange(samples, dtype=np.int64), b - a), np.tile(np.arange(a, b, dtype=np.int64), samples)


def load_shard(path: Path, a: int, b: int, samples: int) -> tuple[pa.Table, dict[str, int]] | None:
    """A finished shard holding exactly positions [a, b) for every sample, with its counters; else None."""
    if not path.exists():
        return None
    try:
        table = pq.read_table(path)
    except (pa.ArrowInvalid, OSError):
        return None
    meta = table.schema.metadata or {}
    if STATS_KEY not in meta or table.num_rows != (b - a) * samples:
        return None
    table = table.replace_schema_metadata(None)
    if not table.schema.equals(JUDGED):
        return None
    want_sample, want_pos = expected_keys(a, b, samples)
    if not (np.array_equal(table.column("sample").to_numpy(), want_sample)
            and np.array_equal(table.column("pos").to_numpy(), want_pos)):
        return None
    return table, json.loads(meta[STATS_KEY])


def save_shard(path: Path, table: pa.Table, stats: dict[str, int]) -> None:
    """Write a shard atomically with its counters in the schema metadata."""
    with atomic_path(path) as tmp:
        pq.write_table(table.replace_schema_metadata({STATS_KEY: json.dumps(stats, sort_keys=True)}), tmp)


def run_shards(bounds: list[tuple[int, int]], samples: int, work: WorkDir, kind: str, compute: Compute,
               desc: str, progress: bool, setup: Callable[[], None] | None = None) -> tuple[pa.Table, dict[str, Any]]:
    """Judge the unfinished shards with `compute(a, b)`, each saved when done; return all rows and the counters.

    `compute` returns the shard's `JUDGED` rows (any order) and its counters; a shard that does not
    come back complete is an error that keeps the finished shards (a rerun resumes). The counters
    of every shard, reused or new, are summed into `stats["counters"]`.
    """
    from tqdm import tqdm

    paths = [work.piece(kind, i, "parquet") for i in range(len(bounds))]
    pending = [i for i, (a, b) in enumerate(bounds) if load_shard(paths[i], a, b, samples) is None]
    stats: dict[str, Any] = {"shards_total": len(bounds), "shards_reused": len(bounds) - len(pending)}
    t0 = time.perf_counter()
    judged = 0
    passes: list[list[float]] = []  # (judged rows, seconds) of each pass: --plan --measure fits start-up and rate
    if pending:
        if setup is not None:
            setup()
        bar = tqdm(total=sum(bounds[i][1] - bounds[i][0] for i in pending), desc=desc, unit="pair",
                   disable=not progress)
        for i in pending:
            a, b = bounds[i]
            started = time.perf_counter()
            table, counters = compute(a, b)
            passes.append([(b - a) * samples, time.perf_counter() - started])
            table = table.sort_by([("sample", "ascending"), ("pos", "ascending")])
            want_sample, want_pos = expected_keys(a, b, samples)
            if not (table.num_rows == len(want_pos)
                    and np.array_equal(table.column("sample").to_numpy(), want_sample)
                    and np.array_equal(table.column("pos").to_numpy(), want_pos)):
                raise RuntimeError(f"the judge returned {table.num_rows} rows for the {len(want_pos)} (sample, pair) "
                                   f"rows of shard {i}; finished shards are kept, rerun to retry")
            save_shard(paths[i], table, counters)
            work.keep(paths[i])
            judged += b - a
            bar.update(b - a)
        bar.close()
    stats["judge_s"] = time.perf_counter() - t0
    stats["pairs_judged"] = judged
    stats["passes"] = passes
    tables, totals = [], {}
    for i, (a, b) in enumerate(bounds):
        loaded = load_shard(paths[i], a, b, samples)
        if loaded is None:
            raise RuntimeError(f"{paths[i]}: shard missing or inconsistent after judging")
        tables.append(loaded[0])
        for key, value in loaded[1].items():
            totals[key] = totals.get(key, 0) + value
    stats["counters"] = dict(sorted(totals.items()))
    table = pa.concat_tables(tables) if tables else JUDGED.empty_table()
    return table.sort_by([("sample", "ascending"), ("pos", "ascending")]), stats


def sample_view(table: pa.Table, sample: int, n: int) -> pa.Table:
    """The rows of one sample, in plan order (positions 0..n-1)."""
    view = table.filter(pc.equal(table.column("sample"), sample))
    if view.num_rows != n:
        raise RuntimeError(f"sample {sample}: {view.num_rows} judged rows for {n} pairs")
    return view
