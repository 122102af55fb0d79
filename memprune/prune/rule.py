"""The pruning rule of DESIGN step 5 as pure functions, shared by `evaluate` and `prune`.

Rule: drop every bullet whose score is below `threshold`, then keep at most `top_k`
bullets per group (session). Within a group bullets are ranked by score, higher
first; equal scores are broken by position, earlier first (the position in the
input arrays, or the ascending value of `order` when given), so the result is fully
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


def prune_mask(
    scores: Sequence[float] | np.ndarray,
    groups: Sequence[Any] | np.ndarray,
    threshold: float | None = 0.5,
    top_k: int | None = 5,
    order: Sequence[Any] | np.ndarray | None = None,
) -> np.ndarray:
    """Boolean keep-mask: score >= `threshold` and among the `top_k` highest of its group.

    `threshold=None` disables the threshold, `top_k=None` the per-group cap. Ties in
    score are broken by `order` (ascending) when given, else by array position.
    Raises `ValueError` on NaN scores, mismatched lengths or a negative `top_k`.
    """
    s = np.asarray(scores, dtype=np.float64)
    if s.ndim != 1:
        raise ValueError(f"scores must be 1-D, got shape {s.shape}")
    codes = group_codes(groups)
    if len(codes) != len(s):
        raise ValueError(f"scores ({len(s)}) and groups ({len(codes)}) differ in length")
    if np.isnan(s).any():
        raise ValueError(f"{int(np.isnan(s).sum())} NaN score(s): clean the scores before pruning")
    if top_k is not None and top_k < 0:
        raise ValueError(f"top_k must be >= 0 or None, got {top_k}")
    keep = np.ones(len(s), dtype=bool) if threshold is None else s >= threshold
    if top_k is not None and len(s):
        ord_arr = None
        if order is not None:
            ord_arr = np.asarray(order)
            if len(ord_arr) != len(s):
                raise ValueError(f"order ({len(ord_arr)}) and scores ({len(s)}) differ in length")
        # Bullets passing the threshold sort before those failing it inside a group, so the
        # rank among all bullets equals the rank among the passing ones.
        keep &= rank_within_groups(s, codes, ord_arr) < top_k
    return keep


def setting_name(threshold: float | None, top_k: int | None) -> str:
    """Stable key of a pruning setting, e.g. 't0.5_k5' or 't0.5_kall' (prune.json and metrics.json)."""
    t = "none" if threshold is None else f"{threshold:g}"
    return f"t{t}_k{'all' if top_k is None else top_k}"
