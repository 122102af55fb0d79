"""Groups and ranking, the decision's arithmetic: group keys as codes, and each bullet's rank in its group.

Within a group bullets are ranked by score, higher first; equal scores are broken by position, earlier first
(the position in the input arrays, or the ascending value of `order` when given), so every decision is fully
deterministic and does not depend on the sort algorithm.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


def group_codes(groups: Sequence[Any] | np.ndarray) -> np.ndarray:
    """Map group keys (strings, ints, tuples such as (conversation_id, session_index)) to int codes."""
    if isinstance(groups, np.ndarray) and groups.dtype != object:
        if groups.ndim != 1:
            raise ValueError(f"groups must be 1-D, got shape {groups.shape}")
        return np.unique(groups, return_inverse=True)[1].astype(np.int64).reshape(-1)
    items = groups.tolist() if isinstance(groups, np.ndarray) else list(groups)
    mapping: dict[Any, int] = {}
    return np.fromiter(
        (mapping.setdefault(tuple(g) if isinstance(g, list) else g, len(mapping)) for g in items),
        dtype=np.int64,
        count=len(items),
    )


def rank_within_groups(
    scores: np.ndarray, codes: np.ndarray, order: np.ndarray | None = None
) -> np.ndarray:
    """0-based rank of each item inside its group: higher score first, then smaller `order`/position."""
    n = len(scores)
    tiebreak = np.arange(n) if order is None else np.asarray(order)
    # np.lexsort sorts by the last key first: group, then -score, then tie-break key.
    idx = np.lexsort((tiebreak, -np.asarray(scores, dtype=np.float64), codes))
    sorted_codes = codes[idx]
    starts = np.r_[0, np.flatnonzero(np.diff(sorted_codes)) + 1]
    group_start = np.repeat(starts, np.diff(np.r_[starts, n]))
    ranks = np.empty(n, dtype=np.int64)
    ranks[idx] = np.arange(n) - group_start
    return ranks


def setting_name(threshold: float | None, top_k: int | None) -> str:
    """Stable key of a pruning setting, e.g. 't0.5_k5' or 't0.5_kall' (prune.json and metrics.json)."""
    t = "none" if threshold is None else f"{threshold:g}"
    return f"t{t}_k{'all' if top_k is None else top_k}"
