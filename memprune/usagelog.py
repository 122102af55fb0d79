"""Usage logs: the file format a live chatbot's memory-usage log has, read by two steps.

One event per (reply, memory item in its context): `bullet_id`, `used` (bool) or `weight` (float in
[0, 1]) and an optional `time`, in Parquet or JSON lines (a file, or a directory of them). The label
source `usage` (`memprune.label.sources.usage`) turns events into labels; pruning counts a bullet's recalls
and its last access from the same file (`read_usage` -> `Usage`, which the decision's inputs take). Both read it
here, so neither imports the other. Times are parsed by `memprune.times`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

import numpy as np

from memprune.errors import MemPruneError
from memprune.rejects import Ledger
from memprune.times import parse_time

USAGE_EXTENSIONS: dict[str, str] = {".parquet": "parquet", ".pq": "parquet", ".jsonl": "jsonl", ".ndjson": "jsonl",
                                    ".json": "jsonl"}


class UsageLogError(MemPruneError):
    """A usage log that cannot be read at all (missing file, missing column); the message names file and field."""


def usage_files(path: str | Path, error: type[Exception] = UsageLogError) -> list[Path]:
    """The log files of a usage log: the file itself, or the *.parquet / *.jsonl / *.ndjson / *.json files of a dir."""
    p = Path(path)
    if p.is_file():
        if p.suffix.lower() not in USAGE_EXTENSIONS:
            raise error(f"{p}: unknown usage log format (use .parquet, .jsonl, .ndjson or .json lines)")
        return [p]
    if p.is_dir():
        files = sorted(f for f in p.iterdir() if f.is_file() and f.suffix.lower() in USAGE_EXTENSIONS)
        if not files:
            raise error(f"{p}: directory holds no usage log file (*.parquet, *.jsonl, *.ndjson, *.json)")
        return files
    raise error(f"{p}: usage log not found")


@dataclass
class UsageEvent:
    """One raw event as read: where it is (record), and its fields (None when absent)."""

    record: str
    bullet_id: Any
    used: Any
    weight: Any
    time: Any


def iter_jsonl(path: Path, ledger: Ledger) -> Iterator[UsageEvent]:
    """Events of a JSON-lines file; a line that is not a JSON object is rejected (blank lines are skipped)."""
    with open(path, "rb") as fh:
        for n, raw in enumerate(fh, start=1):
            if not raw.strip():
                continue
            ledger.saw("usage_event")
            try:
                obj = json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError):
                ledger.reject(source=str(path), record=f"line {n}", field="<line>", kind="usage_event",
                              reason="not valid UTF-8 JSON", value=raw[:200].decode("utf-8", "replace"))
                continue
            if not isinstance(obj, dict):
                ledger.reject(source=str(path), record=f"line {n}", field="<line>", kind="usage_event",
                              reason=f"not a JSON object but {type(obj).__name__}", value=obj)
                continue
            yield UsageEvent(f"line {n}", obj.get("bullet_id"), obj.get("used"), obj.get("weight"), obj.get("time"))


def iter_parquet(path: Path, ledger: Ledger, batch_rows: int = 65536,
                 error: type[Exception] = UsageLogError) -> Iterator[UsageEvent]:
    """Events of a Parquet file, streamed by record batch; column types are checked once per file."""
    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowInvalid, OSError) as exc:
        raise error(f"{path}: cannot read as Parquet: {exc}") from exc
    schema = pf.schema_arrow
    names = schema.names
    if "bullet_id" not in names:
        raise error(f"{path}: usage log lacks column 'bullet_id'; has {names}")
    if "used" not in names and "weight" not in names:
        raise error(f"{path}: usage log needs a 'used' (bool) or a 'weight' (float) column; has {names}")
    checks = {
        "bullet_id": (pa.types.is_string(schema.field("bullet_id").type)
                      or pa.types.is_large_string(schema.field("bullet_id").type), "a string"),
    }
    if "used" in names:
        t = schema.field("used").type
        checks["used"] = (pa.types.is_boolean(t) or pa.types.is_integer(t), "boolean (or integer 0/1)")
    if "weight" in names:
        t = schema.field("weight").type
        checks["weight"] = (pa.types.is_floating(t) or pa.types.is_integer(t), "numeric")
    if "time" in names:
        t = schema.field("time").type
        checks["time"] = (pa.types.is_timestamp(t) or pa.types.is_string(t) or pa.types.is_large_string(t)
                          or pa.types.is_integer(t) or pa.types.is_floating(t),
                          "a timestamp, ISO 8601 string or Unix seconds")
    for col, (ok, want) in checks.items():
        if not ok:
            raise error(f"{path}: usage log column {col!r} has type {schema.field(col).type}, expected {want}")
    cols = [c for c in ("bullet_id", "used", "weight", "time") if c in names]
    row = 0
    for batch in pf.iter_batches(batch_size=batch_rows, columns=cols):
        data = {c: batch.column(c).to_pylist() for c in cols}
        n = batch.num_rows
        ledger.saw("usage_event", n)
        empty = [None] * n
        for i in range(n):
            yield UsageEvent(f"row {row + i}", data["bullet_id"][i], data.get("used", empty)[i],
                             data.get("weight", empty)[i], data.get("time", empty)[i])
        row += n


READERS = {"parquet": iter_parquet, "jsonl": lambda path, ledger, error=UsageLogError: iter_jsonl(path, ledger)}


def iter_events(file: Path, ledger: Ledger, error: type[Exception] = UsageLogError) -> Iterator[UsageEvent]:
    """The events of one log file (Parquet or JSON lines, by its suffix: `USAGE_EXTENSIONS` -> `READERS`)."""
    return READERS[USAGE_EXTENSIONS[file.suffix.lower()]](file, ledger, error=error)


def event_value(ev: UsageEvent) -> tuple[float | None, str, str]:
    """The event's value in [0, 1] (weight wins over used), or None with the field and reason."""
    if ev.weight is not None:
        w = ev.weight
        if isinstance(w, bool) or not isinstance(w, (int, float)):
            return None, "weight", "weight is not a number"
        if not math.isfinite(w) or not 0.0 <= w <= 1.0:
            return None, "weight", "weight outside [0, 1] or not finite"
        return float(w), "", ""
    if ev.used is not None:
        u = ev.used
        if isinstance(u, bool):
            return (1.0 if u else 0.0), "", ""
        if isinstance(u, int) and u in (0, 1):
            return float(u), "", ""
        return None, "used", "used is not true/false (or 0/1)"
    return None, "used", "neither 'used' nor 'weight' is given"


@dataclass(frozen=True)
class Usage:
    """Recalls and last access (epoch seconds, NaN unknown) per bullet id, from a usage log."""

    recalls: Mapping[str, int]
    last_access: Mapping[str, float]
    events: int = 0

    def lookup(self, ids: Sequence[Any]) -> tuple[np.ndarray, np.ndarray]:
        """(recalls, last access) of each id (0 and NaN for a bullet the log never recalled)."""
        n = len(ids)
        recalls = np.fromiter((self.recalls.get(i, 0) for i in ids), dtype=np.float64, count=n)
        last = np.fromiter((self.last_access.get(i, np.nan) for i in ids), dtype=np.float64, count=n)
        return recalls, last


class _Strict(Ledger):
    """A ledger for which any unusable event is an error (pruning on half a log would be a silent mistake)."""

    def reject(self, *, source: str, record: str, field: str, kind: str, reason: str, value: Any = None,
               lost: dict[str, int] | None = None) -> None:
        raise UsageLogError(f"{source}: {record}: {reason} ({field} = {value!r})")


def read_usage(path: str | Path, known: Any = None) -> Usage:
    """Recalls and last access per bullet from a usage log, for pruning.

    A recall is an event with `used` true or `weight` > 0; the last access is the latest `time` of a
    recall. `known` (a set of bullet ids) is the store: an id it does not hold, an event without a usable
    `bullet_id`/`used`/`weight`, or an unparseable time is a `UsageLogError` naming the file, line and id.
    `known` None: any id (a caller that sees part of a store, or a check of the log alone before any work).
    """
    recalls: dict[str, int] = {}
    last: dict[str, float] = {}
    events = 0
    for file in usage_files(path):
        for ev in iter_events(file, _Strict()):
            events += 1
            bid = ev.bullet_id
            where = f"{file}: {ev.record}"
            if not isinstance(bid, str) or not bid:
                raise UsageLogError(f"{where}: bullet_id is missing or not a string ({bid!r})")
            if known is not None and bid not in known:
                raise UsageLogError(f"{where}: unknown bullet_id {bid!r} (not in the store being pruned)")
            value, _, why = event_value(ev)
            if value is None:
                raise UsageLogError(f"{where} bullet_id={bid}: {why}")
            when = np.nan
            if ev.time is not None:
                try:
                    when = parse_time(ev.time).timestamp()
                except (ValueError, OverflowError, OSError):
                    raise UsageLogError(f"{where} bullet_id={bid}: time {ev.time!r} is not a time "
                                        "(ISO 8601, a timestamp or Unix seconds)") from None
            if value > 0:
                recalls[bid] = recalls.get(bid, 0) + 1
                if not math.isnan(when):
                    last[bid] = max(last.get(bid, -math.inf), when)
    return Usage(recalls, last, events)
