"""Agreement between judges: Spearman rank correlation and Krippendorff's alpha (interval level).

Pure numpy/scipy on a units x judges matrix of scores with NaN where a judge gave no score. Used
by the consensus of several judges (`memprune.label.consensus`), the order agreement of listwise
judging and `bench/judge_agreement.py`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np


def spearman(x: np.ndarray, y: np.ndarray) -> float | None:
    """Spearman's rho over the positions where both are finite; None with fewer than 3 or a constant side."""
    from scipy.stats import spearmanr

    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    ok = np.isfinite(x) & np.isfinite(y)
    if ok.sum() < 3 or np.ptp(x[ok]) == 0 or np.ptp(y[ok]) == 0:
        return None
    rho = float(spearmanr(x[ok], y[ok]).statistic)
    return rho if math.isfinite(rho) else None


def krippendorff_alpha_interval(matrix: np.ndarray) -> float | None:
    """Krippendorff's alpha at interval level; `matrix` is units x coders with NaN for missing values.

    alpha = 1 - D_o / D_e with the squared difference as metric, over pairable values (units
    with at least two values): D_o = (1/n) sum_u (1/(m_u - 1)) sum_{i != j in u} (v_i - v_j)^2,
    D_e = (1/(n (n - 1))) sum_{c != k} (v_c - v_k)^2 over all n pairable values. None when
    nothing is pairable or every value is the same (D_e = 0).
    """
    m = np.asarray(matrix, dtype=np.float64)
    if m.ndim != 2:
        raise ValueError(f"expected a units x coders matrix, got shape {m.shape}")
    ok = np.isfinite(m)
    per_unit = ok.sum(axis=1)
    pairable = per_unit >= 2
    if not pairable.any():
        return None
    m, ok, mu = m[pairable], ok[pairable], per_unit[pairable].astype(np.float64)
    values = m[ok]
    n = values.size
    if n < 2:
        return None
    # sum over ordered pairs i != j of (v_i - v_j)^2 = 2 m sum (v - mean)^2
    unit_mean = np.nansum(np.where(ok, m, 0.0), axis=1) / mu
    unit_ss = np.nansum(np.where(ok, (m - unit_mean[:, None]) ** 2, 0.0), axis=1)
    d_o = float(np.sum(2.0 * mu * unit_ss / (mu - 1.0))) / n
    d_e = 2.0 * n * float(np.sum((values - values.mean()) ** 2)) / (n * (n - 1.0))
    if d_e == 0:
        return None
    return 1.0 - d_o / d_e


def agreement_summary(matrix: np.ndarray, names: Sequence[str]) -> dict[str, Any]:
    """Pairwise Spearman between judges (columns of `matrix`) and Krippendorff's interval alpha of all of them."""
    m = np.asarray(matrix, dtype=np.float64)
    pairs: dict[str, float | None] = {}
    for i in range(m.shape[1]):
        for j in range(i + 1, m.shape[1]):
            pairs[f"{names[i]} | {names[j]}"] = spearman(m[:, i], m[:, j])
    known = [v for v in pairs.values() if v is not None]
    return {
        "judges": list(names),
        "units": int(m.shape[0]),
        "units_all_judges": int(np.isfinite(m).all(axis=1).sum()),
        "spearman": pairs,
        "mean_spearman": float(np.mean(known)) if known else None,
        "krippendorff_alpha_interval": krippendorff_alpha_interval(m),
    }
