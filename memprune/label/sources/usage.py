"""source=usage: labels from a usage log (pure; no Ray, no models).

A usage log as a live chatbot records it: one event per (reply, memory item in its context) with
`bullet_id`, `used` (bool) or `weight` (float in [0, 1]) and an optional `time`. A bullet's label is
the max (default) or the mean of its event values. Events naming an unknown bullet, or with unusable
values, go to the rejects with the reason.
"""

from __future__ import annotations

import datetime as dt
import json
import math
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import pyarrow as pa
import pyarrow.parquet as pq

from memprune.io import JsonlSink
from memprune.label.errors import LabelError
from memprune.label.sources.common import (
    LabelSource,
    SourceError,
    SourceResult,
    SourceRun,
    label_counts,
    labels_table,
    register,
)
from memprune.rejects import Ledger
from memprune.work import file_digest

# Reasons a bullet gets no label from this source (listed in unlabelled.jsonl).
NO_USAGE_EVENTS = "no_usage_events"
NO_USAGE_FOR_CONVERSATION = "no_usage_for_conversation"
USAGE_UNLABELLED_REASONS: tuple[str, ...] = (NO_USAGE_EVENTS, NO_USAGE_FOR_CONVERSATION)

USAGE_EXTENSIONS: dict[str, str] = {".parquet": "parquet", ".pq": "parquet", ".jsonl": "jsonl", ".ndjson": "jsonl",
                                    ".json": "jsonl"}


@dataclass(frozen=True)
class UsageOptions:
    """How usage events become labels, and which events count (time window)."""

    aggregation: Literal["max", "mean"] = "max"
    missing: Literal["unlabelled", "zero"] = "unlabelled"
    since: dt.datetime | None = None
    until: dt.datetime | None = None

    def __post_init__(self) -> None:
        if self.aggregation not in ("max", "mean"):
            raise ValueError(f"usage aggregation must be max or mean, got {self.aggregation!r}")
        if self.missing not in ("unlabelled", "zero"):
            raise ValueError(f"usage missing must be unlabelled or zero, got {self.missing!r}")
        if self.since is not None and self.until is not None and _utc(self.since) > _utc(self.until):
            raise ValueError(f"usage window is empty: since {self.since} is after until {self.until}")

    def rule(self) -> str:
        """The `aggregation` string of the labels rows, e.g. 'usage:max'."""
        return f"usage:{self.aggregation}"


def _utc(value: dt.datetime) -> dt.datetime:
    """An aware UTC datetime (a naive one is taken as UTC)."""
    return value.replace(tzinfo=dt.timezone.utc) if value.tzinfo is None else value.astimezone(dt.timezone.utc)


def parse_time(value: Any) -> dt.datetime:
    """An event time as aware UTC: ISO 8601 text ('Z' allowed), a datetime, or Unix seconds; else ValueError."""
    if isinstance(value, bool):
        raise ValueError("a boolean is not a time")
    if isinstance(value, dt.datetime):
        return _utc(value)
    if isinstance(value, (int, float)):
        if not math.isfinite(value):
            raise ValueError("time is not finite")
        return dt.datetime.fromtimestamp(float(value), tz=dt.timezone.utc)
    if isinstance(value, str):
        text = value.strip()
        if text.endswith(("Z", "z")):
            text = text[:-1] + "+00:00"
        return _utc(dt.datetime.fromisoformat(text))
    raise ValueError(f"time of type {type(value).__name__}")


def usage_files(path: str | Path) -> list[Path]:
    """The log files of a usage log: the file itself, or the *.parquet / *.jsonl / *.ndjson / *.json files of a dir."""
    p = Path(path)
    if p.is_file():
        if p.suffix.lower() not in USAGE_EXTENSIONS:
            raise SourceError(f"{p}: unknown usage log format (use .parquet, .jsonl, .ndjson or .json lines)")
        return [p]
    if p.is_dir():
        files = sorted(f for f in p.iterdir() if f.is_file() and f.suffix.lower() in USAGE_EXTENSIONS)
        if not files:
            raise SourceError(f"{p}: directory holds no usage log file (*.parquet, *.jsonl, *.ndjson, *.json)")
        return files
    raise SourceError(f"{p}: usage log not found")


@dataclass
class UsageEvent:
    """One raw event as read: where it is (record), and its fields (None when absent)."""

    record: str
    bullet_id: Any
    used: Any
    weight: Any
    time: Any


def _iter_jsonl(path: Path, ledger: Ledger) -> Iterator[UsageEvent]:
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


def _iter_parquet(path: Path, ledger: Ledger, batch_rows: int = 65536) -> Iterator[UsageEvent]:
    """Events of a Parquet file, streamed by record batch; column types are checked once per file."""
    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowInvalid, OSError) as exc:
        raise SourceError(f"{path}: cannot read as Parquet: {exc}") from exc
    schema = pf.schema_arrow
    names = schema.names
    if "bullet_id" not in names:
        raise SourceError(f"{path}: usage log lacks column 'bullet_id'; has {names}")
    if "used" not in names and "weight" not in names:
        raise SourceError(f"{path}: usage log needs a 'used' (bool) or a 'weight' (float) column; has {names}")
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
            raise SourceError(f"{path}: usage log column {col!r} has type {schema.field(col).type}, expected {want}")
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


def _event_value(ev: UsageEvent) -> tuple[float | None, str, str]:
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


@dataclass
class UsageTotals:
    """Per-bullet running totals of the counted events."""

    n: int = 0
    total: float = 0.0
    best: float = 0.0


def read_usage_log(path: str | Path, bullet_conversation: dict[str, str], ledger: Ledger,
                   options: UsageOptions | None = None) -> tuple[dict[str, UsageTotals], dict[str, int]]:
    """Stream a usage log into per-bullet totals; unusable events go to `ledger` with the reason.

    `bullet_conversation` maps every known bullet id to its conversation. Rejected: a null or
    non-string `bullet_id`, a bullet id not in the corpus, a missing/invalid `used`/`weight`,
    an unparseable `time`, and (with a time window) an event without a time. Events outside
    the window are valid but not counted (`events_outside_window`). Returns the totals and
    counts, with `events = events_counted + events_outside_window + events_rejected`.
    """
    opt = options or UsageOptions()
    since = _utc(opt.since) if opt.since is not None else None
    until = _utc(opt.until) if opt.until is not None else None
    totals: dict[str, UsageTotals] = defaultdict(UsageTotals)
    counted = outside = 0
    conversations: set[str] = set()
    for file in usage_files(path):
        kind = USAGE_EXTENSIONS[file.suffix.lower()]
        events = _iter_parquet(file, ledger) if kind == "parquet" else _iter_jsonl(file, ledger)
        for ev in events:
            where = {"source": str(file), "record": ev.record, "kind": "usage_event"}
            bid = ev.bullet_id
            if not isinstance(bid, str) or not bid:
                ledger.reject(**where, field="bullet_id", reason="bullet_id is missing or not a string", value=bid)
                continue
            where["record"] = f"{ev.record} bullet_id={bid}"
            if bid not in bullet_conversation:
                ledger.reject(**where, field="bullet_id", reason="unknown bullet_id (not in bullets.parquet)", value=bid)
                continue
            value, fld, why = _event_value(ev)
            if value is None:
                ledger.reject(**where, field=fld, reason=why, value=ev.weight if fld == "weight" else ev.used)
                continue
            when = None
            if ev.time is not None:
                try:
                    when = parse_time(ev.time)
                except (ValueError, OverflowError, OSError):
                    ledger.reject(**where, field="time", reason="time is not ISO 8601, a timestamp or Unix seconds",
                                  value=ev.time)
                    continue
            if since is not None or until is not None:
                if when is None:
                    ledger.reject(**where, field="time", reason="no time, but a usage time window is set")
                    continue
                if (since is not None and when < since) or (until is not None and when > until):
                    outside += 1
                    ledger.wrote("usage_event")
                    continue
            t = totals[bid]
            t.n += 1
            t.total += value
            t.best = max(t.best, value)
            counted += 1
            conversations.add(bullet_conversation[bid])
            ledger.wrote("usage_event")
    counts = {
        "events": int(ledger.seen["usage_event"]),
        "events_counted": counted,
        "events_outside_window": outside,
        "events_rejected": int(ledger.rejected["usage_event"]),
        "conversations_in_log": len(conversations),
    }
    return dict(totals), counts


def usage_labels(bullets: pa.Table, totals: dict[str, UsageTotals], options: UsageOptions | None = None,
                 log_counts: dict[str, int] | None = None) -> SourceResult:
    """Labels from per-bullet usage totals: max (default) or mean of the counted event values.

    A bullet without counted events gets no label (`no_usage_events`); with `missing: zero`
    it is labelled 0 when its conversation appears in the log (the log then covers its
    replies), and stays unlabelled (`no_usage_for_conversation`) otherwise.
    """
    opt = options or UsageOptions()
    logged = {c for b, c in zip(bullets.column("bullet_id").to_pylist(), bullets.column("conversation_id").to_pylist())
              if b in totals}
    rows: list[dict[str, Any]] = []
    unlabelled: list[dict[str, Any]] = []
    for bid, cid in zip(bullets.column("bullet_id").to_pylist(), bullets.column("conversation_id").to_pylist()):
        t = totals.get(bid)
        if t is not None and t.n:
            value = t.best if opt.aggregation == "max" else t.total / t.n
            rows.append({"bullet_id": bid, "label": float(value), "n_pairs": t.n, "aggregation": opt.rule()})
        elif opt.missing == "zero" and cid in logged:
            rows.append({"bullet_id": bid, "label": 0.0, "n_pairs": 0, "aggregation": opt.rule()})
        else:
            reason = NO_USAGE_EVENTS if opt.missing == "unlabelled" else NO_USAGE_FOR_CONVERSATION
            unlabelled.append({"bullet_id": bid, "reason": reason, "n_pairs": 0, "n_errors": 0})
    labels = labels_table(rows, "usage")
    counts: dict[str, Any] = {
        **label_counts(bullets.num_rows, labels, unlabelled, USAGE_UNLABELLED_REASONS),
        "bullets_used": sum(1 for r in rows if r["label"] > 0),
        "bullets_zero_filled": sum(1 for r in rows if r["n_pairs"] == 0),
        **(log_counts or {}),
    }
    return SourceResult(labels, sorted(unlabelled, key=lambda u: u["bullet_id"]), counts)

def _check(settings: Any) -> None:
    if settings.usage.log is None:
        raise ValueError("source=usage needs the usage log: set `usage.log` (CLI: --usage-log)")


def run(cfg: Any, data: Path, bullets: pa.Table, inputs: dict[str, str], outputs: Any) -> SourceRun:
    """`memprune label --source usage`: the usage log's events -> labels; unusable events to OUT/rejects.jsonl."""
    u = cfg.usage
    assert u.log is not None  # checked by the config
    try:
        options_u = UsageOptions(aggregation=u.aggregation, missing=u.missing, since=u.since, until=u.until)
    except ValueError as exc:
        raise LabelError(str(exc)) from exc
    bullet_conv = dict(zip(bullets.column("bullet_id").to_pylist(), bullets.column("conversation_id").to_pylist()))
    with JsonlSink(outputs.path("rejects.jsonl")) as sink:
        ledger = Ledger(sink)
        files = usage_files(u.log)
        totals, log_counts = read_usage_log(u.log, bullet_conv, ledger, options_u)
    for f in files:
        inputs[f"usage:{f}"] = file_digest(f)
    result = usage_labels(bullets, totals, options_u, log_counts)
    ledger_summary = ledger.summary()
    rule = options_u.rule()
    return SourceRun(result, rule, ledger_summary)


USAGE = register(LabelSource(name="usage", description="a usage log: whether the replies of a live chatbot used the bullet",
                             check=_check, run=run))
