"""Keeping memory current, as pure functions: pins, forgetting (retention) and expiry, and their inputs.

Three per-bullet facts enter the one decision (`memprune.prune.policy`) beside the usefulness score:

- **pinned** (`PruneRule.pin_field`, a boolean column or mapping key): never dropped by any step;
- **the reference time**: the last access (from a usage log) if known, else the bullet's own `time`,
  else its session's time; age = `now` - reference time (a time after `now` counts as age 0);
- **recalls**: how often the bullet was used (usage-log events with `used` true or `weight` > 0).

Retention (MemoryBank's forgetting curve), with `h` = `half_life`, `b` = `recall_boost`, `n` = recalls:

    S = (h / ln 2) * (1 + b * n)        R = exp(-age / S)        effective score = score * R

so a bullet never recalled keeps half its score after one half-life, and each recall stretches its
strength by `b` half-life units of `h / ln 2`. A bullet whose age is unknown keeps R = 1. With
`max_age` a bullet older than it (age > max_age, strictly) expires (reason `expired`) unless pinned.
"""

from __future__ import annotations

import datetime as dt
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pydantic import ConfigDict, Field, field_serializer, field_validator, model_validator

from memprune.config import ConfigModel
from memprune.errors import MemPruneError
from memprune.rejects import Ledger
from memprune.usagelog import event_value, iter_events, parse_time, usage_files

TIME = "time"                  # the bullet's own time (column or mapping key)
SESSION_TIME = "session_time"  # its session's time (mapping key; the batch job looks it up in sessions.parquet)
UNITS = {"w": 604800.0, "d": 86400.0, "h": 3600.0, "m": 60.0, "s": 1.0}
_SHORT = re.compile(r"(\d+(?:\.\d+)?)([wdhms])")
_SHORTS = re.compile(r"(?:\d+(?:\.\d+)?[wdhms])+")
_ISO = re.compile(r"P(?:(\d+(?:\.\d+)?)W)?(?:(\d+(?:\.\d+)?)D)?"
                  r"(?:T(?:(\d+(?:\.\d+)?)H)?(?:(\d+(?:\.\d+)?)M)?(?:(\d+(?:\.\d+)?)S)?)?")
DURATION_HINT = "use e.g. 30d, 12h, P2W"
RECALL_BOOST = 1.0  # MemoryBank's: each recall adds one unit of strength


class LifecycleError(MemPruneError):
    """A pin field, time or usage log that cannot be used; the message names the column, file or record."""


def parse_duration(value: Any) -> float:
    """Seconds of a duration: `30d`, `12h`, `90m`, `2w`, `45s`, `1d12h`, ISO 8601 `P30D`/`P2W`/`PT12H`, or a
    positive number of seconds; ValueError (`'3x' is not a duration; use e.g. ...`) otherwise."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"{value!r} is not a duration (a positive number of seconds); {DURATION_HINT}")
        return float(value)
    if isinstance(value, dt.timedelta):
        return parse_duration(value.total_seconds())
    text = value.strip() if isinstance(value, str) else ""
    seconds = None
    if text and _SHORTS.fullmatch(text.lower()):
        seconds = sum(float(n) * UNITS[u] for n, u in _SHORT.findall(text.lower()))
    elif (m := _ISO.fullmatch(text.upper())) and any(m.groups()) and not text.upper().endswith("T"):
        w, d, h, mi, s = (float(g) if g else 0.0 for g in m.groups())
        seconds = w * UNITS["w"] + d * UNITS["d"] + h * UNITS["h"] + mi * UNITS["m"] + s
    if seconds is None or seconds <= 0:
        raise ValueError(f"{value!r} is not a duration; {DURATION_HINT}")
    return seconds


def format_duration(seconds: float) -> str:
    """A duration in the largest whole unit that fits: 2592000 -> '30d', 5400 -> '90m'."""
    for unit, size in UNITS.items():
        if seconds >= size and float(seconds / size).is_integer():
            return f"{int(seconds // size)}{unit}"
    return f"{seconds:g}s"


class Retention(ConfigModel):
    """Forgetting and expiry (`rule.retention`): off unless `half_life` or `max_age` is set.

    `half_life` and `max_age` are durations (`30d`, `12h`, `P2W`, or seconds); `recall_boost` b >= 0
    stretches the memory strength per recall, S = (half_life / ln 2) * (1 + b * recalls); `now` is the
    time ages are measured at (default: the run's start, recorded in prune.json; set it for reproducible runs).
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, frozen=True)

    half_life: float | None = Field(None, gt=0, description="retention halves after this long without a recall "
                                                             "(a duration: 30d, 12h, P2W); null = no forgetting")
    recall_boost: float = Field(RECALL_BOOST, ge=0, description="each recall multiplies the memory strength by (1 + b * recalls)")
    max_age: float | None = Field(None, gt=0, description="expire (reason `expired`) bullets older than this; "
                                                           "null = never")
    now: dt.datetime | None = Field(None, description="the time ages are measured at; null = the run's start")

    @field_validator("half_life", "max_age", mode="before")
    @classmethod
    def _duration(cls, v: Any) -> Any:
        return None if v is None else parse_duration(v)

    @field_validator("now", mode="before")
    @classmethod
    def _now(cls, v: Any) -> Any:
        if v is None:
            return None
        try:
            return parse_time(v)
        except (ValueError, OverflowError, OSError) as exc:
            raise ValueError(f"{v!r} is not a time (ISO 8601, e.g. 2024-05-01T12:00:00Z, or Unix seconds)") from exc

    @field_serializer("now")
    def _iso(self, v: dt.datetime | None) -> str | None:
        return None if v is None else v.isoformat()

    @model_validator(mode="after")
    def _no_silent_settings(self) -> "Retention":
        if self.half_life is None and self.recall_boost != RECALL_BOOST:
            raise ValueError("recall_boost only slows forgetting: set half_life too")
        if self.now is not None and not self.on:
            raise ValueError("now only matters for half_life or max_age: set one of them")
        return self

    @property
    def forgets(self) -> bool:
        """Scores are weighted by retention (`half_life` set)."""
        return self.half_life is not None

    @property
    def on(self) -> bool:
        """Any time-dependent step is on (forgetting or expiry)."""
        return self.half_life is not None or self.max_age is not None

    def at(self, now: dt.datetime) -> "Retention":
        """These settings with `now` fixed (when unset)."""
        return self if self.now is not None or not self.on else self.model_copy(update={"now": parse_time(now)})

    def describe(self) -> str:
        """e.g. 'forgetting half-life 30d (recall boost 1); expire after 90d; ages at 2024-05-01T00:00:00+00:00'."""
        parts = []
        if self.half_life is not None:
            parts.append(f"forgetting half-life {format_duration(self.half_life)} (recall boost {self.recall_boost:g}; "
                         "the policy ranks score x retention)")
        if self.max_age is not None:
            parts.append(f"expire after {format_duration(self.max_age)}")
        if self.now is not None:
            parts.append(f"ages at {self.now.isoformat()}")
        return "; ".join(parts)


def retention_factor(age: np.ndarray, recalls: np.ndarray | None, half_life: float, recall_boost: float) -> np.ndarray:
    """R = exp(-age / S), S = (half_life / ln 2) * (1 + recall_boost * recalls); NaN age (unknown) -> 1."""
    a = np.maximum(np.asarray(age, dtype=np.float64), 0.0)
    n = np.zeros_like(a) if recalls is None else np.asarray(recalls, dtype=np.float64)
    strength = half_life / math.log(2.0) * (1.0 + recall_boost * n)
    return np.where(np.isnan(a), 1.0, np.exp(-np.nan_to_num(a) / strength))


@dataclass(frozen=True)
class Life:
    """Per-bullet inputs of the decision's time steps: pinned, the reference time (epoch seconds, NaN unknown), recalls;
    for supersession the scope (codes), subject, the bullet's own time (else its session's; NaN unknown) and session."""

    pinned: np.ndarray | None = None
    since: np.ndarray | None = None
    recalls: np.ndarray | None = None
    scope: np.ndarray | None = None
    subject: list[Any] | None = None
    when: np.ndarray | None = None
    session: np.ndarray | None = None


@dataclass(frozen=True)
class Standing:
    """Per bullet, what the decision sees after the time steps: the effective score, retention, older than
    max_age (`expired`, pinned or not: the decision never drops a pinned one), pinned, and whether its age is known."""

    effective: np.ndarray
    retention: np.ndarray | None
    expired: np.ndarray
    pinned: np.ndarray
    age_known: np.ndarray

    @property
    def priority(self) -> np.ndarray:
        """Which copy represents a duplicate cluster first: pinned, then not expired (then the score)."""
        return 2 * self.pinned.astype(np.int64) + (~self.expired).astype(np.int64)

    def unpinned(self) -> "Standing":
        """The same bullets as if none were pinned (what a step would have done to a pinned one)."""
        n = len(self.pinned)
        return Standing(self.effective, self.retention, self.expired, np.zeros(n, dtype=bool), self.age_known)


def standing(scores: np.ndarray, retention: Retention, life: Life | None) -> Standing:
    """The effective scores (score x retention when forgetting), the expired and the pinned bullets."""
    s = np.asarray(scores, dtype=np.float64)
    n = len(s)
    life = life or Life()
    pinned = np.zeros(n, dtype=bool) if life.pinned is None else np.asarray(life.pinned, dtype=bool)
    for name, arr in (("pinned", pinned), ("since", life.since), ("recalls", life.recalls)):
        if arr is not None and len(arr) != n:
            raise ValueError(f"{name} ({len(arr)}) and scores ({n}) differ in length")
    if not retention.on:
        return Standing(s, None, np.zeros(n, dtype=bool), pinned, np.zeros(n, dtype=bool))
    if retention.now is None:
        raise ValueError("retention.now is not resolved (Retention.at(now) first)")
    since = np.full(n, np.nan) if life.since is None else np.asarray(life.since, dtype=np.float64)
    age = retention.now.timestamp() - since
    known = ~np.isnan(age)
    r = None
    effective = s
    if retention.half_life is not None:
        r = retention_factor(age, life.recalls, retention.half_life, retention.recall_boost)
        effective = s * r
    expired = np.zeros(n, dtype=bool)
    if retention.max_age is not None:
        expired = known & (np.nan_to_num(age, nan=-np.inf) > retention.max_age)
    return Standing(effective, r, expired, pinned, known)


# ------------------------------------------------------------------ the inputs, from columns or mapping keys


def epoch_seconds(values: Sequence[Any] | pa.Array | pa.ChunkedArray, column: str, ids: Sequence[Any]) -> np.ndarray:
    """Times (ISO 8601 text, timestamps or Unix seconds; null = unknown) as epoch seconds, NaN unknown.

    A value that is not a time is a `LifecycleError` naming the column and the record (`ids[i]`).
    """
    if isinstance(values, (pa.Array, pa.ChunkedArray)):
        if pa.types.is_timestamp(values.type):
            secs = pc.cast(pc.cast(values, pa.timestamp("us", tz=values.type.tz)), pa.int64())
            return np.asarray(pc.divide(pc.cast(secs, pa.float64()), 1e6).to_numpy(zero_copy_only=False),
                              dtype=np.float64)
        if pa.types.is_date(values.type):
            values = pc.cast(values, pa.timestamp("s"))
            return epoch_seconds(values, column, ids)
        values = values.to_pylist()
    out = np.full(len(values), np.nan)
    seen: dict[Any, float] = {}
    for i, v in enumerate(values):
        if v is None:
            continue
        if isinstance(v, float) and math.isnan(v):
            continue
        key = (type(v), v) if isinstance(v, (str, int, float)) else None
        if key is not None and key in seen:
            out[i] = seen[key]
            continue
        try:
            t = parse_time(v).timestamp() if not isinstance(v, dt.date) or isinstance(v, dt.datetime) \
                else parse_time(dt.datetime(v.year, v.month, v.day)).timestamp()
        except (ValueError, OverflowError, OSError, TypeError):
            raise LifecycleError(f"column {column!r}: {v!r} (record {ids[i]!r}) is not a time "
                                 "(ISO 8601 like 2024-05-01 or 2024-05-01T10:00:00Z, a timestamp, or Unix seconds)") from None
        out[i] = t
        if key is not None:
            seen[key] = t
    return out


def pin_mask(values: Sequence[Any] | pa.Array | pa.ChunkedArray, field: str, ids: Sequence[Any]) -> np.ndarray:
    """The pinned flags of a boolean column or mapping values (null/missing = not pinned); other values are errors."""
    if isinstance(values, (pa.Array, pa.ChunkedArray)):
        if not pa.types.is_boolean(values.type) and not pa.types.is_null(values.type):
            raise LifecycleError(f"pin field {field!r} has type {values.type}, expected bool")
        return np.asarray(pc.fill_null(values.cast(pa.bool_()), False).to_numpy(zero_copy_only=False), dtype=bool)
    out = np.zeros(len(values), dtype=bool)
    for i, v in enumerate(values):
        if v is None:
            continue
        if not isinstance(v, (bool, np.bool_)):
            raise LifecycleError(f"pin field {field!r}: {v!r} (bullet {ids[i]!r}) is not true/false")
        out[i] = bool(v)
    return out


def first_known(*times: np.ndarray | None) -> np.ndarray | None:
    """Per bullet, the first of `times` that is not NaN (the last access, else the bullet's time, else its session's)."""
    given = [np.asarray(t, dtype=np.float64) for t in times if t is not None]
    if not given:
        return None
    out = given[0].copy()
    for t in given[1:]:
        out = np.where(np.isnan(out), t, out)
    return out


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
        raise LifecycleError(f"{source}: {record}: {reason} ({field} = {value!r})")


def read_usage(path: str | Path, known: Any = None) -> Usage:
    """Recalls and last access per bullet from a usage log (the `usage` label source's format).

    A recall is an event with `used` true or `weight` > 0; the last access is the latest `time` of a
    recall. `known` (a set of bullet ids) is the store: an id it does not hold, an event without a usable
    `bullet_id`/`used`/`weight`, or an unparseable time is a `LifecycleError` naming the file, line and id.
    `known` None: any id (a caller that sees part of a store, or a check of the log alone before any work).
    """
    recalls: dict[str, int] = {}
    last: dict[str, float] = {}
    ledger = _Strict()
    events = 0
    for file in usage_files(path, error=LifecycleError):
        for ev in iter_events(file, ledger, error=LifecycleError):
            events += 1
            bid = ev.bullet_id
            where = f"{file}: {ev.record}"
            if not isinstance(bid, str) or not bid:
                raise LifecycleError(f"{where}: bullet_id is missing or not a string ({bid!r})")
            if known is not None and bid not in known:
                raise LifecycleError(f"{where}: unknown bullet_id {bid!r} (not in the store being pruned)")
            value, fld, why = event_value(ev)
            if value is None:
                raise LifecycleError(f"{where} bullet_id={bid}: {why}")
            when = np.nan
            if ev.time is not None:
                try:
                    when = parse_time(ev.time).timestamp()
                except (ValueError, OverflowError, OSError):
                    raise LifecycleError(f"{where} bullet_id={bid}: time {ev.time!r} is not a time "
                                         "(ISO 8601, a timestamp or Unix seconds)") from None
            if value > 0:
                recalls[bid] = recalls.get(bid, 0) + 1
                if not math.isnan(when):
                    last[bid] = max(last.get(bid, -math.inf), when)
    return Usage(recalls, last, events)


def _values(column: Any) -> list[Any]:
    return column.to_pylist() if isinstance(column, (pa.Array, pa.ChunkedArray)) else list(column)


def life_of(columns: Mapping[str, Any], n: int, pin_field: str | None, retention: Retention,
            usage: Usage | None = None, session_times: Mapping[tuple[Any, Any], float] | None = None,
            supersede: Any = None) -> Life | None:
    """The `Life` of n bullets from their columns (a name -> Arrow column or list of values; a table's columns
    or mapping bullets' keys): pins from `pin_field`; with retention on, the reference time (last access from
    `usage`, else `time`, else `session_time`, else the session's time in `session_times` by
    (conversation_id, session_index)) and recalls; with `supersede` (`Supersede`, on) the scope, subject, the
    bullet's time (`time`, else its session's) and session. None when none of these is asked for."""
    sup = supersede is not None and supersede.on
    if pin_field is None and not retention.on and not sup:
        return None
    ids = _values(columns["bullet_id"]) if "bullet_id" in columns else [f"bullets[{i}]" for i in range(n)]
    pinned = None
    if pin_field is not None:
        if pin_field not in columns:
            raise LifecycleError(f"pin field {pin_field!r}: no such column (columns: {', '.join(columns)})")
        pinned = pin_mask(columns[pin_field], pin_field, ids)
    timed = retention.on or sup
    own = epoch_seconds(columns[TIME], TIME, ids) if TIME in columns and timed else None
    session = epoch_seconds(columns[SESSION_TIME], SESSION_TIME, ids) if SESSION_TIME in columns and timed else None
    if session is None and session_times and "conversation_id" in columns and "session_index" in columns:
        keys = zip(_values(columns["conversation_id"]), _values(columns["session_index"]))
        session = np.fromiter((session_times.get(k, np.nan) for k in keys), dtype=np.float64, count=n)
    extra: dict[str, Any] = {}
    if sup:
        from memprune.prune.rule import group_codes

        for col in (*supersede.keys, supersede.subject):
            if col not in columns:
                raise LifecycleError(f"supersession: no column {col!r} (columns: {', '.join(columns)})")
        scope = list(zip(*(_values(columns[k]) for k in supersede.keys)))
        index = _values(columns["session_index"]) if "session_index" in columns else [None] * n
        extra = {"scope": group_codes(scope), "subject": _values(columns[supersede.subject]),
                 "when": first_known(own, session) if own is not None or session is not None else np.full(n, np.nan),
                 "session": np.array([np.nan if v is None else float(v) for v in index], dtype=np.float64)}
    if not retention.on:
        return Life(pinned=pinned, **extra)
    recalls = last = None
    if usage is not None:
        recalls, last = usage.lookup(ids)
    return Life(pinned=pinned, since=first_known(last, own, session), recalls=recalls, **extra)


def life_of_table(table: pa.Table, pin_field: str | None, retention: Retention, usage: Usage | None = None,
                  session_times: Mapping[tuple[Any, Any], float] | None = None, supersede: Any = None) -> Life | None:
    """`life_of` a bullets table's rows."""
    return life_of({c: table.column(c) for c in table.column_names}, table.num_rows, pin_field, retention, usage,
                   session_times, supersede)


def life_of_mappings(bullets: Sequence[Any], pin_field: str | None, retention: Retention, usage: Usage | None = None,
                     session_times: Mapping[tuple[Any, Any], float] | None = None,
                     supersede: Any = None) -> Life | None:
    """`life_of` bullets given as strings or mappings (a key a mapping lacks is null: not pinned, time unknown; with
    supersession a missing scope key is one scope, a missing subject no subject)."""
    sup = supersede is not None and supersede.on
    wanted = ("bullet_id", "conversation_id", "session_index", pin_field, TIME, SESSION_TIME,
              *((*supersede.keys, supersede.subject) if sup else ()))
    names = [k for k in dict.fromkeys(wanted)
             if k is not None and any(isinstance(b, Mapping) and k in b for b in bullets)]
    columns = {k: [b.get(k) if isinstance(b, Mapping) else None for b in bullets] for k in names}
    for k in (pin_field, *((*supersede.keys, supersede.subject) if sup else ())):
        if k is not None and k not in columns:
            columns[k] = [None] * len(bullets)  # no bullet carries the key: none is pinned / one scope / no subject
    return life_of(columns, len(bullets), pin_field, retention, usage, session_times, supersede)


def session_times_of(sessions: pa.Table) -> dict[tuple[Any, Any], float]:
    """(conversation_id, session_index) -> the session's time in epoch seconds, from a `sessions` table."""
    if TIME not in sessions.column_names:
        return {}
    ids = [f"{c}:s{s}" for c, s in zip(sessions.column("conversation_id").to_pylist(),
                                        sessions.column("session_index").to_pylist())]
    secs = epoch_seconds(sessions.column(TIME), f"sessions.{TIME}", ids)
    keys = zip(sessions.column("conversation_id").to_pylist(), sessions.column("session_index").to_pylist())
    return {k: float(t) for k, t in zip(keys, secs) if not math.isnan(t)}
