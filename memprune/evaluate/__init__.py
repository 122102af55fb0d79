"""Evaluation of a trained run (DESIGN step 4): regression and session-ranking metrics over seeds,
significance against the baseline, the pruning view and QA-evidence retention.

    from memprune.evaluate import EvalConfig, run
    run(EvalConfig(run="runs/msc-train", data="runs/msc", out="runs/msc-train/eval"))

- `config`: `EvalConfig` (carries the `PruneRule` of the pruning tables).
- `loading`: the run's predictions (plain or pooled k-fold) and the corpus side (tokens, QA citations).
- `metrics`: the metrics as pure functions; `pruning`: the pruning view; `significance`: seeds and tests.
- `stage`: `run(cfg)`; `report`: report.md and the figures, from metrics.json alone.
"""

from __future__ import annotations

from memprune.evaluate.config import EvalConfig, EvalSettings, EvaluationError
from memprune.evaluate.loading import discover_run, load_corpus, load_predictions
from memprune.evaluate.pruning import expected_random_share, pruning_view
from memprune.evaluate.significance import paired_seed_test, wilcoxon_sessions
from memprune.evaluate.stage import evaluate_run, run

__all__ = [
    "EvalConfig",
    "EvalSettings",
    "EvaluationError",
    "discover_run",
    "evaluate_run",
    "expected_random_share",
    "load_corpus",
    "load_predictions",
    "paired_seed_test",
    "pruning_view",
    "run",
    "wilcoxon_sessions",
]
