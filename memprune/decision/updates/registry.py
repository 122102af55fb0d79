"""The update judges' registry (`UPDATE_JUDGES`) and what a judge is given (`Pairs`); imports no judge."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Pairs:
    """Candidate pairs: the earlier texts `a`, the later texts `b`, their cosine, the scorer's encoder
    (`encode(texts) -> embeddings`, None where no encoder is at hand) and the texts' embeddings from the scoring
    pass (`ea`, `eb`; None: a judge that needs them encodes the texts)."""

    a: Sequence[str]
    b: Sequence[str]
    cosine: np.ndarray
    encode: Callable[[list[str]], np.ndarray] | None = None
    ea: np.ndarray | None = None
    eb: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.a)


@dataclass(frozen=True)
class UpdateJudgeEntry:
    """One update judge: its name (`supersede.judge`), what it is, and `judge(pairs, settings)` (settings: the rule's
    `Supersede`) -> per pair 1 (B updates A), 0 (it does not) or `NO_VERDICT` (no answer: counted, not an update).
    `needs_llm`: it reads `settings.llm_settings()` (an LLM config is then required)."""

    name: str
    description: str
    judge: Callable[[Pairs, Any], np.ndarray]
    needs_encoder: bool = False
    needs_llm: bool = False


NO_VERDICT = -1


UPDATE_JUDGES: dict[str, UpdateJudgeEntry] = {}


def register(entry: UpdateJudgeEntry) -> UpdateJudgeEntry:
    """Add an update judge to `UPDATE_JUDGES` (each judge module registers its own entry)."""
    if entry.name in UPDATE_JUDGES and UPDATE_JUDGES[entry.name] is not entry:
        raise ValueError(f"update judge {entry.name!r} registered twice")
    UPDATE_JUDGES[entry.name] = entry
    return entry


def update_judge(name: str) -> UpdateJudgeEntry:
    """The registered judge `name`; ValueError naming the known ones otherwise."""
    if name not in UPDATE_JUDGES:
        raise ValueError(f"unknown update judge {name!r} (known: {', '.join(UPDATE_JUDGES)})")
    return UPDATE_JUDGES[name]

