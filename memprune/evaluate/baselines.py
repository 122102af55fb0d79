"""Question-evidence retention and the heuristic baselines every retention report shows beside a scorer (issue 54).

Retention at budget q: each session keeps the top ceil(q * n) of its n bullets by score (no dedup; ties go to the
earlier bullet), and the figure is the share of the question-cited bullets (those whose evidence turn a question
cites) that are kept. The heuristics are rules a learned scorer must beat to be worth running, one registry entry
each:

- `random`: a seeded random order (the mean over `draws` draws);
- `longest`: the longest text first;
- `most digits`: the text with most digits first (numbers, dates, times);
- `first in session`: the bullet whose evidence comes earliest in the session first;
- `newest`: the bullet whose evidence comes latest first (a bullet with several evidence turns is placed by its
  earliest one, as for `first in session`; a bullet without a turn position comes last in both).
"""

from __future__ import annotations

import math
import re
from typing import Callable

import numpy as np
import pandas as pd

from memprune.decision.ranking import rank_within_groups

TURN_SUFFIX = re.compile(r":t(\d+)$")  # a turn id's position in its session (schema.turn_id)
BUDGETS = (0.4, 0.2)


def evidence_position(evidence: list[str]) -> float:
    """The earliest turn index a bullet's evidence names (inf when none parses)."""
    found = [int(m.group(1)) for e in evidence if (m := TURN_SUFFIX.search(str(e)))]
    return float(min(found)) if found else math.inf


def retention(frame: pd.DataFrame, scores: np.ndarray, q: float) -> float:
    """Share of the cited bullets (`frame.cited`) kept when each session (`conversation_id`, `session_index`) keeps
    its top ceil(q * n) bullets by `scores` (ties: the earlier row)."""
    scores = np.asarray(scores, dtype=np.float64)
    if len(scores) != len(frame):
        raise ValueError(f"{len(scores)} scores for {len(frame)} bullets")
    cited = frame["cited"].to_numpy(dtype=bool)
    if not cited.any():
        return math.nan
    group = frame.groupby(["conversation_id", "session_index"], sort=False).ngroup().to_numpy()
    rank = rank_within_groups(scores, group)
    keep = rank < np.ceil(q * np.bincount(group)[group] - 1e-9)
    return float(keep[cited].mean())


def _digits(frame: pd.DataFrame) -> np.ndarray:
    return frame["text"].map(lambda t: sum(c.isdigit() for c in t)).to_numpy(dtype=np.float64)


def _position(frame: pd.DataFrame) -> np.ndarray:
    return frame["evidence"].map(evidence_position).to_numpy(dtype=np.float64)


HEURISTICS: dict[str, Callable[[pd.DataFrame], np.ndarray]] = {
    "longest": lambda f: f["text"].str.len().to_numpy(dtype=np.float64),
    "most digits": _digits,
    "first in session": lambda f: -_position(f),
    "newest": lambda f: np.nan_to_num(_position(f), posinf=-1.0),
}


def baseline_retention(frame: pd.DataFrame, budgets: tuple[float, ...] = BUDGETS, draws: int = 20,
                       seed: int = 0) -> dict[str, dict[str, float]]:
    """name -> {"q=0.4": share, ...} for random (mean of `draws` seeded draws) and every heuristic."""
    rng = np.random.default_rng(seed)
    draws_ = [rng.random(len(frame)) for _ in range(draws)]
    out = {"random": {f"q={q}": float(np.mean([retention(frame, d, q) for d in draws_])) for q in budgets}}
    for name, rule in HEURISTICS.items():
        s = rule(frame)
        out[name] = {f"q={q}": retention(frame, s, q) for q in budgets}
    return out


def lift(scorer: dict[str, float], baselines: dict[str, dict[str, float]]) -> dict[str, float]:
    """Per budget, the scorer's retention minus the best baseline's (percentage points as a share)."""
    return {k: v - max(b[k] for b in baselines.values()) for k, v in scorer.items()}
