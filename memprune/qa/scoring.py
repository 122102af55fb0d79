"""Scores of qa-eval per question group and memory condition: means with bootstrap intervals, paired
differences between conditions (`memprune.memory.bootstrap`), and the tokens of each group (mean and p95;
the cost table per condition is `memprune.memory.cost.cost_table`).

Every question has one row under every condition, and a failed answer or verdict scores 0 (it is
counted as wrong, and its count is reported), so all conditions are scored on the same questions
and the bootstrap resamples of a group serve every condition (paired intervals).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from memprune.memory import bootstrap as B
from memprune.memory.config import BootstrapSettings
from memprune.memory.cost import token_stats

METRICS = ("f1", "bleu1", "judge")
OVERALL, ANSWERABLE = "overall", "answerable"


def category_label(category: int | None, names: Mapping[int, str]) -> str:
    """The group name of a category: its configured name, else `category <n>` (`uncategorised` for null)."""
    if category is None:
        return "uncategorised"
    return names.get(category, f"category {category}")


def question_groups(answers: pa.Table, names: Mapping[int, str]) -> dict[str, list[str]]:
    """Group -> qa ids in table order: each category (by number), then `answerable`, then `overall`."""
    first: dict[str, tuple[int | None, bool]] = {}
    for qa_id, category, answerable in zip(answers.column("qa_id").to_pylist(), answers.column("category").to_pylist(),
                                           answers.column("answerable").to_pylist()):
        first.setdefault(qa_id, (category, answerable))
    groups: dict[str, list[str]] = {}
    for category in sorted({c for c, _ in first.values()}, key=lambda c: (c is None, c or 0)):
        groups[category_label(category, names)] = [q for q, (c, _) in first.items() if c == category]
    groups[ANSWERABLE] = [q for q, (_, a) in first.items() if a]
    groups[OVERALL] = list(first)
    return groups


def _by_condition(answers: pa.Table) -> dict[str, dict[str, dict[str, Any]]]:
    cols = ["qa_id", "condition", "f1", "bleu1", "judge_score", "abstained", "error", "judge_error", "memory_tokens",
            "prompt_tokens"]
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for r in answers.select(cols).to_pylist():
        out.setdefault(r["condition"], {})[r["qa_id"]] = r
    return out


def score_groups(answers: pa.Table, conditions: Sequence[str], names: Mapping[int, str],
                 bootstrap: BootstrapSettings, judged: bool) -> dict[str, Any]:
    """`{"groups": {group: n}, "metrics": {group: {condition: entry}}, "comparisons": {group: {"A-B": ...}}}`.

    An entry has `n`, `f1`, `bleu1` and (with a judge) `judge` as `{value, ci}` (0-1), the share of
    answers that abstain, the answer and verdict errors, and memory/prompt tokens (mean, p95).
    """
    rows = _by_condition(answers)
    metrics: dict[str, dict[str, Any]] = {}
    comparisons: dict[str, Any] = {}
    sizes: dict[str, int] = {}
    conf = bootstrap.confidence
    for group, ids in question_groups(answers, names).items():
        sizes[group] = len(ids)
        idx = B.bootstrap_indices(len(ids), bootstrap.samples, bootstrap.seed)
        points: dict[str, dict[str, float | None]] = {}
        boots: dict[str, dict[str, np.ndarray]] = {}
        metrics[group] = {}
        for c in conditions:
            mine = [rows[c][q] for q in ids]
            values = {"f1": [r["f1"] for r in mine], "bleu1": [r["bleu1"] for r in mine]}
            if judged:
                values["judge"] = [r["judge_score"] for r in mine]
            points[c] = {m: float(np.mean(v)) if v else None for m, v in values.items()}
            boots[c] = {m: B.mean_bootstrap(np.asarray(v, dtype=np.float64), idx) for m, v in values.items()
                        if v and len(idx)}
            entry: dict[str, Any] = {m: B.with_interval(points[c].get(m), boots[c].get(m), conf) if m in values
                                     else None for m in METRICS}
            entry.update(
                n=len(mine),
                abstained=float(np.mean([bool(r["abstained"]) for r in mine])) if mine else None,
                errors=sum(1 for r in mine if r["error"]),
                judge_errors=sum(1 for r in mine if r["judge_error"]),
                memory_tokens={k: v for k, v in token_stats([r["memory_tokens"] for r in mine]).items()
                               if k in ("mean", "p95")},
                prompt_tokens={k: v for k, v in token_stats([r["prompt_tokens"] for r in mine]).items()
                               if k in ("mean", "p95")},
            )
            metrics[group][c] = entry
        comparisons[group] = B.comparisons(points, boots, conditions, METRICS, conf) if ids else {}
    return {"groups": sizes, "metrics": metrics, "comparisons": comparisons}
