"""The stores' configs: where a store is (`KIND:LOCATION`), how its columns map, how a decision is applied.

`memprune prune --input mem0:CONFIG|lance:PATH|table:PATH --map id=...,text=...,group=...` carries a
`StoreOptions` inside `PruneConfig.store`; `memprune score` has its own `ScoreConfig`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from memprune.config import ConfigModel
from memprune.errors import MemPruneError
from memprune.prune.config import PruneConfig, ScoringRuntime
from memprune.scorers import ScorerRef, scorer_field

FIELDS = ("id", "text", "group", "time", "pin")  # pin: optional, a boolean column / metadata key
ApplyMode = Literal["none", "delete", "flag"]


class StoreError(MemPruneError):
    """A store that cannot be opened, read, changed or restored; the message names the store and field."""


def parse_map(text: str | None) -> dict[str, str]:
    """`id=memory_id,text=memory,group=user_id,time=created_at,pin=pinned` as a dict; unknown fields are errors."""
    out: dict[str, str] = {}
    for item in (text or "").split(","):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not value:
            raise StoreError(f"--map {text}: item {item.strip()!r} is not FIELD=COLUMN")
        if key not in FIELDS:
            raise StoreError(f"--map {text}: unknown field {key!r} (fields: {', '.join(FIELDS)})")
        out[key] = value
    return out


def check_map(mapping: dict[str, str]) -> dict[str, str]:
    """`mapping` (field -> column) when every field is known; else a ValueError naming the first unknown field."""
    bad = [k for k in mapping if k not in FIELDS]
    if bad:
        raise ValueError(f"unknown map field {bad[0]!r} (fields: {', '.join(FIELDS)})")
    return mapping


class StoreOptions(ConfigModel):
    """How memprune reads an external store and what `--apply` does with the decision."""

    map: dict[str, str] = Field(default_factory=dict,
                                description="field -> store column (id, text, group, time, pin); unset fields take the kind's "
                                "default (pin: none; with pin=COL a record whose COL is true is never dropped)")
    apply: ApplyMode = Field("none", description="none: only write the decision; delete: archive then delete dropped "
                             "records; flag: set memprune_keep / memprune_score where the store has metadata")
    batch: int = Field(256, ge=1, description="records per store call when applying (delete, flag, restore)")

    @field_validator("map")
    @classmethod
    def _fields(cls, v: dict[str, str]) -> dict[str, str]:
        return check_map(v)


class StorePruneConfig(PruneConfig):
    """Config of `memprune prune` and `jobs/prune.py`: a bullets store, or an external store with its options."""

    input: str = Field(description="bullets store: a Parquet file, or a directory of them (a corpus dir: its bullets.parquet); "
                       "or an external store KIND:LOCATION (table:PATH, lance:PATH, mem0:CONFIG; see memprune.stores)")
    store: StoreOptions = Field(default_factory=StoreOptions,
                                description="external stores only: column map, --apply mode (memprune.stores)")

    @model_validator(mode="after")
    def _dry_run_or_apply(self) -> "StorePruneConfig":
        if self.dry_run and self.store.apply != "none":
            raise ValueError("dry_run and store.apply exclude each other: a dry run never changes a store "
                             "(decide without --apply, read prune.md, then --apply)")
        return self

    def bullets_config(self, **paths: Any) -> PruneConfig:
        """The prune stage's own config (validated), optionally with other paths or rule (`input`, `out`, `rule`)."""
        return PruneConfig.model_validate({**self.model_dump(exclude={"store"}), **paths})


class ScoreConfig(ScoringRuntime):
    """`memprune score`: add the scorer's score (and calibrated score) to a store, deciding nothing."""

    scorer: ScorerRef = scorer_field()
    input: str = Field(description="KIND:LOCATION store (table, lance, mem0), or a bullets Parquet path")
    out: str = Field(description="output directory: scores.parquet, score.json, score.md")
    store: StoreOptions = Field(default_factory=StoreOptions)
    write: bool = Field(True, description="write memprune_score (and memprune_score_calibrated) into the store")

    def bullets_config(self, **paths: Any) -> PruneConfig:
        """The prune stage's config that only scores: this runtime, no rule, raw scores (`input`, `out` given)."""
        rule = {"threshold": None, "top_k": None, "group_by": "conversation", "dedup": False, "min_keep": 0}
        return PruneConfig.model_validate({**self.model_dump(include=set(ScoringRuntime.model_fields)),
                                           "scorer": self.scorer, "rule": rule, "score": "raw", **paths})
