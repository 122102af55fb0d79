"""`Bullets`: everything the decision knows about a set of bullets, as one value (numpy arrays, one row each).

The batch job builds it from a block of its table, `MemoryPruner` from mappings or a small table, the service from
a request, `memprune evaluate` from predictions. What a rule needs and a caller did not give is one error
(`memprune.decision.decide.prepare`), never a silent default.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import numpy as np

from memprune.decision.ranking import group_codes

Encode = Callable[[list[str]], np.ndarray]


@dataclass(frozen=True)
class Bullets:
    """Per bullet (row i of every array given):

    - `scores` (float64) and `groups` (int codes: `Bullets.of` codes any group keys);
    - `order`: the tie-break (ascending; default the position), `tokens`: token counts (the budget policy);
    - `texts` and `embeddings` (the scorer's; duplicates and supersession), `encode`: the scorer's encoder for
      an update judge that needs it;
    - `since` (epoch seconds of the last access, else the bullet's time, else its session's; NaN unknown) and
      `recalls`: forgetting and expiry; `pinned`: never dropped;
    - `scope` (codes), `subject`, `when` (the bullet's own time, else its session's; NaN unknown) and `session`
      (its session index; NaN unknown): supersession.
    """

    scores: np.ndarray
    groups: np.ndarray
    order: np.ndarray | None = None
    tokens: np.ndarray | None = None
    texts: Sequence[str] | None = None
    embeddings: np.ndarray | None = None
    encode: Encode | None = None
    since: np.ndarray | None = None
    recalls: np.ndarray | None = None
    pinned: np.ndarray | None = None
    scope: np.ndarray | None = None
    subject: Sequence[Any] | None = None
    when: np.ndarray | None = None
    session: np.ndarray | None = None

    @classmethod
    def of(cls, scores: Any, groups: Any = None, **given: Any) -> "Bullets":
        """Bullets from scores and group keys (any hashable keys, or None: one group), every other field as named;
        arrays of another length than the scores are a ValueError naming the field."""
        s = np.asarray(scores, dtype=np.float64)
        if s.ndim != 1:
            raise ValueError(f"scores must be 1-D, got shape {s.shape}")
        codes = np.zeros(len(s), dtype=np.int64) if groups is None else group_codes(groups)
        out = cls(s, codes, **given)
        for f in fields(cls):
            value = getattr(out, f.name)
            if f.name != "encode" and value is not None and len(value) != len(s):
                raise ValueError(f"{f.name} ({len(value)}) and scores ({len(s)}) differ in length")
        return out

    def __len__(self) -> int:
        return len(self.scores)

    def with_(self, **changes: Any) -> "Bullets":
        return replace(self, **changes)

    @property
    def pins(self) -> np.ndarray:
        """The pinned flags (all False when none were given)."""
        return np.zeros(len(self), dtype=bool) if self.pinned is None else np.asarray(self.pinned, dtype=bool)
