"""Evaluation metrics of the scorer: global regression and session-level ranking (DESIGN step 4).

Conventions shared by every function here:

- `labels` are the graded pseudo labels y_i in [0, 1], `scores` the predictions y_hat_i.
- An undefined value is returned as NaN (never silently 0), so callers can count the
  sessions a metric used; `summarize_sessions` reports those counts and the reasons.
- Ties in `scores` are handled as an expectation over a uniformly random order of the
  tied bullets (the "tie-averaged" convention of scikit-learn's `ndcg_score`). A top-k
  metric therefore never depends on the input order of the bullets. Ties in `labels`
  get average ranks (Spearman) or all count as "top" (Hit@k).

Global regression (over all test bullets at once):

- MSE = mean (y - y_hat)^2, MAE = mean |y - y_hat|, RMSE = sqrt(MSE)  (scikit-learn).
- Pearson r and Spearman rho (Pearson r of the average ranks)  (scipy). NaN when fewer
  than 2 bullets or either side is constant.

Session-level ranking (per session, then averaged over sessions). Every one of them
needs at least 2 bullets in the session (a single bullet is always ranked first);
smaller sessions are left out of the ranking metrics but kept in the regression ones.

- Spearman: scipy's rho between labels and scores within the session. Undefined (NaN)
  when the labels are constant. When the scores are constant but the labels are not,
  the value is 0: a constant prediction carries no order, and 0 is the expected rho
  under a random tie-break.
- NDCG@k: DCG@k / IDCG@k with the labels as linear gains and 1/log2(rank+1) discounts,
  ties averaged: the definition of scikit-learn's `ndcg_score` (tested equal), computed
  in numpy for speed. Undefined when every label is 0 (IDCG = 0).
- Hit@k: probability that one of the session's top-labelled bullets (label equal to the
  session's maximum label) is among the predicted top k. Undefined when the labels are
  constant (no bullet stands out).
- Precision@k and Recall@k with relevant = label >= `threshold` (0.5 by default):
  E[relevant in top k] / min(k, n) and E[relevant in top k] / n_relevant. Dividing by
  min(k, n) means a session with n < k bullets can still reach precision 1. Both are
  undefined for sessions without any relevant bullet (recall would be 0/0 and precision
  0 for every model, which says nothing about the ranking).

For k >= n the predicted top k is the whole session.

Classification (over all bullets at once): ROC AUC of the scores for relevance
(label >= threshold) and, when the corpus has QA evidence, for being QA-cited. NaN when
only one class is present.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd
from scipy import stats
from sklearn.metrics import mean_absolute_error, mean_squared_error

from memprune.decision import group_codes

KS: tuple[int, ...] = (1, 3, 5)
RELEVANCE_THRESHOLD = 0.5
REGRESSION_METRICS: tuple[str, ...] = ("mse", "mae", "rmse", "pearson", "spearman")
SESSION_ERROR_METRICS: tuple[str, ...] = ("mse", "mae", "rmse")
CLASSIFICATION_METRICS: tuple[str, ...] = ("auc", "qa_auc")

ArrayLike = Sequence[float] | np.ndarray


def _pair(labels: ArrayLike, scores: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    """Two finite 1-D float arrays of equal length, or a ValueError saying what is wrong."""
    y = np.asarray(labels, dtype=np.float64)
    s = np.asarray(scores, dtype=np.float64)
    if y.ndim != 1 or s.ndim != 1:
        raise ValueError(f"labels and scores must be 1-D, got shapes {y.shape} and {s.shape}")
    if len(y) != len(s):
        raise ValueError(f"labels ({len(y)}) and scores ({len(s)}) differ in length")
    if not (np.isfinite(y).all() and np.isfinite(s).all()):
        raise ValueError("labels and scores must be finite (no NaN or inf)")
    return y, s


def _constant(x: np.ndarray) -> bool:
    return bool(len(x) == 0 or np.all(x == x[0]))


# ---------------------------------------------------------------- global regression


def mse(labels: ArrayLike, scores: ArrayLike) -> float:
    """Mean squared error, mean (y - y_hat)^2; NaN for no bullets."""
    y, s = _pair(labels, scores)
    return float(mean_squared_error(y, s)) if len(y) else math.nan


def mae(labels: ArrayLike, scores: ArrayLike) -> float:
    """Mean absolute error, mean |y - y_hat|; NaN for no bullets."""
    y, s = _pair(labels, scores)
    return float(mean_absolute_error(y, s)) if len(y) else math.nan


def rmse(labels: ArrayLike, scores: ArrayLike) -> float:
    """Root mean squared error, sqrt(MSE); NaN for no bullets."""
    return math.sqrt(mse(labels, scores)) if len(labels) else math.nan


def pearson(labels: ArrayLike, scores: ArrayLike) -> float:
    """Pearson's r (scipy); NaN with fewer than 2 bullets or a constant side."""
    y, s = _pair(labels, scores)
    if len(y) < 2 or _constant(y) or _constant(s):
        return math.nan
    return float(stats.pearsonr(y, s).statistic)


def spearman(labels: ArrayLike, scores: ArrayLike) -> float:
    """Spearman's rho (scipy; ties get average ranks); NaN with < 2 bullets or a constant side."""
    y, s = _pair(labels, scores)
    if len(y) < 2 or _constant(y) or _constant(s):
        return math.nan
    return float(stats.spearmanr(y, s).statistic)


def regression_metrics(labels: ArrayLike, scores: ArrayLike) -> dict[str, float]:
    """MSE, MAE, RMSE, Pearson and Spearman over all bullets at once."""
    return {
        "mse": mse(labels, scores),
        "mae": mae(labels, scores),
        "rmse": rmse(labels, scores),
        "pearson": pearson(labels, scores),
        "spearman": spearman(labels, scores),
    }


def roc_auc(targets: Sequence[bool] | np.ndarray, scores: ArrayLike) -> float:
    """ROC AUC of `scores` for the binary `targets` (scikit-learn; ties count one half); NaN with one class.

    The probability that a random positive bullet scores above a random negative one: 0.5 is
    chance, whatever the share of positives, so it compares label sources of different balance.
    """
    from sklearn.metrics import roc_auc_score

    t = np.asarray(targets, dtype=bool)
    s = np.asarray(scores, dtype=np.float64)
    if t.ndim != 1 or len(t) != len(s):
        raise ValueError(f"targets ({t.shape}) and scores ({s.shape}) must be 1-D of equal length")
    if not np.isfinite(s).all():
        raise ValueError("scores must be finite (no NaN or inf)")
    if t.all() or not t.any():
        return math.nan
    return float(roc_auc_score(t, s))


def classification_metrics(labels: ArrayLike, scores: ArrayLike, threshold: float = RELEVANCE_THRESHOLD,
                           cited: Sequence[bool] | np.ndarray | None = None) -> dict[str, float]:
    """AUC of the scores for relevance (label >= threshold) and, with `cited`, for QA citation.

    `auc` ranks against the labels the run was trained on; `qa_auc` against an external target
    (the bullet's evidence is cited by a QA item), which pseudo labels cannot give.
    """
    y, s = _pair(labels, scores)
    out = {"auc": roc_auc(y >= threshold, s), "positives": float((y >= threshold).sum())}
    if cited is not None:
        c = np.asarray(cited, dtype=bool)
        out["qa_auc"] = roc_auc(c, s)
        out["qa_positives"] = float(c.sum())
    return out


# ---------------------------------------------------------------- one session


def _top_k_split(scores: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Masks of the bullets surely in the top k (`above`) and of the tie group at the cut, and its free slots.

    The top k under a random tie-break contains every bullet scoring above the k-th
    highest score, plus `slots` bullets drawn uniformly from those equal to it.
    """
    n = len(scores)
    if k >= n:
        return np.ones(n, dtype=bool), np.zeros(n, dtype=bool), 0
    cut = np.sort(scores)[::-1][k - 1]
    above = scores > cut
    tied = scores == cut
    return above, tied, k - int(above.sum())


def expected_in_top_k(mask: ArrayLike, scores: ArrayLike, k: int) -> float:
    """Expected number of `mask` bullets in the predicted top k, ties broken uniformly at random."""
    m = np.asarray(mask, dtype=bool)
    s = np.asarray(scores, dtype=np.float64)
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    above, tied, slots = _top_k_split(s, k)
    count = float((m & above).sum())
    if slots:
        count += slots * (m & tied).sum() / tied.sum()
    return count


def session_spearman(labels: ArrayLike, scores: ArrayLike) -> float:
    """Spearman's rho inside one session; NaN if < 2 bullets or constant labels, 0 if constant scores."""
    y, s = _pair(labels, scores)
    if len(y) < 2 or _constant(y):
        return math.nan
    if _constant(s):
        return 0.0
    return float(stats.spearmanr(y, s).statistic)


def _discounts(n: int, k: int) -> np.ndarray:
    """1/log2(rank+1) for ranks 1..n, zero beyond rank k."""
    d = 1.0 / np.log2(np.arange(n) + 2.0)
    d[k:] = 0.0
    return d


def _tie_averaged_dcg(y: np.ndarray, s: np.ndarray, discounts: np.ndarray) -> float:
    """DCG where each group of tied scores gets its mean gain on every position it spans.

    This is the expected DCG under a random order of the tied bullets, and the same
    computation as scikit-learn's `ndcg_score(..., ignore_ties=False)`.
    """
    _, inv, counts = np.unique(-s, return_inverse=True, return_counts=True)
    gains = np.bincount(inv, weights=y, minlength=len(counts)) / counts
    cum = np.cumsum(discounts)[np.cumsum(counts) - 1]
    return float(np.sum(gains * np.diff(np.r_[0.0, cum])))


def ndcg_at_k(labels: ArrayLike, scores: ArrayLike, k: int) -> float:
    """NDCG@k with the labels as linear gains, ties averaged; NaN if < 2 bullets or all labels 0.

    Equal to scikit-learn's `ndcg_score([labels], [scores], k=k)` (a test checks it);
    computed here in numpy because the per-call input validation of scikit-learn
    dominates the run time over thousands of small sessions.
    """
    y, s = _pair(labels, scores)
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if (y < 0).any():
        raise ValueError("NDCG needs non-negative labels (gains)")
    if len(y) < 2 or not (y > 0).any():
        return math.nan
    d = _discounts(len(y), k)
    ideal = float(np.sum(np.sort(y)[::-1] * d))
    return _tie_averaged_dcg(y, s, d) / ideal


def hit_at_k(labels: ArrayLike, scores: ArrayLike, k: int) -> float:
    """P(a top-labelled bullet is in the predicted top k); NaN if < 2 bullets or constant labels."""
    y, s = _pair(labels, scores)
    if len(y) < 2 or _constant(y):
        return math.nan
    top = y == y.max()
    above, tied, slots = _top_k_split(s, k)
    if (top & above).any():
        return 1.0
    r, g = int((top & tied).sum()), int(tied.sum())
    if slots == 0 or r == 0:
        return 0.0
    # Drawing `slots` of the g tied bullets misses all r top ones with C(g-r, slots) / C(g, slots).
    return 1.0 - math.comb(g - r, slots) / math.comb(g, slots)


def precision_at_k(labels: ArrayLike, scores: ArrayLike, k: int, threshold: float = RELEVANCE_THRESHOLD) -> float:
    """E[relevant in top k] / min(k, n), relevant = label >= threshold; NaN if < 2 bullets or none relevant."""
    y, s = _pair(labels, scores)
    rel = y >= threshold
    if len(y) < 2 or not rel.any():
        return math.nan
    return expected_in_top_k(rel, s, k) / min(k, len(y))


def recall_at_k(labels: ArrayLike, scores: ArrayLike, k: int, threshold: float = RELEVANCE_THRESHOLD) -> float:
    """E[relevant in top k] / n_relevant, relevant = label >= threshold; NaN if < 2 bullets or none relevant."""
    y, s = _pair(labels, scores)
    rel = y >= threshold
    if len(y) < 2 or not rel.any():
        return math.nan
    return expected_in_top_k(rel, s, k) / rel.sum()


# ---------------------------------------------------------------- many sessions


def session_spearman_rows(labels: np.ndarray, scores: np.ndarray) -> np.ndarray:
    """`session_spearman` for many equal-size sessions at once (rows of 2-D arrays), vectorised.

    Spearman's rho is Pearson's r of the average ranks (scipy `rankdata`), which is what
    `scipy.stats.spearmanr` computes; doing it row-wise avoids one scipy call per session.
    """
    y = np.asarray(labels, dtype=np.float64)
    s = np.asarray(scores, dtype=np.float64)
    out = np.full(y.shape[0], math.nan)
    if y.shape[1] < 2:
        return out
    ry = stats.rankdata(y, axis=1)
    rs = stats.rankdata(s, axis=1)
    ry -= ry.mean(axis=1, keepdims=True)
    rs -= rs.mean(axis=1, keepdims=True)
    vy, vs = (ry**2).sum(axis=1), (rs**2).sum(axis=1)
    ok = (vy > 0) & (vs > 0)
    out[ok] = np.clip((ry[ok] * rs[ok]).sum(axis=1) / np.sqrt(vy[ok] * vs[ok]), -1.0, 1.0)
    out[(vy > 0) & (vs == 0)] = 0.0
    return out


def ranking_metric_names(ks: Sequence[int] = KS) -> list[str]:
    """Column names of the session ranking metrics, in report order."""
    names = ["spearman"]
    for family in ("ndcg", "hit", "precision", "recall"):
        names += [f"{family}@{k}" for k in ks]
    return names


def per_session_metrics(
    labels: ArrayLike,
    scores: ArrayLike,
    groups: Sequence[Any] | np.ndarray,
    ks: Sequence[int] = KS,
    threshold: float = RELEVANCE_THRESHOLD,
) -> pd.DataFrame:
    """One row per session (group key as index): size, label facts, errors and every ranking metric.

    Columns: n_bullets, n_relevant, labels_constant, labels_all_zero, mse, mae, rmse and
    `ranking_metric_names(ks)`; an undefined metric is NaN.
    """
    y, s = _pair(labels, scores)
    codes = group_codes(groups)
    if len(codes) != len(y):
        raise ValueError(f"groups ({len(codes)}) and labels ({len(y)}) differ in length")
    columns = ["n_bullets", "n_relevant", "labels_constant", "labels_all_zero", *SESSION_ERROR_METRICS,
               *ranking_metric_names(ks)]
    if len(y) == 0:
        return pd.DataFrame(columns=columns, index=pd.Index([], name="session"))
    keys = list(groups) if not isinstance(groups, np.ndarray) else groups.tolist()
    order = np.argsort(codes, kind="stable")
    bounds = np.r_[0, np.flatnonzero(np.diff(codes[order])) + 1, len(order)]
    rows, index = [], []
    for a, b in zip(bounds[:-1], bounds[1:]):
        idx = order[a:b]
        ys, ss = y[idx], s[idx]
        err = ys - ss
        row: dict[str, Any] = {
            "n_bullets": len(idx),
            "n_relevant": int((ys >= threshold).sum()),
            "labels_constant": _constant(ys),
            "labels_all_zero": not (ys > 0).any(),
            "mse": float(np.mean(err**2)),
            "mae": float(np.mean(np.abs(err))),
            "rmse": float(np.sqrt(np.mean(err**2))),
            "spearman": math.nan,  # filled below, batched by session size
        }
        for k in ks:
            row[f"ndcg@{k}"] = ndcg_at_k(ys, ss, k)
        for k in ks:
            row[f"hit@{k}"] = hit_at_k(ys, ss, k)
        for k in ks:
            row[f"precision@{k}"] = precision_at_k(ys, ss, k, threshold)
        for k in ks:
            row[f"recall@{k}"] = recall_at_k(ys, ss, k, threshold)
        rows.append(row)
        index.append(keys[idx[0]])
    frame = pd.DataFrame(rows, index=pd.Index(index, name="session"))
    sizes = np.diff(bounds)
    for n in np.unique(sizes):
        which = np.flatnonzero(sizes == n)
        idx = np.stack([order[bounds[i] : bounds[i + 1]] for i in which])
        frame.iloc[which, frame.columns.get_loc("spearman")] = session_spearman_rows(y[idx], s[idx])
    return frame[columns]


def exclusion_reasons(frame: pd.DataFrame, metric: str) -> dict[str, int]:
    """Why sessions have no value for `metric`: counts per reason (first matching reason wins)."""
    small = frame["n_bullets"] < 2
    out = {"fewer_than_2_bullets": int(small.sum())}
    family = metric.split("@")[0]
    if family in ("spearman", "hit"):
        out["constant_labels"] = int((~small & frame["labels_constant"].astype(bool)).sum())
    elif family == "ndcg":
        out["all_labels_zero"] = int((~small & frame["labels_all_zero"].astype(bool)).sum())
    elif family in ("precision", "recall"):
        out["no_relevant_bullet"] = int((~small & (frame["n_relevant"] == 0)).sum())
    return {k: v for k, v in out.items() if v}


def summarize_sessions(frame: pd.DataFrame, ks: Sequence[int] = KS) -> dict[str, dict[str, Any]]:
    """Mean of each ranking metric over the sessions where it is defined, with the counts used and left out."""
    out: dict[str, dict[str, Any]] = {}
    for metric in ranking_metric_names(ks):
        values = frame[metric].to_numpy(dtype=np.float64) if len(frame) else np.array([])
        defined = np.isfinite(values)
        out[metric] = {
            "mean": float(values[defined].mean()) if defined.any() else math.nan,
            "n_sessions": int(defined.sum()),
            "n_excluded": int((~defined).sum()),
            "excluded_by": exclusion_reasons(frame, metric) if len(frame) else {},
        }
    return out


# ---------------------------------------------------------------- distributions


def histogram(values: np.ndarray, bins: int) -> dict[str, list[float]]:
    """Counts of `values` in `bins` equal-width bins over [0, 1]."""
    counts, edges = np.histogram(values, bins=bins, range=(0.0, 1.0))
    return {"edges": edges.tolist(), "counts": counts.tolist()}


def calibration(labels: np.ndarray, scores: np.ndarray, bins: int) -> list[dict[str, Any]]:
    """Mean label and mean score per predicted-score bin (equal width over [0, 1]; empty bins omitted)."""
    idx = np.clip((scores * bins).astype(int), 0, bins - 1)
    out = []
    for b in range(bins):
        m = idx == b
        if m.any():
            out.append({"lo": b / bins, "hi": (b + 1) / bins, "n": int(m.sum()),
                        "mean_score": float(scores[m].mean()), "mean_label": float(labels[m].mean())})
    return out
