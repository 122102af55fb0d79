"""Paired bootstrap intervals of the memory evaluations (pure numpy).

The evaluated items (target turns, questions) are resampled with replacement (seeded); the same
resamples serve every condition, so differences between conditions get paired intervals.
Intervals are percentile intervals. Metric-specific resampling (corpus BLEU, MAUVE) lives with
its metric and feeds the same `with_interval` / `comparisons`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np


def bootstrap_indices(n: int, samples: int, seed: int) -> np.ndarray:
    """`samples` resamples (with replacement) of range(n), int64 [samples, n]; the same for every condition."""
    if samples < 0:
        raise ValueError(f"bootstrap samples must be >= 0, got {samples}")
    rng = np.random.default_rng(seed)
    return rng.integers(0, n, size=(samples, n), dtype=np.int64) if n else np.zeros((samples, 0), dtype=np.int64)


def mean_bootstrap(values: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """Mean of per-item values over each resample."""
    return np.asarray(values, dtype=np.float64)[idx].mean(axis=1) if idx.size else np.zeros(len(idx))


def percentile_ci(values: np.ndarray, confidence: float) -> list[float] | None:
    """The percentile interval [lo, hi] of bootstrap values (None when there are none or NaN)."""
    values = np.asarray(values, dtype=np.float64)
    if values.size == 0 or not np.all(np.isfinite(values)):
        return None
    alpha = (1.0 - confidence) / 2.0
    lo, hi = np.quantile(values, [alpha, 1.0 - alpha])
    return [float(lo), float(hi)]


def with_interval(point: float | None, boot: np.ndarray | None, confidence: float) -> dict[str, Any]:
    """`{"value": point, "ci": [lo, hi] or None}`: a point value with its bootstrap percentile interval."""
    return {"value": point, "ci": None if boot is None or point is None else percentile_ci(boot, confidence)}


def paired_difference(point_a: float, point_b: float, boot_a: np.ndarray | None, boot_b: np.ndarray | None,
                      confidence: float) -> dict[str, Any]:
    """A - B with the interval of the paired resample differences and P>0 (share of resamples where A is higher).

    `boot_a` and `boot_b` must come from the same resamples (`bootstrap_indices`); without them
    (or of different lengths) only the point difference is given.
    """
    delta = point_a - point_b
    if boot_a is None or boot_b is None or len(boot_a) != len(boot_b) or not len(boot_a):
        return {"delta": delta, "ci": None, "p_better": None}
    d = np.asarray(boot_a, dtype=np.float64) - np.asarray(boot_b, dtype=np.float64)
    return {"delta": delta, "ci": percentile_ci(d, confidence), "p_better": float(np.mean(d > 0))}


def comparison_pairs(conditions: Sequence[str]) -> list[tuple[str, str]]:
    """The paired differences reported: pruned against every other condition, and all memory against none."""
    pairs = [("pruned", c) for c in conditions if c != "pruned" and "pruned" in conditions]
    if "all" in conditions and "none" in conditions:
        pairs.append(("all", "none"))
    return pairs


def comparisons(points: Mapping[str, Mapping[str, float | None]], boots: Mapping[str, Mapping[str, np.ndarray]],
                conditions: Sequence[str], metrics: Sequence[str], confidence: float) -> dict[str, dict[str, Any]]:
    """`{"A-B": {metric: paired_difference}}` for `comparison_pairs(conditions)`, metrics with both points only."""
    out: dict[str, dict[str, Any]] = {}
    for a, b in comparison_pairs(conditions):
        comp: dict[str, Any] = {}
        for m in metrics:
            pa, pb = points[a].get(m), points[b].get(m)
            if pa is not None and pb is not None:
                comp[m] = paired_difference(pa, pb, boots[a].get(m), boots[b].get(m), confidence)
        out[f"{a}-{b}"] = comp
    return out
