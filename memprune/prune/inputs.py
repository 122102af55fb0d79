"""The decision's inputs beyond scores, texts and embeddings, read from a table's columns or from bullets given as
mappings: pins, times, recalls and the supersession scope (`Bullets` fields).

- **pinned** (`PruneRule.pin_field`, a boolean column or mapping key, and the ids of `--keep-ids`): never dropped
  by any step;
- **the reference time**: the last access (from a usage log) if known, else the bullet's own `time`,
  else its session's time (`session_time`, or the corpus's sessions table); NaN unknown;
- **recalls**: how often the bullet was used (usage-log events with `used` true or `weight` > 0);
- **supersession**: the scope (the rule's `supersede.keys`), the subject column, the bullet's own time (else its
  session's) and its session index.

`Lives` holds what comes from outside the rows (the usage log, the corpus's session times, the kept ids), read
once.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from memprune.decision import PruneRule, group_codes
from memprune.errors import MemPruneError
from memprune.storage import location
from memprune.times import epoch_seconds
from memprune.usagelog import Usage

TIME = "time"                  # the bullet's own time (column or mapping key)
SESSION_TIME = "session_time"  # its session's time (mapping key; the batch job looks it up in sessions.parquet)


class LifecycleError(MemPruneError):
    """A pin field, time or scope column that cannot be used; the message names the column and the record."""


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


def _values(column: Any) -> list[Any]:
    return column.to_pylist() if isinstance(column, (pa.Array, pa.ChunkedArray)) else list(column)


@dataclass(frozen=True)
class Lives:
    """What a decision's time and pin inputs are built from besides the rows' own columns: the usage log's recalls
    and last accesses, and the corpus's session times by (conversation_id, session_index); read once."""

    usage: Usage | None = None
    session_times: Mapping[tuple[Any, Any], float] | None = None
    keep: frozenset[str] | None = None  # ids kept whatever the decision (`--keep-ids`): pinned for this run

    def fields(self, columns: Mapping[str, Any], n: int, rule: PruneRule) -> dict[str, Any]:
        """The `Bullets` fields `rule` needs of n bullets, from their columns (a name -> Arrow column or list of
        values): `pinned`; with retention `since` and `recalls`; with supersession `scope`, `subject`, `when` and
        `session`. Empty when the rule needs none of them (`rule.needs_life`) and no ids are kept (`keep`)."""
        if not rule.needs_life and not self.keep:
            return {}
        ids = _values(columns["bullet_id"]) if "bullet_id" in columns else [f"bullets[{i}]" for i in range(n)]
        out: dict[str, Any] = {}
        if rule.pin_field is not None:
            if rule.pin_field not in columns:
                raise LifecycleError(f"pin field {rule.pin_field!r}: no such column (columns: {', '.join(columns)})")
            out["pinned"] = pin_mask(columns[rule.pin_field], rule.pin_field, ids)
        if self.keep:
            kept = np.fromiter((str(i) in self.keep for i in ids), dtype=bool, count=n)
            out["pinned"] = out["pinned"] | kept if "pinned" in out else kept
        own = session = None
        if rule.needs_times:
            own = epoch_seconds(columns[TIME], TIME, ids) if TIME in columns else None
            session = epoch_seconds(columns[SESSION_TIME], SESSION_TIME, ids) if SESSION_TIME in columns else None
            if session is None and self.session_times and "conversation_id" in columns and "session_index" in columns:
                keys = zip(_values(columns["conversation_id"]), _values(columns["session_index"]))
                session = np.fromiter((self.session_times.get(k, np.nan) for k in keys), dtype=np.float64, count=n)
        if rule.supersede.on:
            sup = rule.supersede
            for col in (*sup.keys, sup.subject):
                if col not in columns:
                    raise LifecycleError(f"supersession: no column {col!r} (columns: {', '.join(columns)})")
            index = _values(columns["session_index"]) if "session_index" in columns else [None] * n
            out |= {"scope": group_codes(list(zip(*(_values(columns[k]) for k in sup.keys)))),
                    "subject": _values(columns[sup.subject]),
                    "when": first_known(own, session) if own is not None or session is not None else np.full(n, np.nan),
                    "session": np.array([np.nan if v is None else float(v) for v in index], dtype=np.float64)}
        if rule.retention.on:
            recalls = last = None
            if self.usage is not None:
                recalls, last = self.usage.lookup(ids)
            out |= {"since": first_known(last, own, session), "recalls": recalls}
        return out

    def of_table(self, table: pa.Table, rule: PruneRule) -> dict[str, Any]:
        """`fields` of a bullets table's rows."""
        return self.fields({c: table.column(c) for c in table.column_names}, table.num_rows, rule)

    def of_mappings(self, bullets: Sequence[Any], rule: PruneRule) -> dict[str, Any]:
        """`fields` of bullets given as strings or mappings (a key a mapping lacks is null: not pinned, time unknown;
        with supersession a missing scope key is one scope, a missing subject no subject)."""
        sup = rule.supersede
        scoped = (*sup.keys, sup.subject) if sup.on else ()
        wanted = ("bullet_id", "conversation_id", "session_index", rule.pin_field, TIME, SESSION_TIME, *scoped)
        names = [k for k in dict.fromkeys(wanted)
                 if k is not None and any(isinstance(b, Mapping) and k in b for b in bullets)]
        columns = {k: [b.get(k) if isinstance(b, Mapping) else None for b in bullets] for k in names}
        for k in (rule.pin_field, *scoped):
            if k is not None and k not in columns:
                columns[k] = [None] * len(bullets)  # no bullet carries the key: none is pinned / one scope / no subject
        return self.fields(columns, len(bullets), rule)


def session_times_of(sessions: pa.Table) -> dict[tuple[Any, Any], float]:
    """(conversation_id, session_index) -> the session's time in epoch seconds, from a `sessions` table."""
    if TIME not in sessions.column_names:
        return {}
    ids = [f"{c}:s{s}" for c, s in zip(sessions.column("conversation_id").to_pylist(),
                                        sessions.column("session_index").to_pylist())]
    secs = epoch_seconds(sessions.column(TIME), f"sessions.{TIME}", ids)
    keys = zip(sessions.column("conversation_id").to_pylist(), sessions.column("session_index").to_pylist())
    return {k: float(t) for k, t in zip(keys, secs) if not math.isnan(t)}


def corpus_session_times(paths: list[Any]) -> dict[tuple[Any, Any], float] | None:
    """The session times of a corpus dir (its sessions.parquet beside bullets.parquet, the one file of `paths`),
    else None."""
    if len(paths) != 1 or not str(paths[0]).endswith("bullets.parquet"):
        return None
    path = str(paths[0])[: -len("bullets.parquet")] + "sessions.parquet"
    loc = location(path)
    if not loc.is_file():
        return None
    try:
        table = pq.read_table(loc.path, columns=["conversation_id", "session_index", TIME], filesystem=loc.fs)
    except (OSError, pa.ArrowInvalid, KeyError):
        return None
    try:
        return session_times_of(table)
    except ValueError as exc:
        raise LifecycleError(f"{path}: {exc}") from None
