"""Forgetting (retention) and expiry, and what the decision's time steps make of each bullet (`Standing`).

Retention (MemoryBank's forgetting curve), with `h` = `half_life`, `b` = `recall_boost`, `n` = recalls and the age
= `now` - the bullet's reference time (`Bullets.since`: its last access, else its own time, else its session's; a
time after `now` counts as age 0):

    S = (h / ln 2) * (1 + b * n)        R = exp(-age / S)        effective score = score * R

so a bullet never recalled keeps half its score after one half-life, and each recall stretches its
strength by `b` half-life units of `h / ln 2`. A bullet whose age is unknown keeps R = 1. With
`max_age` a bullet older than it (age > max_age, strictly) expires (reason `expired`) unless pinned.
"""

from __future__ import annotations

import datetime as dt
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from pydantic import ConfigDict, Field, field_serializer, field_validator, model_validator

from memprune.config import ConfigModel
from memprune.decision.bullets import Bullets
from memprune.times import format_duration, parse_duration, parse_time

RECALL_BOOST = 1.0  # MemoryBank's: each recall adds one unit of strength


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


def standing(bullets: Bullets, retention: Retention) -> Standing:
    """The effective scores (score x retention when forgetting), the expired and the pinned bullets."""
    s = bullets.scores
    n = len(s)
    pinned = bullets.pins
    if not retention.on:
        return Standing(s, None, np.zeros(n, dtype=bool), pinned, np.zeros(n, dtype=bool))
    if retention.now is None:
        raise ValueError("retention.now is not resolved (Retention.at(now) first)")
    since = np.full(n, np.nan) if bullets.since is None else np.asarray(bullets.since, dtype=np.float64)
    age = retention.now.timestamp() - since
    known = ~np.isnan(age)
    r = None
    effective = s
    if retention.half_life is not None:
        r = retention_factor(age, bullets.recalls, retention.half_life, retention.recall_boost)
        effective = s * r
    expired = np.zeros(n, dtype=bool)
    if retention.max_age is not None:
        expired = known & (np.nan_to_num(age, nan=-np.inf) > retention.max_age)
    return Standing(effective, r, expired, pinned, known)
