"""The review page's data: a decided table (one row per record: id, group, text, score, keep, reason, what replaced
it, pinned, time, tokens) and its run's summary, laid out for the page.

Records are columns of plain values in the table's order (the order the decision ranked ties in); groups are
runs of equal group keys. `payload` returns the page's one JSON document: the summary in words and numbers, the
score histogram with the policy's cut, the groups that lose the most, and the records (`chunks` cuts the
records into pieces of bounded size for a store too big for one file).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from memprune.times import epoch_seconds

HIST_BINS = 40
WORST_GROUPS = 12
# The record columns the page reads, in order: what each holds and where it comes from in a decided table.
FIELDS = ("id", "group", "text", "score", "effective", "keep", "reason", "duplicate_of", "superseded_by", "pinned",
          "time", "tokens")


@dataclass(frozen=True)
class Layout:
    """Where a decided table keeps what the page shows: its id column, its group key columns, its pin and time
    columns (None: it has none)."""

    id: str
    groups: tuple[str, ...]
    pin: str | None = None
    time: str | None = None


def _column(table: pa.Table, name: str | None) -> list[Any] | None:
    if name is None or name not in table.column_names:
        return None
    return table.column(name).to_pylist()


def _times(table: pa.Table, name: str | None) -> list[float | None] | None:
    """A time column as epoch seconds (timestamps, dates, Unix seconds or ISO 8601 text; None where a record has
    none or its value is not a time: the page shows, it does not judge)."""
    if name is None or name not in table.column_names:
        return None
    secs = epoch_seconds(table.column(name), name, [], strict=False)
    return [None if math.isnan(v) else float(v) for v in secs.tolist()]


def records(table: pa.Table, layout: Layout, count: Callable[[Sequence[str]], np.ndarray] | None = None
            ) -> dict[str, list[Any]]:
    """The page's record columns (`FIELDS`) of a decided table; `count`: token counts of the texts (None: none)."""
    n = table.num_rows
    texts = [t if t is not None else "" for t in table.column("text").to_pylist()]
    keys = [table.column(k).to_pylist() for k in layout.groups]
    groups = [" / ".join("" if v is None else str(v) for v in row) for row in zip(*keys)] if keys else [""] * n
    score = table.column("score").to_pylist()
    out: dict[str, list[Any]] = {
        "id": [str(v) for v in table.column(layout.id).to_pylist()],
        "group": groups,
        "text": texts,
        "score": [None if v is None else round(float(v), 5) for v in score],
        "effective": [None if v is None else round(float(v), 5) for v in _column(table, "effective_score") or [None] * n],
        "keep": [bool(v) for v in table.column("keep").to_pylist()],
        "reason": _column(table, "reason") or [None] * n,
        "duplicate_of": _column(table, "duplicate_of") or [None] * n,
        "superseded_by": _column(table, "superseded_by") or [None] * n,
        "pinned": [bool(v) for v in _column(table, layout.pin) or [False] * n],
        "time": _times(table, layout.time) or [None] * n,
        "tokens": [int(v) for v in count(texts)] if count is not None and n else [None] * n,
    }
    return out


def histogram(scores: Sequence[float | None], keep: Sequence[bool], bins: int = HIST_BINS) -> dict[str, Any]:
    """Counts of kept and dropped records per score bin over [0, 1] (scores outside are clipped)."""
    s = np.array([np.nan if v is None else v for v in scores], dtype=float)
    k = np.asarray(keep, dtype=bool)
    ok = ~np.isnan(s)
    edges = np.linspace(0.0, 1.0, bins + 1)
    at = np.clip((np.clip(s[ok], 0.0, 1.0) * bins).astype(int), 0, bins - 1)
    kept = np.bincount(at[k[ok]], minlength=bins)
    dropped = np.bincount(at[~k[ok]], minlength=bins)
    return {"edges": [round(float(e), 4) for e in edges], "kept": kept.tolist(), "dropped": dropped.tolist()}


def group_table(rec: dict[str, list[Any]]) -> list[dict[str, Any]]:
    """Per group, in order of first appearance: its name, records, kept, dropped, and tokens before and after."""
    at: dict[str, dict[str, Any]] = {}
    for g, keep, tokens in zip(rec["group"], rec["keep"], rec["tokens"]):
        e = at.setdefault(g, {"group": g, "records": 0, "kept": 0, "dropped": 0, "tokens": 0, "tokens_kept": 0})
        e["records"] += 1
        e["kept" if keep else "dropped"] += 1
        e["tokens"] += tokens or 0
        e["tokens_kept"] += (tokens or 0) if keep else 0
    return list(at.values())


def worst_groups(groups: list[dict[str, Any]], k: int = WORST_GROUPS) -> list[dict[str, Any]]:
    """The groups that lose the most records (ties: the larger share, then the name)."""
    return sorted((g for g in groups if g["dropped"]), key=lambda g: (-g["dropped"], -g["dropped"] / g["records"],
                                                                     g["group"]))[:k]


def chunks(rec: dict[str, list[Any]], max_bytes: int, row_bytes: Callable[[int], int]) -> list[tuple[int, int]]:
    """Row ranges [a, b) of about `max_bytes` each, cut at group boundaries where a group fits (one chunk if all
    fits)."""
    n = len(rec["id"])
    cuts, start, size = [], 0, 0
    for i in range(n):
        size += row_bytes(i)
        boundary = i + 1 == n or rec["group"][i + 1] != rec["group"][i]
        if size >= max_bytes and (boundary or size >= 2 * max_bytes):
            cuts.append((start, i + 1))
            start, size = i + 1, 0
    if start < n or not cuts:
        cuts.append((start, n))
    return cuts


def payload(rec: dict[str, list[Any]], meta: dict[str, Any]) -> dict[str, Any]:
    """The page's document without its records: meta (the run in words), counts, histogram, groups."""
    groups = group_table(rec)
    keep = rec["keep"]
    reasons: dict[str, int] = {}
    for k, r in zip(keep, rec["reason"]):
        if not k:
            reasons[r or "dropped"] = reasons.get(r or "dropped", 0) + 1
    has_tokens = any(t is not None for t in rec["tokens"])
    return {
        "meta": meta,
        "counts": {"records": len(keep), "kept": sum(keep), "dropped": len(keep) - sum(keep), "by_reason": reasons,
                   "pinned": sum(rec["pinned"]), "groups": len(groups),
                   "tokens": sum(t or 0 for t in rec["tokens"]) if has_tokens else None,
                   "tokens_kept": sum(t or 0 for t, k in zip(rec["tokens"], keep) if k) if has_tokens else None},
        "histogram": histogram(rec["score"], keep),
        "worst_groups": worst_groups(groups),
        "fields": list(FIELDS),
    }
