"""source=usage: labels from a usage log (pure; no Ray, no models).

A usage log as a live chatbot records it: one event per (reply, memory item in its context) with
`bullet_id`, `used` (bool) or `weight` (float in [0, 1]) and an optional `time`. A bullet's label is
the max (default) or the mean of its event values. Events naming an unknown bullet, or with unusable
values, go to the rejects with the reason.
"""

from __future__ import annotations

import datetime as dt
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import pyarrow as pa

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
# the log format is read in memprune.usagelog (pruning reads it too); USAGE_EXTENSIONS, UsageEvent and parse_time
# stay importable from here
from memprune.times import parse_time  # noqa: F401  (re-exported: the usage source's times)
from memprune.usagelog import USAGE_EXTENSIONS, UsageEvent, event_value, iter_events  # noqa: F401
from memprune.usagelog import usage_files as _usage_files
from memprune.times import utc as _utc
from memprune.work import file_digest

# Reasons a bullet gets no label from this source (listed in unlabelled.jsonl).
NO_USAGE_EVENTS = "no_usage_events"
NO_USAGE_FOR_CONVERSATION = "no_usage_for_conversation"
USAGE_UNLABELLED_REASONS: tuple[str, ...] = (NO_USAGE_EVENTS, NO_USAGE_FOR_CONVERSATION)


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


def usage_files(path: str | Path) -> list[Path]:
    """The log files of a usage log (`memprune.usagelog.usage_files`), errors as `SourceError`."""
    return _usage_files(path, error=SourceError)


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
        for ev in iter_events(file, ledger, error=SourceError):
            where = {"source": str(file), "record": ev.record, "kind": "usage_event"}
            bid = ev.bullet_id
            if not isinstance(bid, str) or not bid:
                ledger.reject(**where, field="bullet_id", reason="bullet_id is missing or not a string", value=bid)
                continue
            where["record"] = f"{ev.record} bullet_id={bid}"
            if bid not in bullet_conversation:
                ledger.reject(**where, field="bullet_id", reason="unknown bullet_id (not in bullets.parquet)", value=bid)
                continue
            value, fld, why = event_value(ev)
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


USAGE = register(LabelSource(
    name="usage", description="a usage log: whether the replies of a live chatbot used the bullet", check=_check, run=run,
    intro="Usage labels: from a log of the memory items replies drew on.",
    rows=lambda c: [("events counted / total", f"{c['events_counted']} / {c['events']}"),
                    ("events outside the time window", c["events_outside_window"]),
                    ("events rejected (rejects.jsonl)", c["events_rejected"]), ("bullets used", c["bullets_used"])]))
