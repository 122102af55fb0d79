"""Probability calibration of scorer outputs: raw score -> P(bullet is relevant), fitted on validation data.

A scorer regresses the judge's label, so its raw outputs cluster around the label mean and a
threshold such as 0.5 is a cliff, not a meaning. After each trained stage, `fit_calibration`
maps raw scores to the probability that the label is >= a relevance threshold (default 0.5),
with two candidate maps:

- `isotonic`: centred isotonic regression (pool-adjacent-violators, then linear interpolation
  between the pooled blocks' centres), monotone non-decreasing and strictly increasing between
  its knots, so it keeps the raw ranking except at the two flat ends;
- `platt`: a two-parameter logistic on the raw score's logit, p = sigmoid(a * logit(s) + b).

The kept method is the one with the lower Brier score on the validation split, measured by
cross-fitting inside it (K folds by conversation, so the choice is not an in-sample one); it is
then refitted on the whole validation split. With `select="one_se"` (the default of `memprune
train`) the simpler map (Platt, two parameters) is kept unless isotonic's Brier is lower by more
than one standard error of the paired per-row difference (the one-standard-error rule): isotonic's
many knots overfit the sparse ends of a small validation split, and a difference inside the noise
is no reason to take that risk. The result is stored as `calibration.json` in the
scorer artifact (JSON, never pickle). Pure numpy/scipy: no Ray, no torch.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Sequence

import numpy as np

from memprune.errors import MemPruneError
from memprune.io import write_json

CALIBRATION_FILE = "calibration.json"
CALIBRATION_FORMAT = 1
METHODS = ("isotonic", "platt")
SIMPLER_FIRST = ("platt", "isotonic")  # by number of parameters, for the one-standard-error rule
Select = Literal["lowest", "one_se"]
Method = Literal["isotonic", "platt"]
ScoreMode = Literal["auto", "raw", "calibrated"]
_EPS = 1e-6


class CalibrationError(MemPruneError):
    """A calibration cannot be fitted, read or applied; the message names the file or the reason."""


# ---------------------------------------------------------------- metrics


def relevance(labels: np.ndarray, threshold: float) -> np.ndarray:
    """The binary target of calibration: 1.0 where label >= threshold, else 0.0."""
    return (np.asarray(labels, dtype=np.float64) >= threshold).astype(np.float64)


def brier(probs: np.ndarray, targets: np.ndarray) -> float:
    """Brier score: mean squared difference between predicted probabilities and 0/1 outcomes."""
    p, y = np.asarray(probs, dtype=np.float64), np.asarray(targets, dtype=np.float64)
    return float(np.mean((p - y) ** 2)) if len(p) else math.nan


def reliability_bins(probs: np.ndarray, targets: np.ndarray, bins: int = 10) -> list[dict[str, Any]]:
    """Per equal-width bin of [0, 1] (empty bins omitted): count, mean predicted probability, observed rate."""
    p, y = np.asarray(probs, dtype=np.float64), np.asarray(targets, dtype=np.float64)
    idx = np.clip((p * bins).astype(int), 0, bins - 1)
    out = []
    for b in range(bins):
        m = idx == b
        if m.any():
            out.append({"lo": b / bins, "hi": (b + 1) / bins, "n": int(m.sum()),
                        "mean_prob": float(p[m].mean()), "rate": float(y[m].mean())})
    return out


def ece(probs: np.ndarray, targets: np.ndarray, bins: int = 10) -> float:
    """Expected calibration error: the count-weighted mean |mean probability - observed rate| over equal-width bins."""
    n = len(probs)
    if n == 0:
        return math.nan
    return float(sum(b["n"] * abs(b["mean_prob"] - b["rate"]) for b in reliability_bins(probs, targets, bins)) / n)


# ---------------------------------------------------------------- the two maps


def _pav(x: np.ndarray, y: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Pool adjacent violators on points sorted by x (ties in x pooled first): block centres and block values."""
    _, start = np.unique(x, return_index=True)
    wsum = np.add.reduceat(w, start)
    vals = list(np.add.reduceat(w * y, start) / wsum)
    wts = list(wsum)
    xs = list(np.add.reduceat(w * x, start) / wsum)
    # a stack of blocks: (value, weight, weighted x sum)
    sv: list[float] = []
    sw: list[float] = []
    sx: list[float] = []
    for v, wt, cx in zip(vals, wts, xs):
        sv.append(v)
        sw.append(wt)
        sx.append(cx * wt)
        while len(sv) > 1 and sv[-2] >= sv[-1]:
            v2, w2, x2 = sv.pop(), sw.pop(), sx.pop()
            tw = sw[-1] + w2
            sv[-1] = (sv[-1] * sw[-1] + v2 * w2) / tw
            sx[-1] = sx[-1] + x2
            sw[-1] = tw
    centres = np.asarray(sx) / np.asarray(sw)
    return centres, np.asarray(sv)


def fit_isotonic(scores: np.ndarray, targets: np.ndarray) -> dict[str, list[float]]:
    """Centred isotonic regression of `targets` on `scores`: knots (x, y), strictly increasing in both.

    Adjacent pooled blocks with equal values cannot occur after PAV (a tie is pooled), so the knots
    interpolate strictly monotonically; outside the first/last knot the map is flat.
    """
    s, t = np.asarray(scores, dtype=np.float64), np.asarray(targets, dtype=np.float64)
    order = np.argsort(s, kind="stable")
    x, y = _pav(s[order], t[order], np.ones(len(s)))
    return {"x": [float(v) for v in x], "y": [float(v) for v in y]}


def apply_isotonic(params: dict[str, list[float]], scores: np.ndarray) -> np.ndarray:
    """Linear interpolation between the knots; flat (clipped) outside them."""
    x, y = np.asarray(params["x"], dtype=np.float64), np.asarray(params["y"], dtype=np.float64)
    s = np.asarray(scores, dtype=np.float64)
    return np.interp(s, x, y) if len(x) > 1 else np.full(s.shape, float(y[0]))


def _logit(s: np.ndarray) -> np.ndarray:
    s = np.clip(np.asarray(s, dtype=np.float64), _EPS, 1 - _EPS)
    return np.log(s) - np.log1p(-s)


def fit_platt(scores: np.ndarray, targets: np.ndarray) -> dict[str, float]:
    """Two-parameter logistic p = sigmoid(a * logit(s) + b), fitted by maximum likelihood (L-BFGS)."""
    from scipy.optimize import minimize
    from scipy.special import expit, log_expit

    z, t = _logit(scores), np.asarray(targets, dtype=np.float64)
    mu, sd = float(z.mean()), float(z.std()) or 1.0
    zs = (z - mu) / sd  # standardised for a well-conditioned fit; mapped back below

    def nll(theta: np.ndarray) -> tuple[float, np.ndarray]:
        u = theta[0] * zs + theta[1]
        loss = -np.mean(t * log_expit(u) + (1 - t) * log_expit(-u))
        g = expit(u) - t
        return float(loss), np.array([np.mean(g * zs), np.mean(g)])

    res = minimize(nll, np.zeros(2), jac=True, method="L-BFGS-B")
    a_s, b_s = (float(v) for v in res.x)
    return {"a": a_s / sd, "b": b_s - a_s * mu / sd}


def apply_platt(params: dict[str, float], scores: np.ndarray) -> np.ndarray:
    """sigmoid(a * logit(s) + b) of raw scores."""
    from scipy.special import expit

    return expit(params["a"] * _logit(scores) + params["b"])


_FIT = {"isotonic": fit_isotonic, "platt": fit_platt}
_APPLY = {"isotonic": apply_isotonic, "platt": apply_platt}


# ---------------------------------------------------------------- the stored calibration


@dataclass(frozen=True)
class Calibration:
    """A fitted map from raw scores to P(label >= relevance_threshold), with its validation record."""

    method: Method
    relevance_threshold: float
    params: dict[str, Any]
    validation: dict[str, Any] = field(default_factory=dict)
    settings: dict[str, Any] = field(default_factory=dict)

    def apply(self, scores: np.ndarray | Sequence[float]) -> np.ndarray:
        """Calibrated probabilities (float64, in [0, 1]) of raw scores, in order."""
        s = np.asarray(scores, dtype=np.float64)
        return np.clip(_APPLY[self.method](self.params, s), 0.0, 1.0) if len(s) else np.zeros(0, dtype=np.float64)

    def to_json(self) -> dict[str, Any]:
        return {"format": CALIBRATION_FORMAT, "method": self.method, "relevance_threshold": self.relevance_threshold,
                "params": self.params, "validation": self.validation, "settings": self.settings}

    @classmethod
    def from_json(cls, data: Any, where: str) -> "Calibration":
        """Parse and check a calibration.json document; `where` names the file in errors."""
        if not isinstance(data, dict):
            raise CalibrationError(f"{where}: expected a JSON object")
        if data.get("format") != CALIBRATION_FORMAT:
            raise CalibrationError(f"{where}: calibration format {data.get('format')!r}, this version reads "
                                   f"{CALIBRATION_FORMAT}")
        method, params = data.get("method"), data.get("params")
        if method not in METHODS:
            raise CalibrationError(f"{where}: field 'method' is {method!r}, expected one of {', '.join(METHODS)}")
        thr = data.get("relevance_threshold")
        if not isinstance(thr, (int, float)) or not 0.0 <= thr <= 1.0:
            raise CalibrationError(f"{where}: field 'relevance_threshold' is {thr!r}, expected a number in [0, 1]")
        if not isinstance(params, dict):
            raise CalibrationError(f"{where}: field 'params' is missing or not an object")
        if method == "platt":
            if not all(isinstance(params.get(k), (int, float)) and math.isfinite(params[k]) for k in ("a", "b")):
                raise CalibrationError(f"{where}: platt 'params' need finite numbers 'a' and 'b', got {params}")
        else:
            x, y = params.get("x"), params.get("y")
            ok = isinstance(x, list) and isinstance(y, list) and len(x) == len(y) >= 1
            xa = np.asarray(x if ok else [], dtype=np.float64)
            ya = np.asarray(y if ok else [], dtype=np.float64)
            if not ok or not (np.isfinite(xa).all() and np.isfinite(ya).all()):
                raise CalibrationError(f"{where}: isotonic 'params' need equal-length, non-empty lists 'x' and 'y' "
                                       "of finite numbers")
            if (np.diff(xa) <= 0).any() or (np.diff(ya) < 0).any():
                raise CalibrationError(f"{where}: isotonic knots must increase ('x' strictly, 'y' not decreasing)")
        return cls(method, float(thr), params, dict(data.get("validation") or {}), dict(data.get("settings") or {}))


def read_calibration(artifact: str | os.PathLike[str]) -> Calibration | None:
    """The calibration.json of a scorer artifact directory, checked; None when the artifact has none."""
    path = Path(artifact) / CALIBRATION_FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CalibrationError(f"{path}: not readable JSON ({exc})") from exc
    return Calibration.from_json(data, str(path))


def write_calibration(artifact: str | os.PathLike[str], calibration: Calibration | None) -> Path:
    """Write (atomically) or, with None, remove the artifact's calibration.json, so it never outlives its weights."""
    path = Path(artifact) / CALIBRATION_FILE
    if calibration is None:
        path.unlink(missing_ok=True)
    else:
        write_json(path, calibration.to_json())
    return path


# ---------------------------------------------------------------- fitting with model selection


def _folds(n: int, groups: np.ndarray | None, k: int, seed: int) -> np.ndarray:
    """Fold index per row: whole groups (conversations) dealt to k folds at random, or rows when no groups."""
    rng = np.random.default_rng(seed)
    if groups is None:
        return rng.permutation(n) % k
    uniq, inv = np.unique(np.asarray(groups), return_inverse=True)
    return (rng.permutation(len(uniq)) % k)[inv]


def _cross_fit_units(n: int, groups: np.ndarray | None) -> int:
    """How many units (groups, else rows) the cross-fitting can deal to folds; fewer than 2 is a `CalibrationError`.

    With one group every fold but one is empty and that one has no training rows: the method choice
    would be an in-sample one (or, before this check, a crash on an empty training fold).
    """
    units = n if groups is None else len(np.unique(groups))
    if units < 2:
        raise CalibrationError(f"the validation rows come from {units} conversation(s); cross-fitting the choice of "
                               "method keeps each conversation in one fold and needs at least 2 (raise split.valid)")
    return units


def _summary(p: np.ndarray, y: np.ndarray, bins: int) -> dict[str, float]:
    return {"brier": brier(p, y), "ece": ece(p, y, bins)}


def fit_calibration(
    scores: np.ndarray | Sequence[float],
    labels: np.ndarray | Sequence[float],
    relevance_threshold: float = 0.5,
    groups: np.ndarray | Sequence[Any] | None = None,
    methods: Sequence[str] = METHODS,
    cv_folds: int = 5,
    bins: int = 10,
    min_rows: int = 50,
    seed: int = 0,
    select: Select = "lowest",
) -> Calibration:
    """Fit each method on validation (raw score, label) pairs; keep the one with the lower cross-fitted Brier
    (`select="one_se"`: the simpler one unless the other is lower by more than one standard error).

    `groups` (e.g. conversation ids) keeps a group's rows in one fold. Raises `CalibrationError` when
    the rows cannot support a fit (too few, non-finite, or only one class).
    """
    s = np.asarray(scores, dtype=np.float64)
    lab = np.asarray(labels, dtype=np.float64)
    if s.shape != lab.shape or s.ndim != 1:
        raise CalibrationError(f"scores {s.shape} and labels {lab.shape} must be 1-d and of equal length")
    bad = [m for m in methods if m not in METHODS]
    if bad or not methods:
        raise CalibrationError(f"unknown calibration method(s) {bad or methods}; known: {', '.join(METHODS)}")
    finite = np.isfinite(s) & np.isfinite(lab)
    if not finite.all():
        raise CalibrationError(f"{int((~finite).sum())} validation row(s) with a non-finite score or label")
    y = relevance(lab, relevance_threshold)
    n, pos = len(y), int(y.sum())
    if n < min_rows:
        raise CalibrationError(f"{n} validation rows, fewer than calibration.min_rows={min_rows}")
    if pos == 0 or pos == n:
        raise CalibrationError(f"all {n} validation labels are on one side of the relevance threshold "
                               f"{relevance_threshold}: nothing to calibrate against")
    g = None if groups is None else np.asarray(groups)
    k = max(2, min(cv_folds, _cross_fit_units(n, g)))
    fold = _folds(n, g, k, seed)
    candidates: dict[str, dict[str, float]] = {}
    errors: dict[str, np.ndarray] = {}
    for method in methods:
        cross = np.empty(n)
        for f in range(k):
            test = fold == f
            train = ~test
            if not test.any():
                continue
            yt = y[train]
            if yt.min() == yt.max():  # a one-class training fold: predict its rate
                cross[test] = float(yt.mean())
                continue
            cross[test] = np.clip(_APPLY[method](_FIT[method](s[train], yt), s[test]), 0.0, 1.0)
        candidates[method] = {"cv_brier": brier(cross, y), "cv_ece": ece(cross, y, bins)}
        errors[method] = (cross - y) ** 2
    lowest = min(candidates, key=lambda m: (candidates[m]["cv_brier"], SIMPLER_FIRST.index(m)))
    for m in candidates:  # standard error of the paired Brier difference to the lowest
        d = errors[m] - errors[lowest]
        candidates[m]["se_vs_lowest"] = float(d.std(ddof=1) / math.sqrt(n)) if n > 1 else 0.0
    best = lowest
    if select == "one_se":
        best = next(m for m in SIMPLER_FIRST if m in candidates and candidates[m]["cv_brier"]
                    <= candidates[lowest]["cv_brier"] + candidates[m]["se_vs_lowest"])
    elif select != "lowest":
        raise CalibrationError(f"calibration select {select!r}: expected lowest or one_se")
    params = _FIT[best](s, y)
    fitted = np.clip(_APPLY[best](params, s), 0.0, 1.0)
    validation = {
        "n": n, "n_relevant": pos, "cv_folds": k, "grouped": g is not None,
        "raw": _summary(s, y, bins), "calibrated": _summary(fitted, y, bins),
        "candidates": candidates, "lowest_cv_brier": lowest,
        "chosen_by": "lowest cross-fitted validation Brier" if select == "lowest" else
        "simplest map within one standard error of the lowest cross-fitted validation Brier",
    }
    settings = {"methods": list(methods), "cv_folds": cv_folds, "bins": bins, "min_rows": min_rows, "seed": seed,
                "select": select}
    return Calibration(best, float(relevance_threshold), params, validation, settings)  # type: ignore[arg-type]


# ---------------------------------------------------------------- which scores a consumer uses


def resolve_score_mode(requested: ScoreMode, has_calibration: bool, where: str) -> tuple[bool, str | None]:
    """(use calibrated scores?, a note) for a requested score mode and whether the artifact has a calibration.

    `auto` uses the calibration where there is one and says so when it falls back to raw scores;
    `calibrated` without a calibration is a `CalibrationError` naming the artifact `where`.
    """
    if requested not in ("auto", "raw", "calibrated"):
        raise CalibrationError(f"score {requested!r}: expected auto, raw or calibrated")
    if requested == "raw":
        return False, None
    if has_calibration:
        return True, None
    if requested == "calibrated":
        raise CalibrationError(f"{where}: score 'calibrated' asked for, but the scorer artifact has no "
                               f"{CALIBRATION_FILE} (train it with this version, or use score: raw)")
    return False, f"{where} has no {CALIBRATION_FILE}: pruned on raw scores"
