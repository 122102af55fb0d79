"""Consensus of several judges: every pair is scored by each judge; pairs and labels carry the mean,
the number of judges and their spread, and `label.json` reports how well the judges agree.

Judges come from `judge_set` (several LLM config files: other models, prompts or engines; each
judged in its own resumable work dir, so adding a judge reuses the others) or from
`judge_samples = k` (one config sampled k times at `judge_temperature`, all samples in one pass).

Rules, precisely:

- pair: `score` = mean of the judges' scores of the pair, `n_judges` = how many scored it,
  `spread` = their population standard deviation (0 for one judge); the pair is an error only
  when every judge failed on it (the messages joined);
- label: each judge's labels are aggregated on their own (max or mean with the horizon decay,
  `memprune.label.aggregate`); the bullet's `label` is the mean of the judges' labels, `n_judges`
  how many judges labelled it, `spread` their standard deviation, and
  `agreement` = 1 - 2 * spread in [0, 1] (scores lie in [0, 1], so the spread is at most 0.5):
  1 when the judges agree exactly, 0 when they split between 0 and 1. `memprune train
  --label-weight-by agreement` weighs training rows by it;
- `label.json` -> `agreement`: Spearman between every two judges and Krippendorff's alpha
  (interval) over the pairs and over the labels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from memprune.label.aggregate import ALL_PAIRS_FAILED, aggregate
from memprune.label.agreement import agreement_summary
from memprune.label.config import LabelSettings
from memprune.label.judges import JUDGES
from memprune.schema import LABELS

# labels.parquet of a consensus run: the LABELS contract plus what the judges' agreement says
LABELS_CONSENSUS = (LABELS.append(pa.field("n_judges", pa.int32(), nullable=False))
                    .append(pa.field("spread", pa.float64(), nullable=False))
                    .append(pa.field("agreement", pa.float64(), nullable=False)))


@dataclass(frozen=True)
class JudgeSpec:
    """One configured judge: its `judge` setting, its kind (a `JUDGES` key), LLM config and number of samples."""

    kind: str
    mode: str
    llm: Any
    samples: int = 1

    @property
    def name(self) -> str:
        """A short name of the judge: `<kind>:<engine>:<model>:<prompt of its mode>`."""
        entry = JUDGES[self.mode]
        return f"{entry.name_prefix}:{self.llm.describe(entry.task)}"


def judge_specs(cfg: LabelSettings) -> list[JudgeSpec]:
    """The judges of a run: one per `judge_set` file, or the one LLM config (sampled `judge_samples` times)."""
    mode = cfg.judge_entry().kind
    return [JudgeSpec(cfg.judge, mode, llm, cfg.judge_samples) for llm in cfg.judge_llm_settings()]


def instance_names(specs: list[JudgeSpec], names: list[str]) -> list[str]:
    """One name per judging instance: the judge's name (`names[i]` of `specs[i]`; `#j<i>` when two judges share
    one), or `<name>#s<k>` for each of its samples."""
    out = []
    for i, (spec, name) in enumerate(zip(specs, names)):
        base = name if names.count(name) == 1 else f"{name}#j{i}"
        out += [base] if spec.samples == 1 else [f"{base}#s{k}" for k in range(spec.samples)]
    return out


def combine_pairs(scores: np.ndarray, errors: list[list[str | None]]) -> dict[str, Any]:
    """Per pair over judges (rows of `scores`, NaN = no score): mean, n_judges, spread and the error of all-failed."""
    ok = np.isfinite(scores)
    n = ok.sum(axis=0)
    safe = np.where(ok, scores, 0.0)
    mean = np.where(n > 0, safe.sum(axis=0) / np.maximum(n, 1), np.nan)
    spread = np.sqrt(np.where(n > 0, np.where(ok, (scores - mean) ** 2, 0.0).sum(axis=0) / np.maximum(n, 1), np.nan))
    error = [None if n[p] else " | ".join(sorted({str(e[p]) for e in errors if e[p]})) or "no judge scored the pair"
             for p in range(scores.shape[1])]
    return {"score": mean, "n_judges": n.astype(np.int32), "spread": spread, "error": error}


def consensus_labels(pairs: pa.Table, scores: np.ndarray, decay: float, how: str
                     ) -> tuple[pa.Table, list[dict[str, Any]], np.ndarray, list[str]]:
    """Labels from several judges' pair scores (rows of `scores`, aligned with `pairs`: bullet_id, horizon).

    Returns the `LABELS_CONSENSUS` table (sorted by bullet_id), the bullets no judge could label
    (`all_pairs_failed`), and the bullets x judges matrix of per-judge labels (NaN = none) with its
    bullet ids, for the label-level agreement.
    """
    per_judge = []
    for row in scores:
        t = pa.table({"bullet_id": pairs.column("bullet_id"), "horizon": pairs.column("horizon"),
                      "score": pa.array([None if np.isnan(v) else float(v) for v in row], pa.float64())})
        labels, _ = aggregate(t, decay, how)
        per_judge.append(dict(zip(labels.column("bullet_id").to_pylist(), labels.column("label").to_pylist())))
    ids = sorted(set(pairs.column("bullet_id").to_pylist()))
    matrix = np.array([[j.get(b, np.nan) for j in per_judge] for b in ids], dtype=np.float64).reshape(len(ids),
                                                                                                     len(per_judge))
    scored = np.isfinite(scores).any(axis=0)
    n_scored: dict[str, int] = {}
    n_all: dict[str, int] = {}
    for b, ok in zip(pairs.column("bullet_id").to_pylist(), scored):
        n_all[b] = n_all.get(b, 0) + 1
        n_scored[b] = n_scored.get(b, 0) + int(ok)
    rows, failed = [], []
    for b, values in zip(ids, matrix):
        got = values[np.isfinite(values)]
        if not got.size:
            failed.append({"bullet_id": b, "reason": ALL_PAIRS_FAILED, "n_pairs": n_all[b], "n_errors": n_all[b]})
            continue
        spread = float(got.std())
        rows.append({"bullet_id": b, "label": float(got.mean()), "n_pairs": n_scored[b], "aggregation": how,
                     "source": "judge", "n_judges": int(got.size), "spread": spread,
                     "agreement": float(min(1.0, max(0.0, 1.0 - 2.0 * spread)))})
    return pa.Table.from_pylist(rows, schema=LABELS_CONSENSUS), failed, matrix, ids


def consensus_agreement(scores: np.ndarray, label_matrix: np.ndarray, names: list[str]) -> dict[str, Any]:
    """`label.json` -> `agreement`: Spearman and Krippendorff's alpha between judges, over pairs and over labels."""
    return {"pairs": agreement_summary(scores.T, names), "labels": agreement_summary(label_matrix, names)}
