"""Calibration of a trained (stage, seed) at training time: fit `calibration.json` from its validation predictions.

The fit itself is `memprune.calibration.fit_calibration` (pure numpy/scipy); this module picks the
validation rows of the run's `predictions.parquet`, writes the result into the scorer artifact and
returns the record that `train.json` and `run.json` carry. A reused run whose artifact lacks a
calibration (or has one fitted with other settings) is calibrated from its saved predictions, so a
finished training run gains calibration without retraining.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from memprune.calibration import (
    Calibration,
    CalibrationError,
    fit_calibration,
    read_calibration,
    write_calibration,
)
from memprune.train.config import CalibrationSettings, TrainError


def _settings_of(cfg: CalibrationSettings) -> dict[str, Any]:
    """What a stored calibration must match to be reused (its `settings` plus the relevance threshold)."""
    return {"methods": list(cfg.methods), "cv_folds": cfg.cv_folds, "bins": cfg.bins, "min_rows": cfg.min_rows,
            "seed": 0, "select": cfg.select, "relevance_threshold": cfg.relevance_threshold}


def record(cal: Calibration) -> dict[str, Any]:
    """The train.json view of a calibration: method, threshold, validation Brier and ECE before/after."""
    v = cal.validation
    return {"method": cal.method, "relevance_threshold": cal.relevance_threshold, "n_valid": v.get("n"),
            "valid_raw": v.get("raw"), "valid_calibrated": v.get("calibrated"), "candidates": v.get("candidates"),
            "file": "calibration.json"}


def calibrate_predictions(cfg: CalibrationSettings, artifact: Path, pred: pa.Table) -> dict[str, Any]:
    """Fit and write `artifact/calibration.json` from the validation rows of `pred`; return the train.json record.

    When the validation rows cannot support a fit (too few, one class), any old calibration.json is
    removed and the record says why: the artifact then scores raw only.
    """
    valid = pred.filter(pc.equal(pred.column("split"), "valid"))
    try:
        cal = fit_calibration(
            valid.column("score").to_numpy(), valid.column("label").to_numpy(), cfg.relevance_threshold,
            groups=np.asarray(valid.column("conversation_id").to_pylist(), dtype=object).astype(str),
            methods=cfg.methods, cv_folds=cfg.cv_folds, bins=cfg.bins, min_rows=cfg.min_rows, select=cfg.select,
        )
    except CalibrationError as exc:
        write_calibration(artifact, None)
        return {"skipped": f"{artifact / 'predictions.parquet'}: {exc}"}
    write_calibration(artifact, cal)
    return record(cal)


def ensure_calibration(cfg: CalibrationSettings, artifact: Path) -> dict[str, Any]:
    """A reused run: keep its calibration.json when fitted with these settings, else fit it from predictions.parquet."""
    try:
        existing = read_calibration(artifact)
    except CalibrationError:
        existing = None  # unreadable: refit below from the saved predictions
    if existing is not None and {**existing.settings, "relevance_threshold": existing.relevance_threshold} == \
            _settings_of(cfg):
        return record(existing)
    path = artifact / "predictions.parquet"
    try:
        pred = pq.read_table(path, columns=["split", "label", "score", "conversation_id"])
    except (pa.ArrowInvalid, OSError, KeyError) as exc:
        raise TrainError(f"{path}: cannot read the predictions to calibrate from ({exc})") from exc
    return calibrate_predictions(cfg, artifact, pred)
