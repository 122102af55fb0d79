"""Times and durations, parsed in one place: a time value (ISO 8601 text, a datetime or date, Unix seconds, an
Arrow timestamp column) as aware UTC or epoch seconds, and a duration (`30d`, `12h`, `P2W`, seconds).

The usage log (`memprune.usagelog`), the decision's retention settings (`memprune.decision`), the stores'
time columns and the CLI's `--now` / `--half-life` all read times and durations here.
"""

from __future__ import annotations

import datetime as dt
import math
import re
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from memprune.errors import MemPruneError

UNITS = {"w": 604800.0, "d": 86400.0, "h": 3600.0, "m": 60.0, "s": 1.0}
_SHORT = re.compile(r"(\d+(?:\.\d+)?)([wdhms])")
_SHORTS = re.compile(r"(?:\d+(?:\.\d+)?[wdhms])+")
_ISO = re.compile(r"P(?:(\d+(?:\.\d+)?)W)?(?:(\d+(?:\.\d+)?)D)?"
                  r"(?:T(?:(\d+(?:\.\d+)?)H)?(?:(\d+(?:\.\d+)?)M)?(?:(\d+(?:\.\d+)?)S)?)?")
DURATION_HINT = "use e.g. 30d, 12h, P2W"
TIME_HINT = "ISO 8601 like 2024-05-01 or 2024-05-01T10:00:00Z, a timestamp, or Unix seconds"


class TimeError(MemPruneError):
    """A value that should be a time is not; the message names the column and the record."""


def utc(value: dt.datetime) -> dt.datetime:
    """An aware UTC datetime (a naive one is taken as UTC)."""
    return value.replace(tzinfo=dt.timezone.utc) if value.tzinfo is None else value.astimezone(dt.timezone.utc)


def parse_time(value: Any) -> dt.datetime:
    """A time as aware UTC: ISO 8601 text ('Z' allowed), a datetime, a date (its midnight) or Unix seconds; else
    ValueError."""
    if isinstance(value, bool):
        raise ValueError("a boolean is not a time")
    if isinstance(value, dt.datetime):
        return utc(value)
    if isinstance(value, dt.date):
        return utc(dt.datetime(value.year, value.month, value.day))
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


def epoch_seconds(values: Sequence[Any] | pa.Array | pa.ChunkedArray, column: str, ids: Sequence[Any],
                  strict: bool = True) -> np.ndarray:
    """Times (ISO 8601 text, timestamps, dates or Unix seconds; null = unknown) as epoch seconds, NaN unknown.

    A value that is not a time is a `TimeError` naming the column and the record (`ids[i]`); with `strict` False it
    is unknown (NaN) instead (what only shows times, never judges them: the review page).
    """
    if isinstance(values, (pa.Array, pa.ChunkedArray)):
        if pa.types.is_date(values.type):
            values = pc.cast(values, pa.timestamp("s"))
        if pa.types.is_timestamp(values.type):
            secs = pc.cast(pc.cast(values, pa.timestamp("us", tz=values.type.tz)), pa.int64())
            return np.asarray(pc.divide(pc.cast(secs, pa.float64()), 1e6).to_numpy(zero_copy_only=False),
                              dtype=np.float64)
        values = values.to_pylist()
    out = np.full(len(values), np.nan)
    seen: dict[Any, float] = {}
    for i, v in enumerate(values):
        if v is None or (isinstance(v, float) and math.isnan(v)):
            continue
        key = (type(v), v) if isinstance(v, (str, int, float)) else None
        if key is not None and key in seen:
            out[i] = seen[key]
            continue
        try:
            t = parse_time(v).timestamp()
        except (ValueError, OverflowError, OSError, TypeError):
            if strict:
                raise TimeError(f"column {column!r}: {v!r} (record {ids[i]!r}) is not a time ({TIME_HINT})") from None
            t = math.nan
        out[i] = t
        if key is not None:
            seen[key] = t
    return out


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
