"""Searching the scorer's training settings (issue 19): Ray Tune over stage 1 and stage 2, ASHA early stopping.

    from memprune.tune import TuneConfig, run
    run(TuneConfig(data="runs/msc", labels=["runs/msc-labels-sim"], out="runs/msc-tune"))

- `config`: `TuneSettings` / `TuneConfig` (spaces of dotted train-settings keys, validated once).
- `space`: Tune sampling domains, the base point, the trial metric (validation session Spearman).
- `stage`: `run(cfg)`, the trial function; `report`: tune.md, tune.png, train-tuned.yaml.
"""

from __future__ import annotations

from memprune.tune.config import Interval, TuneConfig, TuneError, TuneSettings
from memprune.tune.stage import run

run_tune = run

__all__ = ["Interval", "TuneConfig", "TuneError", "TuneSettings", "run", "run_tune"]
