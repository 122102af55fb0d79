"""Label sources beyond the judge: QA evidence and usage logs (pure; no Ray, no models).

The scorer can only be as good as its labels. Besides the judges of `memprune.label`
(source `judge`), two sources derive a bullet's label from what was *really* needed later:

- `qa`: a corpus annotated with question evidence (LoCoMo's `qa` table). A QA item *cites*
  a bullet when one of its evidence turns is among the bullet's evidence turns. The label
  is 1 when at least one question cites the bullet, else 0 (`grading: binary`), or
  min(1, n_citing / grade_cap) (`grading: graded`). With `later_only`, a citing question
  counts only when its evidence also names a turn of a session *after* the bullet's
  session (the fact was still needed later); bullets of a conversation's last session
  then get no label (`no_later_session`).
- `usage`: a usage log as a live chatbot records it: one event per (reply, memory item in
  its context) with `bullet_id`, `used` (bool) or `weight` (float in [0, 1]) and an optional
  `time`. A bullet's label is the max (default) or the mean of its event values. Events
  naming an unknown bullet, or with unusable values, go to the rejects with the reason.

Both return a `SourceResult`: the `labels` table (with `source` set on every row), the
bullets left without a label and why, and counts that reconcile.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import re
from collections import Counter, defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import pyarrow as pa
import pyarrow.parquet as pq

from memprune.label.config import LabelError
from memprune.rejects import Ledger
from memprune.schema import LABELS

SOURCES: tuple[str, ...] = ("judge", "qa", "usage")

# Reasons a bullet gets no label from a source (listed in unlabelled.jsonl).
NO_QA_FOR_CONVERSATION = "no_qa_for_conversation"
NO_LATER_SESSION = "no_later_session"
NO_USAGE_EVENTS = "no_usage_events"
NO_USAGE_FOR_CONVERSATION = "no_usage_for_conversation"
QA_UNLABELLED_REASONS: tuple[str, ...] = (NO_QA_FOR_CONVERSATION, NO_LATER_SESSION)
USAGE_UNLABELLED_REASONS: tuple[str, ...] = (NO_USAGE_EVENTS, NO_USAGE_FOR_CONVERSATION)

USAGE_EXTENSIONS: dict[str, str] = {".parquet": "parquet", ".pq": "parquet", ".jsonl": "jsonl", ".ndjson": "jsonl",
                                    ".json": "jsonl"}
_TURN_SESSION = re.compile(r":s(\d+):t\d+$")


class SourceError(LabelError):
    """A label source cannot be read at all (missing file, missing column); the message names file and field."""


@dataclass(frozen=True)
class QAOptions:
    """How QA evidence becomes labels: binary or graded by the number of citing questions."""

    grading: Literal["binary", "graded"] = "binary"
    grade_cap: int = 3
    later_only: bool = False
    categories: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.grading not in ("binary", "graded"):
            raise ValueError(f"qa grading must be binary or graded, got {self.grading!r}")
        if self.grade_cap < 1:
            raise ValueError(f"qa grade_cap must be >= 1, got {self.grade_cap}")

    def rule(self) -> str:
        """The `aggregation` string of the labels rows, e.g. 'qa:binary' or 'qa:graded/3:later'."""
        base = "qa:binary" if self.grading == "binary" else f"qa:graded/{self.grade_cap}"
        return base + (":later" if self.later_only else "")


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


@dataclass
class SourceResult:
    """What a source produced: the labels table, the unlabelled bullets with reasons, and counts."""

    labels: pa.Table
    unlabelled: list[dict[str, Any]]
    counts: dict[str, Any]
    stats: dict[str, Any] = field(default_factory=dict)


def _label_counts(n_bullets: int, labels: pa.Table, unlabelled: list[dict[str, Any]],
                  reasons: Sequence[str]) -> dict[str, Any]:
    """The counts every labels source reports: bullets, labelled, unlabelled and unlabelled by reason."""
    by_reason = Counter(u["reason"] for u in unlabelled)
    return {
        "bullets": n_bullets,
        "bullets_labelled": labels.num_rows,
        "bullets_unlabelled": len(unlabelled),
        **{f"unlabelled_{r}": by_reason.get(r, 0) for r in reasons},
    }


def labels_table(rows: list[dict[str, Any]], source: str) -> pa.Table:
    """A `labels` table (sorted by bullet_id) from dicts with bullet_id, label, n_pairs, aggregation."""
    if source not in SOURCES:
        raise ValueError(f"unknown label source {source!r}; known: {', '.join(SOURCES)}")
    rows = sorted(({**r, "source": source} for r in rows), key=lambda r: r["bullet_id"])
    return pa.Table.from_pylist(rows, schema=LABELS)


# ------------------------------------------------------------------ QA evidence


def turn_sessions(sessions: pa.Table | None) -> dict[str, int]:
    """turn_id -> session_index, from a sessions table (empty when none is given)."""
    out: dict[str, int] = {}
    if sessions is None:
        return out
    for idx, turns in zip(sessions.column("session_index").to_pylist(), sessions.column("turns").to_pylist()):
        for t in turns:
            out[t["turn_id"]] = int(idx)
    return out


def _session_of(turn: str, table: dict[str, int]) -> int | None:
    """The session of a turn: from the sessions table, else the ':s<N>:t<i>' suffix of its id."""
    if turn in table:
        return table[turn]
    if table:
        return None
    m = _TURN_SESSION.search(turn)
    return int(m.group(1)) if m else None


def qa_labels(bullets: pa.Table, qa: pa.Table, sessions: pa.Table | None = None,
              options: QAOptions | None = None) -> SourceResult:
    """Labels from QA evidence: a bullet is positive when questions cite one of its evidence turns.

    `bullets` and `qa` are the corpus tables; `sessions` (optional) gives each turn's session
    and each conversation's last session (used by `later_only`), else the turn-id suffix
    and the bullets' own sessions are used. A conversation without any usable QA item
    (after the `categories` filter, with evidence) gives no labels: its bullets are listed
    as `no_qa_for_conversation`, never labelled 0 by default.
    """
    opt = options or QAOptions()
    t_session = turn_sessions(sessions)
    cats = set(opt.categories) if opt.categories is not None else None

    by_conv: dict[str, list[frozenset[str]]] = defaultdict(list)
    counts: Counter[str] = Counter()
    for cid, ev, cat in zip(qa.column("conversation_id").to_pylist(), qa.column("evidence").to_pylist(),
                            qa.column("category").to_pylist()):
        counts["qa"] += 1
        if cats is not None and cat not in cats:
            counts["qa_other_category"] += 1
            continue
        if not ev:
            counts["qa_without_evidence"] += 1
            continue
        counts["qa_used"] += 1
        by_conv[cid].append(frozenset(ev))
        if t_session:
            counts["qa_evidence_turns_unknown"] += sum(1 for t in ev if t not in t_session)

    last_session: dict[str, int] = {}
    if sessions is not None:
        for cid, idx in zip(sessions.column("conversation_id").to_pylist(), sessions.column("session_index").to_pylist()):
            last_session[cid] = max(last_session.get(cid, idx), idx)
    for cid, idx in zip(bullets.column("conversation_id").to_pylist(), bullets.column("session_index").to_pylist()):
        last_session[cid] = max(last_session.get(cid, idx), idx)

    # turn -> indices of the conversation's QA items that cite it
    index: dict[str, dict[str, list[int]]] = {}
    for cid, items in by_conv.items():
        idx_map: dict[str, list[int]] = defaultdict(list)
        for i, ev in enumerate(items):
            for t in ev:
                idx_map[t].append(i)
        index[cid] = idx_map

    rows: list[dict[str, Any]] = []
    unlabelled: list[dict[str, Any]] = []
    bullet_convs = set()
    for bid, cid, sidx, ev in zip(bullets.column("bullet_id").to_pylist(), bullets.column("conversation_id").to_pylist(),
                                  bullets.column("session_index").to_pylist(), bullets.column("evidence").to_pylist()):
        bullet_convs.add(cid)
        if cid not in index:
            unlabelled.append({"bullet_id": bid, "reason": NO_QA_FOR_CONVERSATION, "n_pairs": 0, "n_errors": 0})
            continue
        if opt.later_only and sidx >= last_session[cid]:
            unlabelled.append({"bullet_id": bid, "reason": NO_LATER_SESSION, "n_pairs": 0, "n_errors": 0})
            continue
        citing = sorted({i for t in ev for i in index[cid].get(t, ())})
        if opt.later_only:
            items = by_conv[cid]
            citing = [i for i in citing
                      if any((s := _session_of(t, t_session)) is not None and s > sidx for t in items[i])]
        n = len(citing)
        label = (1.0 if n else 0.0) if opt.grading == "binary" else min(1.0, n / opt.grade_cap)
        rows.append({"bullet_id": bid, "label": label, "n_pairs": n, "aggregation": opt.rule()})

    labels = labels_table(rows, "qa")
    out_counts: dict[str, Any] = {
        **_label_counts(bullets.num_rows, labels, unlabelled, QA_UNLABELLED_REASONS),
        "bullets_cited": sum(1 for r in rows if r["n_pairs"] > 0),
        "qa": counts["qa"],
        "qa_used": counts["qa_used"],
        "qa_without_evidence": counts["qa_without_evidence"],
        "qa_other_category": counts["qa_other_category"],
        "qa_evidence_turns_unknown": counts["qa_evidence_turns_unknown"],
        "qa_conversations_without_bullets": len(set(by_conv) - bullet_convs),
        "conversations_with_qa": len(set(by_conv) & bullet_convs),
    }
    return SourceResult(labels, sorted(unlabelled, key=lambda u: u["bullet_id"]), out_counts)


# ------------------------------------------------------------------ usage logs


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
        **_label_counts(bullets.num_rows, labels, unlabelled, USAGE_UNLABELLED_REASONS),
        "bullets_used": sum(1 for r in rows if r["label"] > 0),
        "bullets_zero_filled": sum(1 for r in rows if r["n_pairs"] == 0),
        **(log_counts or {}),
    }
    return SourceResult(labels, sorted(unlabelled, key=lambda u: u["bullet_id"]), counts)
