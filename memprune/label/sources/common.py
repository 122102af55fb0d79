"""What every label source shares: the `SOURCES` registry, `SourceResult`, the labels table and its counts.

A source is one `LabelSource` entry, declared in its own module (`qa`, `usage`, `judge`) and
registered here; `label/config.py` checks the settings and `label/stage.py` runs a source through
its entry, never by comparing source names.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

from memprune.label.errors import LabelError
from memprune.schema import LABELS


class SourceError(LabelError):
    """A label source cannot be read at all (missing file, missing column); the message names file and field."""


@dataclass
class SourceResult:
    """What a source produced: the labels table, the unlabelled bullets with reasons, and counts."""

    labels: pa.Table
    unlabelled: list[dict[str, Any]]
    counts: dict[str, Any]
    stats: dict[str, Any] = field(default_factory=dict)


def label_counts(n_bullets: int, labels: pa.Table, unlabelled: list[dict[str, Any]],
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



@dataclass
class SourceRun:
    """What a source's `run` hands to `label/stage.py`: its result, its rule and (usage) the ledger summary."""

    result: SourceResult
    rule: str
    ledger: dict[str, Any] | None = None


@dataclass(frozen=True)
class LabelSource:
    """One label source: its name (labels.parquet `source`), what it checks and how it runs."""

    name: str
    description: str
    judged: bool = False  # labels from the judges (`label/stage.py:run_judge`), not from `run`
    check: Callable[[Any], None] | None = None  # (LabelSettings) -> None; ValueError on invalid settings
    # run(cfg, data dir, bullets, inputs digests, OutputSet) -> SourceRun (inputs: add the files it read)
    run: Callable[[Any, Path, pa.Table, dict[str, str], Any], SourceRun] | None = None
    intro: str = ""  # label.md: one line on where its labels come from
    # label.md: its own rows (what, value) of the counts table, from label.json's counts
    rows: Callable[[dict[str, Any]], list[tuple[str, Any]]] = lambda counts: []


SOURCES: dict[str, LabelSource] = {}


def register(source: LabelSource) -> LabelSource:
    """Add a label source to `SOURCES` (each source module registers its own entry)."""
    SOURCES[source.name] = source
    return source
