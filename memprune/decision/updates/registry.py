"""The update judges' registry (`UPDATE_JUDGES`) and what a judge is given (`Pairs`); imports no judge."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from memprune.registry import Registry


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


UPDATE_JUDGES: Registry[UpdateJudgeEntry] = Registry("update judge")


def register(entry: UpdateJudgeEntry) -> UpdateJudgeEntry:
    """Add an update judge to `UPDATE_JUDGES` (each judge module registers its own entry)."""
    return UPDATE_JUDGES.add(entry.name, entry)


def update_judge(name: str) -> UpdateJudgeEntry:
    """The registered judge `name`; ValueError naming the known ones otherwise."""
    return UPDATE_JUDGES.known(name)

