"""Scoring and deciding without Ray: the helpers the batch job's actors use, and `MemoryPruner`.

`MemoryPruner` prunes the memory of one live session in-process with the exact rule and
scoring of the batch job (`memprune prune`), so both give the same decisions on the same data.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from memprune.calibration import CalibrationError, ScoreMode, resolve_score_mode
from memprune.precision import Precision, resolve_precision
from memprune.prune.config import PruneError, PruneRule
from memprune.prune.rule import prune_mask

OUTPUT_COLUMNS = ("score", "keep")
# Helper columns that live only inside the batch job's pipeline (never written).
ROW = "__memprune_row"
SORTKEY = "__memprune_sortkey"
TOKENS = "__memprune_tokens"
HELPERS = (ROW, SORTKEY, TOKENS)


def bullet_text(bullet: Any, index: int) -> str:
    """The text of a bullet given as a string or a mapping with a 'text' key."""
    if isinstance(bullet, str):
        return bullet
    if isinstance(bullet, Mapping):
        text = bullet.get("text")
        if isinstance(text, str):
            return text
        raise PruneError(f"bullets[{index}]: field 'text' is {type(text).__name__}, expected str")
    raise PruneError(f"bullets[{index}]: is {type(bullet).__name__}, expected str or a mapping with 'text'")


def score_texts(scorer: Any, texts: Sequence[str], batch_size: int, sort_by_length: bool = True) -> np.ndarray:
    """Scores of `texts` in input order; each distinct text scored once, in length order (less padding).

    Scoring each distinct text once makes equal texts score exactly equal wherever they
    sit in a batch, so ties are broken by position in the batch job and in-process alike.
    """
    if not len(texts):
        return np.zeros(0, dtype=np.float64)
    index: dict[str, int] = {}
    inverse = np.fromiter((index.setdefault(t, len(index)) for t in texts), dtype=np.int64, count=len(texts))
    unique = list(index)
    if sort_by_length:
        order = np.argsort(np.fromiter((len(t) for t in unique), dtype=np.int64, count=len(unique)), kind="stable")
        sorted_scores = np.asarray(scorer.score([unique[i] for i in order], batch_size=batch_size), dtype=np.float64)
        scores = np.empty_like(sorted_scores)
        scores[order] = sorted_scores
    else:
        scores = np.asarray(scorer.score(unique, batch_size=batch_size), dtype=np.float64)
    if scores.shape != (len(unique),):
        raise PruneError(f"the scorer returned {scores.shape} scores for {len(unique)} texts")
    return scores[inverse]


def check_scores(scores: np.ndarray, ids: Sequence[Any], where: str) -> None:
    """Raise `PruneError` on NaN or infinite scores, naming how many and the first bullet."""
    bad = ~np.isfinite(scores)
    if bad.any():
        first = int(np.flatnonzero(bad)[0])
        raise PruneError(
            f"{where}: the scorer returned {int(bad.sum())} non-finite score(s) (NaN/inf), "
            f"first for bullet {ids[first]!r}; refusing to prune on them (broken scorer weights?)"
        )


def group_keys_of(table: pa.Table, keys: Sequence[str]) -> list[Any]:
    """Per-row group key (a value, or a tuple for several key columns), nulls kept as None."""
    cols = [table.column(k).to_pylist() for k in keys]
    return cols[0] if len(cols) == 1 else list(zip(*cols))


def decide(
    scores: np.ndarray, groups: Sequence[Any] | np.ndarray, threshold: float | None, top_k: int | None,
    order: np.ndarray | None = None,
) -> np.ndarray:
    """The keep mask of `memprune.prune.rule.prune_mask`, with `PruneError` instead of ValueError."""
    try:
        return prune_mask(scores, groups, threshold, top_k, order=order)
    except ValueError as exc:
        raise PruneError(str(exc)) from exc


def with_outputs(table: pa.Table, scores: np.ndarray, keep: np.ndarray) -> pa.Table:
    """`table` without helper/old output columns, plus float64 `score` and bool `keep`."""
    drop = [c for c in (*HELPERS, *OUTPUT_COLUMNS) if c in table.column_names]
    table = table.drop_columns(drop) if drop else table
    return table.append_column("score", pa.array(scores, pa.float64())).append_column("keep", pa.array(keep, pa.bool_()))


@dataclass(frozen=True)
class KeptBullet:
    """A bullet that survived pruning: its position in the input, text, score and the input item."""

    index: int
    text: str
    score: float
    bullet: Any


class MemoryPruner:
    """Prune the memory of one live session in-process (no Ray), with the batch job's exact rule.

    `MemoryPruner(scorer, threshold=0.5, top_k=5).prune(bullets)` scores the bullets
    (strings, or mappings with a 'text' key), drops scores below `threshold`, keeps the
    `top_k` best (ties: earlier bullet first) and returns the kept ones in input order.
    `scorer` is a loaded `Scorer` or an artifact directory; the rule is a `PruneRule` or its
    fields as keywords (unset fields take the rule's defaults). `precision` is that of the forward
    passes (`auto`: bf16 on a CUDA device that supports it, else fp32). `score` is the batch job's
    setting: `auto` (calibrated where the artifact has a calibration.json, else raw; `score_note` says
    so), `raw`, or `calibrated` (an error without a calibration); `calibrated` tells which was used.
    """

    def __init__(self, scorer: Any, rule: PruneRule | None = None, batch_size: int = 64, sort_by_length: bool = True,
                 device: str | None = None, precision: Precision | None = None, score: ScoreMode = "auto",
                 **rule_fields: Any) -> None:
        from memprune.scorer import Scorer

        if rule is not None and rule_fields:
            raise PruneError(f"give a PruneRule or its fields, not both (got {sorted(rule_fields)})")
        self.rule = rule if rule is not None else PruneRule.of(**rule_fields)
        if isinstance(scorer, (str, os.PathLike)):
            scorer = Scorer.load(scorer, device=device, precision=precision or "auto")
        else:
            if device is not None:
                scorer = scorer.to(device)
            if precision is not None:  # else the loaded scorer's own
                resolve_precision(precision, scorer.device)
                scorer.precision = precision
        self.scorer = scorer
        where = str(getattr(scorer, "source", None) or "the scorer")
        try:
            self.calibrated, self.score_note = resolve_score_mode(score, getattr(scorer, "calibration", None) is not None, where)
        except CalibrationError as exc:
            raise PruneError(str(exc)) from exc
        self.batch_size = batch_size
        self.sort_by_length = sort_by_length

    def score(self, bullets: Sequence[Any]) -> np.ndarray:
        """Usefulness scores (float64) of `bullets`, in order; NaN/inf raise `PruneError`."""
        texts = [bullet_text(b, i) for i, b in enumerate(bullets)]
        scores = score_texts(self.scorer, texts, self.batch_size, self.sort_by_length)
        check_scores(scores, [f"bullets[{i}]" for i in range(len(texts))], "MemoryPruner")
        return self.scorer.calibrate(scores) if self.calibrated else scores

    def decide(self, bullets: Sequence[Any], groups: Sequence[Any] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(scores, keep mask) for `bullets`; all one group unless per-bullet `groups` are given."""
        scores = self.score(bullets)
        if groups is None:
            groups = np.zeros(len(scores), dtype=np.int64)
        elif len(groups) != len(scores):
            raise PruneError(f"groups ({len(groups)}) and bullets ({len(scores)}) differ in length")
        return scores, decide(scores, groups, self.rule.threshold, self.rule.top_k)

    def prune(self, bullets: Sequence[Any], groups: Sequence[Any] | None = None) -> list[KeptBullet]:
        """The kept bullets with their scores, in input order."""
        bullets = list(bullets)
        scores, keep = self.decide(bullets, groups)
        return [KeptBullet(int(i), bullet_text(bullets[i], int(i)), float(scores[i]), bullets[i]) for i in np.flatnonzero(keep)]

    def prune_table(self, table: pa.Table, group_by: str | None = None) -> pa.Table:
        """A small bullets table with `score` and `keep` columns, decided as the batch job does.

        `group_by` replaces the rule's grouping for this call.
        """
        rule = self.rule if group_by is None else PruneRule.of(**{**self.rule.model_dump(), "group_by": group_by})
        missing = [c for c in ("bullet_id", "text", *rule.keys) if c not in table.column_names]
        if missing:
            raise PruneError(f"<table>: column {missing[0]!r} missing")
        scores = score_texts(self.scorer, table.column("text").to_pylist(), self.batch_size, self.sort_by_length)
        check_scores(scores, table.column("bullet_id").to_pylist(), "MemoryPruner.prune_table")
        if self.calibrated:
            scores = self.scorer.calibrate(scores)
        keep = decide(scores, group_keys_of(table, rule.keys), rule.threshold, rule.top_k)
        return with_outputs(table, scores, keep)
