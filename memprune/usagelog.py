"""Usage logs and times: the file format a live chatbot's memory-usage log has, read by two steps.

One event per (reply, memory item in its context): `bullet_id`, `used` (bool) or `weight` (float in
[0, 1]) and an optional `time`, in Parquet or JSON lines (a file, or a directory of them). The label
source `usage` (`memprune.label.sources.usage`) turns events into labels; pruning
(`memprune.prune.lifecycle`) counts a bullet's recalls and its last access from the same file. Both
read it here, so neither imports the other. `parse_time` is the one parser of a time value
(ISO 8601 text, a datetime, or Unix seconds).
"""

from __future__ import annotations

import datetime as dt
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from memprune.errors import MemPruneError
from memprune.rejects import Ledger

USAGE_EXTENSIONS: dict[str, str] = {".parquet": "parquet", ".pq": "parquet", ".jsonl": "jsonl", ".ndjson": "jsonl",
                                    ".json": "jsonl"}


class UsageLogError(MemPruneError):
    """A usage log that cannot be read at all (missing file, missing column); the message names file and field."""


def utc(value: dt.datetime) -> dt.datetime:
    """An aware UTC datetime (a naive one is taken as UTC)."""
    return value.replace(tzinfo=dt.timezone.utc) if value.tzinfo is None else value.astimezone(dt.timezone.utc)


def parse_time(value: Any) -> dt.datetime:
    """A time as aware UTC: ISO 8601 text ('Z' allowed), a datetime, or Unix seconds; else ValueError."""
    if isinstance(value, bool):
        raise ValueError("a boolean is not a time")
    if isinstance(value, dt.datetime):
        return utc(value)
    if isinstance(value, (int, float)):
        if not math.isfinite(value):
            raise ValueError("time is not finite")
        return dt.datetime.fromtimestamp(float(value), tz=dt.timezone.utc)
    if isinstance(value, str):
        text = value.strip()
        if text.endswith(("Z", "z")):
            text = text[:-1] + "+00:00"
        return utc(dt.datetime.fromisoformat(text))
    raise ValueError(f"time of type {type(value).__name__}")


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


def iter_events(file: Path, ledger: Ledger, error: type[Exception] = UsageLogError) -> Iterator[UsageEvent]:
    """The events of one log file (Parquet or JSON lines, by its suffix)."""
    if USAGE_EXTENSIONS[file.suffix.lower()] == "parquet":
        return iter_parquet(file, ledger, error=error)
    return iter_jsonl(file, ledger)


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
