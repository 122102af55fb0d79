"""From judged pairs to bullet labels (DESIGN step 2): y_i = max (or mean) over the bullet's turns.

A pair h sessions ahead weighs decay ** (h - 1) (`decay_weight`); errored pairs are left out, and
a bullet whose pairs all errored gets no label (`all_pairs_failed`), never a default.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

from memprune.schema import LABELS

ALL_PAIRS_FAILED = "all_pairs_failed"


def decay_weight(decay: float, horizon: int | np.ndarray) -> Any:
    """The factor a score from `horizon` sessions ahead is multiplied by: decay ** (h - 1) (scalar or array)."""
    if not 0.0 < float(decay) <= 1.0:
        raise ValueError(f"decay must be in (0, 1], got {decay!r}")
    return np.power(float(decay), np.asarray(horizon) - 1)


def aggregate(pairs: pa.Table, decay: float, how: str = "max") -> tuple[pa.Table, list[dict[str, Any]]]:
    """Labels from judged pairs, and the bullets whose pairs all errored.

    `pairs` holds bullet_id, score (null = error) and horizon. Each score is multiplied by
    decay ** (horizon - 1), then reduced per bullet by `how` (max or mean). Returns the
    `labels` table sorted by bullet_id and, sorted likewise, one dict per failed bullet.
    """
    if how not in ("max", "mean"):
        raise ValueError(f"aggregation must be max or mean, got {how!r}")
    t = pairs.select(["bullet_id", "score", "horizon"]).sort_by([("bullet_id", "ascending")])
    ids = t.column("bullet_id").to_pylist()
    score = t.column("score").to_numpy(zero_copy_only=False).astype(np.float64)  # null -> nan
    horizon = t.column("horizon").to_numpy(zero_copy_only=False).astype(np.int64)
    ok = ~np.isnan(score)
    weighted = score * decay_weight(decay, horizon)
    labels: list[dict[str, Any]] = []
    failed: list[dict[str, Any]] = []
    start = 0
    n = len(ids)
    while start < n:
        stop = start
        while stop < n and ids[stop] == ids[start]:
            stop += 1
        seg_ok = ok[start:stop]
        k = int(seg_ok.sum())
        if k == 0:
            failed.append({"bullet_id": ids[start], "reason": ALL_PAIRS_FAILED, "n_pairs": stop - start,
                           "n_errors": stop - start})
        else:
            vals = weighted[start:stop][seg_ok]
            value = float(vals.max()) if how == "max" else float(vals.sum() / k)
            labels.append({"bullet_id": ids[start], "label": value, "n_pairs": k, "aggregation": how,
                           "source": "judge"})
        start = stop
    return pa.Table.from_pylist(labels, schema=LABELS), failed
