"""Search spaces as Ray Tune sampling domains, the base point, the sampled train settings, the trial metric.

A trial's config is a flat dict of dotted train-settings keys (`stage2.lora.r`); `apply_point` turns it
into `TrainSettings`. The trial metric is the validation split's session-level Spearman (the paper's
headline metric), computed from a run's predictions with the evaluation's own `session_spearman`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.compute as pc

from memprune.train.config import TrainSettings
from memprune.tune.config import Dimension, Interval, get_key


def domain(dim: Dimension) -> Any:
    """The Ray Tune sampling domain of one dimension: a choice, or a (log-)uniform float / integer range."""
    from ray import tune

    if isinstance(dim, list):
        return tune.choice([encode(v) for v in dim])
    assert isinstance(dim, Interval)
    if dim.integer:
        low, high = int(dim.low), int(dim.high) + 1  # randint's upper bound is exclusive
        return tune.lograndint(low, high) if dim.log else tune.randint(low, high)
    return tune.loguniform(dim.low, dim.high) if dim.log else tune.uniform(dim.low, dim.high)


def encode(value: Any) -> Any:
    """A choice as Tune carries it: lists as JSON strings (`apply_point` reads them back), the rest as is."""
    return json.dumps(value) if isinstance(value, (list, dict)) else value


def param_space(space: dict[str, Dimension]) -> dict[str, Any]:
    """The Tuner's `param_space` of a search space."""
    return {key: domain(dim) for key, dim in space.items()}


def base_point(base: TrainSettings, space: dict[str, Dimension]) -> dict[str, Any]:
    """The base settings' value of every searched key (tried first: today's settings as a reference trial)."""
    data = base.model_dump(mode="json")
    return {key: encode(get_key(data, key)) for key in space}


def max_epochs(base: TrainSettings, space: dict[str, Dimension], points: list[dict[str, Any]]) -> int:
    """The most stage-2 epochs any trial can run (ASHA's horizon)."""
    dim = space.get("stage2.epochs")
    values = [base.stage2.epochs] + [int(p["stage2.epochs"]) for p in points if "stage2.epochs" in p]
    if isinstance(dim, list):
        values += [int(v) for v in dim]
    elif isinstance(dim, Interval):
        values.append(int(dim.high))
    return max(values)


def session_spearman_of(predictions: Path, split: str = "valid") -> tuple[float, int]:
    """Mean per-session Spearman of a predictions.parquet on `split`, and the sessions it is defined on."""
    import pyarrow.parquet as pq

    from memprune.evaluate.metrics import session_spearman

    table = pq.read_table(predictions, columns=["conversation_id", "session_index", "split", "label", "score"])
    table = table.filter(pc.equal(table.column("split"), split))
    conv = np.asarray(table.column("conversation_id").to_pylist(), dtype=object)
    sess = np.asarray(table.column("session_index").to_pylist())
    labels, scores = table.column("label").to_numpy(), table.column("score").to_numpy()
    keys = np.asarray([f"{c}\x1f{s}" for c, s in zip(conv, sess)], dtype=object)
    rhos = [session_spearman(labels[keys == k], scores[keys == k]) for k in np.unique(keys)] if len(keys) else []
    ok = [r for r in rhos if math.isfinite(r)]
    return (float(np.mean(ok)) if ok else math.nan), len(ok)
