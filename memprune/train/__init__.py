"""Training the scorer (DESIGN step 3): vanilla, stage 1 and stage 2 over seeds, on Ray Train.

    from memprune.train import TrainConfig, run
    run(TrainConfig(data="runs/msc", labels=["runs/msc-labels"], out="runs/msc-train"))

- `config`: `TrainSettings` / `TrainConfig` (validated once).
- `splits`: train/valid/test by conversation and k folds; `data`: labels joined to bullets, fingerprint.
- `embed`: frozen-encoder embeddings on a Ray Data actor pool, cached.
- `stages`: the registry of what differs per stage; `loss`: the objective; `checkpoint`: the codec.
- `prepare`: a run's inputs, resource requests and how many seed chains train at once (tune's trials too).
- `loop`: the Ray Train worker loop; `trainer`: one (stage, seed); `recipe`: `run(cfg)`; `report`: train.md.
"""

from __future__ import annotations

from memprune.train.checkpoint import optimizer_state, optimizer_tensors
from memprune.train.config import (
    LossConfig,
    OptimConfig,
    TrainConfig,
    TrainError,
    TrainSettings,
)
from memprune.train.data import prepare_data
from memprune.train.loop import session_batches
from memprune.train.loss import batch_loss, combine_parts, listwise_kl
from memprune.train.prepare import chains_at_once, prepare_inputs
from memprune.train.recipe import run
from memprune.train.splits import (
    SplitConfig,
    SplitError,
    split_conversations,
    split_counts,
)
from memprune.train.trainer import PREDICTIONS

run_training = run

__all__ = [
    "PREDICTIONS",
    "LossConfig",
    "OptimConfig",
    "SplitConfig",
    "SplitError",
    "TrainConfig",
    "TrainError",
    "TrainSettings",
    "batch_loss",
    "chains_at_once",
    "combine_parts",
    "listwise_kl",
    "optimizer_state",
    "optimizer_tensors",
    "prepare_data",
    "prepare_inputs",
    "run",
    "run_training",
    "session_batches",
    "split_conversations",
    "split_counts",
]
