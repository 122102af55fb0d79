"""Across seeds and against the baseline: mean ± std over seeds, Wilcoxon over sessions, paired t over seeds."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd
from scipy import stats

from memprune import stages as registry


def aggregate(values: dict[int, float]) -> dict[str, Any]:
    """Mean and sample std (ddof=1) over seeds of one number; NaN seeds are left out and counted."""
    arr = np.array([v for v in values.values()], dtype=np.float64)
    ok = np.isfinite(arr)
    return {
        "mean": float(arr[ok].mean()) if ok.any() else math.nan,
        "std": float(arr[ok].std(ddof=1)) if ok.sum() >= 2 else math.nan,
        "n_seeds": int(ok.sum()),
        "per_seed": {str(k): v for k, v in values.items()},
    }


def wilcoxon_sessions(a: pd.Series, b: pd.Series) -> dict[str, Any]:
    """Two-sided Wilcoxon signed-rank test of a - b over the sessions where both are defined.

    Zero differences are dropped (scipy's 'wilcox' method). All differences zero gives
    p = 1 (no evidence of a difference); fewer than one non-zero pair gives NaN.
    """
    both = pd.concat([a.rename("a"), b.rename("b")], axis=1, join="inner").dropna()
    diff = (both["a"] - both["b"]).to_numpy()
    res: dict[str, Any] = {"test": "wilcoxon", "n_sessions": int(len(diff)),
                           "median_diff": float(np.median(diff)) if len(diff) else math.nan}
    if len(diff) == 0:
        return {**res, "statistic": math.nan, "p": math.nan, "note": "no paired sessions"}
    if not np.any(diff != 0):
        return {**res, "statistic": math.nan, "p": 1.0, "note": "all differences zero"}
    nonzero = np.abs(diff[diff != 0])
    if len(diff) <= 13 and (len(nonzero) < len(diff) or len(np.unique(nonzero)) < len(nonzero)):
        # scipy's method here: the exact permutation test over the 2**n sign flips, one Python call per flip
        # (1 s a test on 2 CPUs, 40 of them in a small evaluation); the same p from every flip at once
        statistic, p = signed_rank_permutation_test(diff)
        return {**res, "statistic": statistic, "p": p, "note": ""}
    r = stats.wilcoxon(diff, zero_method="wilcox", alternative="two-sided")
    return {**res, "statistic": float(r.statistic), "p": float(r.pvalue), "note": ""}


def signed_rank_permutation_test(diff: np.ndarray) -> tuple[float, float]:
    """scipy's two-sided signed-rank statistic (the smaller of the positive and negative rank sums) and its p under
    every sign flip of the non-zero differences (zeros dropped, tied |differences| given their mean rank), as
    `scipy.stats.permutation_test` counts it: 2 * the smaller tail, ties with the observed rank sum within 100 ulp
    included. For n <= 13 (at most 8192 flips)."""
    d = diff[diff != 0]
    ranks = stats.rankdata(np.abs(d))
    observed = float(ranks[d > 0].sum())
    flips = (np.arange(2 ** len(d))[:, None] >> np.arange(len(d))) & 1  # every subset of positive signs
    null = flips @ ranks
    gamma = abs(observed) * np.finfo(np.float64).eps * 100
    less, greater = np.mean(null <= observed + gamma), np.mean(null >= observed - gamma)
    return min(observed, float(ranks.sum()) - observed), float(min(1.0, 2 * min(less, greater)))


def paired_seed_test(a: dict[int, float], b: dict[int, float]) -> dict[str, Any]:
    """Two-sided paired t-test over the seeds both stages have (seed k against seed k).

    Needs 2+ common seeds with finite values; identical differences give NaN (t undefined)
    unless they are all zero (p = 1).
    """
    seeds = sorted(set(a) & set(b))
    pairs = [(a[k], b[k]) for k in seeds if np.isfinite(a[k]) and np.isfinite(b[k])]
    res: dict[str, Any] = {"test": "paired t-test over seeds", "n_seeds": len(pairs)}
    if len(pairs) < 2:
        return {**res, "statistic": math.nan, "p": math.nan, "note": "needs >= 2 common seeds"}
    x = np.array(pairs)
    d = x[:, 0] - x[:, 1]
    if np.all(d == d[0]):
        p = 1.0 if d[0] == 0 else math.nan
        return {**res, "statistic": math.nan, "p": p, "note": "constant difference over seeds"}
    r = stats.ttest_rel(x[:, 0], x[:, 1])
    return {**res, "statistic": float(r.statistic), "p": float(r.pvalue), "note": ""}


# (stage, the stage it starts from): every `init_from` of memprune/stages.py
STARTS: tuple[tuple[str, str], ...] = registry.starts()


def comparisons(stages: Sequence[str], baseline: str,
                starts: Sequence[tuple[str, str]] = STARTS) -> list[tuple[str, str]]:
    """(stage, reference) pairs to test: every stage against the baseline, and each stage against its start."""
    pairs = [(s, baseline) for s in stages if s != baseline and baseline in stages]
    pairs += [(s, start) for s, start in starts if s in stages and start in stages and (s, start) not in pairs]
    return pairs

