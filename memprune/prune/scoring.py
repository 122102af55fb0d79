"""Scoring and deciding without Ray: the helpers the batch job's actors use, and `MemoryPruner`.

`MemoryPruner` prunes the memory of one live session in-process with the exact rule and
scoring of the batch job (`memprune prune`), so both give the same decisions on the same data.
"""

from __future__ import annotations

import datetime as dt
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from memprune.calibration import CalibrationError, ScoreMode, resolve_score_mode
from memprune.decision import Bullets, Decision, PruneError, PruneRule, decide
from memprune.precision import DEFAULT_PRECISION, Precision
from memprune.prune.inputs import Lives
from memprune.texts import unencodable
from memprune.usagelog import Usage, read_usage

# With retention (`rule.retention.half_life`) `effective_score` and `retention` follow `score`.
RETENTION_COLUMNS = ("effective_score", "retention")
OUTPUT_COLUMNS = ("score", *RETENTION_COLUMNS, "keep", "reason", "duplicate_of", "superseded_by")
# Helper columns that live only inside the batch job's pipeline (never written).
ROW = "__memprune_row"
SORTKEY = "__memprune_sortkey"
TOKENS = "__memprune_tokens"
EMB = "__memprune_emb"
HELPERS = (ROW, SORTKEY, TOKENS, EMB)
# The most bullets one in-process call decides (MemoryPruner `max_bullets`): its texts, scores and embeddings are
# held at once and its duplicate search is quadratic in a group's size (memory bounded, `policy.SIM_CELLS`: 2x10^4
# near-identical bullets in one group took 11.5 s and 204 MB at peak on 2 CPUs; 10^5 would take minutes).
MAX_BULLETS = 20_000


def bullet_text(bullet: Any, index: int) -> str:
    """The text of a bullet given as a string or a mapping with a 'text' key (valid Unicode text)."""
    text = bullet.get("text") if isinstance(bullet, Mapping) else bullet
    if not isinstance(text, str):
        raise PruneError(f"bullets[{index}]: field 'text' is {type(text).__name__}, expected str"
                         if isinstance(bullet, Mapping) else
                         f"bullets[{index}]: is {type(bullet).__name__}, expected str or a mapping with 'text'")
    why = unencodable(text)
    if why is not None:
        raise PruneError(f"bullets[{index}]: {why}")
    return text


def bullet_list(bullets: Any, limit: int) -> list[Any]:
    """`bullets` as a list: a sequence of strings or mappings, at most `limit`; a string, None or a mapping
    where a list belongs is one clear error (a string would be pruned character by character)."""
    if isinstance(bullets, (str, bytes, Mapping)) or bullets is None or not isinstance(bullets, Iterable):
        raise PruneError(f"bullets: a list of strings or of mappings with 'text', not {type(bullets).__name__}")
    out = list(bullets)
    check_size(len(out), limit, "bullets")
    return out


def check_size(n: int, limit: int, what: str) -> None:
    """One in-process decision holds every text, score and embedding at once: more than `limit` is one error."""
    if n > limit:
        raise PruneError(f"{what}: {n} in one call, at most {limit} (MemoryPruner max_bullets); a store this size "
                         "is pruned with `memprune prune`, which blocks and streams it")


def score_texts(scorer: Any, texts: Sequence[str], batch_size: int, sort_by_length: bool = True) -> np.ndarray:
    """Scores of `texts` in input order; each distinct text scored once, in length order (less padding).

    Scoring each distinct text once makes equal texts score exactly equal wherever they
    sit in a batch, so ties are broken by position in the batch job and in-process alike.
    """
    return score_and_embed(scorer, texts, batch_size, sort_by_length, embed=False)[0]


def score_and_embed(scorer: Any, texts: Sequence[str], batch_size: int, sort_by_length: bool = True,
                    embed: bool = True) -> tuple[np.ndarray, np.ndarray | None]:
    """Scores of `texts` (as `score_texts`) and, with `embed`, the encoder embeddings the head scored.

    The embeddings come from the same forward pass as the scores (`Scorer.embed`, then the head on
    them: `Scorer.score_embeddings`), so near-duplicate merging costs no second encoder pass.
    """
    if not len(texts):
        return np.zeros(0, dtype=np.float64), (np.zeros((0, 0), dtype=np.float32) if embed else None)
    index: dict[str, int] = {}
    inverse = np.fromiter((index.setdefault(t, len(index)) for t in texts), dtype=np.int64, count=len(texts))
    unique = list(index)
    order = (np.argsort(np.fromiter((len(t) for t in unique), dtype=np.int64, count=len(unique)), kind="stable")
             if sort_by_length else np.arange(len(unique)))
    batch = [unique[i] for i in order]
    emb = None
    if embed:
        emb_sorted = np.asarray(scorer.embed(batch, batch_size=batch_size), dtype=np.float32)
        got = np.asarray(scorer.score_embeddings(emb_sorted), dtype=np.float64)
    else:
        got = np.asarray(scorer.score(batch, batch_size=batch_size), dtype=np.float64)
    if got.shape != (len(unique),):
        raise PruneError(f"the scorer returned {got.shape} scores for {len(unique)} texts")
    scores = np.empty_like(got)
    scores[order] = got
    if embed:
        emb = np.empty_like(emb_sorted)
        emb[order] = emb_sorted
        emb = emb[inverse]
    return scores[inverse], emb


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


def decide_now(bullets: Bullets, rule: PruneRule) -> Decision:
    """`memprune.decision.decide` with `PruneError` instead of ValueError; a rule with retention but no `now` measures
    ages at the wall clock of this call."""
    try:
        return decide(bullets, rule.at(dt.datetime.now(dt.timezone.utc)))
    except ValueError as exc:
        raise PruneError(str(exc)) from exc


def with_outputs(table: pa.Table, scores: np.ndarray, decision: Decision) -> pa.Table:
    """`table` without helper/old output columns, plus `score`, (with retention) `effective_score` and
    `retention`, `keep`, `reason`, `duplicate_of` and (with supersession) `superseded_by` (bullet_ids)."""
    drop = [c for c in (*HELPERS, *OUTPUT_COLUMNS) if c in table.column_names]
    ids = table.column("bullet_id")
    table = table.drop_columns(drop) if drop else table

    def id_of(index: np.ndarray) -> pa.Array:
        got = (pc.take(ids, pa.array(np.where(index >= 0, index, 0), pa.int64())) if len(index)
               else pa.array([], pa.string()))
        return pc.if_else(pa.array(index >= 0, pa.bool_()), got, pa.scalar(None, pa.string())).cast(pa.string())

    table = table.append_column("score", pa.array(scores, pa.float64()))
    if decision.effective is not None:
        table = (table.append_column("effective_score", pa.array(decision.effective, pa.float64()))
                 .append_column("retention", pa.array(decision.retention, pa.float64())))
    table = (table.append_column("keep", pa.array(decision.keep, pa.bool_()))
             .append_column("reason", pa.array(decision.reason.tolist(), pa.string()))
             .append_column("duplicate_of", id_of(decision.duplicate_of)))
    if decision.superseded_by is not None:
        table = table.append_column("superseded_by", id_of(decision.superseded_by))
    return table


@dataclass(frozen=True)
class KeptBullet:
    """A bullet that survived pruning: its position in the input, text, score and the input item."""

    index: int
    text: str
    score: float
    bullet: Any


class MemoryPruner:
    """Prune the memory of one live session in-process (no Ray), with the batch job's exact decision.

    `MemoryPruner(scorer, threshold=0.5, top_k=5).prune(bullets)` scores the bullets (strings, or
    mappings with a 'text' key), merges duplicates, applies the rule's policy (`rule`, `budget`,
    `fraction`; floor, min-keep) and returns the kept ones in input order; `decisions` also says why
    each other bullet goes. `scorer` is a loaded `Scorer`, an artifact directory or a shipped scorer's name
    (`memprune.scorers`; none: `default`); the rule is a `PruneRule` or its fields as keywords (unset fields take
    the rule's defaults; an unset threshold, the scorer's: none for a shipped one). `tokenizer` is the token unit of
    the budget (as `memprune prune`'s). `precision` is that of the forward passes
    (`auto`: bf16 on a CUDA device that supports it, else fp32), given with an artifact directory: a loaded
    `Scorer` keeps the precision it was loaded with (`Scorer.load(path, precision=...)`).
    `score` is the batch job's setting:
    `auto` (calibrated where the artifact has a calibration.json, else raw; `score_note` says so),
    `raw`, or `calibrated` (an error without a calibration); `calibrated` tells which was used.

    Keeping memory current (`memprune.prune.inputs`): `pin_field="pinned"` pins the bullets whose
    mapping key (table column) is true; `retention={"half_life": "30d", "recall_boost": 1, "max_age": "90d",
    "now": ...}` forgets by age and expires; a bullet's age comes from its last access (`usage_log`, a
    usage log file read once here, or `usage`, a `memprune.usagelog.Usage`), else its `time`, else its
    `session_time` key (or column), else `session_times[(conversation_id, session_index)]`. Without
    `now` ages are measured at the wall clock of each call. The usage log is not checked against a
    store here (this sees one session at a time); `memprune prune --usage-log` checks every id.
    One call decides at most `max_bullets` bullets (default `MAX_BULLETS`, 20,000; more is one clear error:
    prune a store that size with `memprune prune`); texts must be valid Unicode (`memprune.texts`).
    """

    def __init__(self, scorer: Any = None, rule: PruneRule | None = None, batch_size: int = 64, sort_by_length: bool = True,
                 device: str | None = None, precision: Precision | None = None, tokenizer: str = "encoder",
                 score: ScoreMode = "auto", usage_log: str | Path | None = None, usage: Usage | None = None,
                 session_times: Mapping[tuple[Any, Any], float] | None = None, max_bullets: int = MAX_BULLETS,
                 **rule_fields: Any) -> None:
        from memprune.scorer import Scorer
        from memprune.scorers import resolve_scorer
        from memprune.tokens import check_unit

        if rule is not None and rule_fields:
            raise PruneError(f"give a PruneRule or its fields, not both (got {sorted(rule_fields)})")
        self.rule = rule if rule is not None else PruneRule.of(**rule_fields)
        if scorer is None or isinstance(scorer, (str, os.PathLike)):
            scorer = Scorer.load(resolve_scorer(scorer and os.fspath(scorer)), device=device,
                                 precision=precision or DEFAULT_PRECISION)
        else:
            if precision is not None:
                raise PruneError(f"precision={precision!r} is set when the scorer is loaded: pass the artifact "
                                 "directory, or Scorer.load(path, precision=...)")
            if device is not None:
                scorer = scorer.to(device)
        self.scorer = scorer
        if getattr(scorer, "config", None) is not None:  # a rule without a threshold takes the scorer's
            self.rule = self.rule.with_default_threshold(scorer.config.threshold)
        where = str(getattr(scorer, "source", None) or "the scorer")
        try:
            self.calibrated, self.score_note = resolve_score_mode(score, getattr(scorer, "calibration", None) is not None, where)
        except CalibrationError as exc:
            raise PruneError(str(exc)) from exc
        self.batch_size = batch_size
        self.sort_by_length = sort_by_length
        check_unit(tokenizer)
        self.tokenizer = tokenizer
        self._count: Any = None
        if usage_log is not None and usage is not None:
            raise PruneError("give usage_log (a file) or usage (read), not both")
        if usage_log is not None:
            try:
                usage = read_usage(usage_log)  # any id: this sees one session, not the store
            except ValueError as exc:
                raise PruneError(str(exc)) from exc
        if usage is not None and not self.rule.retention.on:
            raise PruneError("a usage log only matters for forgetting: set retention half_life (or max_age)")
        self.lives = Lives(usage, session_times)
        self.max_bullets = max_bullets

    def count_tokens(self, texts: Sequence[str]) -> np.ndarray:
        """Tokens per text in the rule's unit (the counter of `memprune prune`, built on first use)."""
        if self._count is None:
            from memprune.tokens import token_counter

            self._count = token_counter(self.tokenizer, tokenizer=getattr(self.scorer, "tokenizer", None))[0]
        return self._count(texts)

    def score(self, bullets: Sequence[Any]) -> np.ndarray:
        """Usefulness scores (float64) of `bullets`, in order; NaN/inf raise `PruneError`."""
        texts = [bullet_text(b, i) for i, b in enumerate(bullet_list(bullets, self.max_bullets))]
        scores = score_texts(self.scorer, texts, self.batch_size, self.sort_by_length)
        check_scores(scores, [f"bullets[{i}]" for i in range(len(texts))], "MemoryPruner")
        return self.scorer.calibrate(scores) if self.calibrated else scores

    def _decide(self, texts: list[str], groups: Sequence[Any], rule: PruneRule, fields: Any,
                ids: Sequence[Any]) -> tuple[np.ndarray, Decision]:
        """Score `texts` and decide them under `rule`; `fields()`: their pins, times and scopes (`Lives`)."""
        try:
            life = fields()
        except ValueError as exc:
            raise PruneError(f"MemoryPruner: {exc}") from exc
        # A duck-typed scorer without `embed` (no encoder) gets exact-duplicate merging only.
        embed = rule.needs_embeddings and hasattr(self.scorer, "embed")
        scores, emb = score_and_embed(self.scorer, texts, self.batch_size, self.sort_by_length, embed=embed)
        check_scores(scores, ids, "MemoryPruner")
        if self.calibrated:
            scores = self.scorer.calibrate(scores)
        bullets = Bullets.of(scores, groups, texts=texts, embeddings=emb,
                             tokens=self.count_tokens(texts) if rule.needs_tokens else None,
                             encode=(lambda t: self.scorer.embed(t, batch_size=self.batch_size)) if embed else None,
                             **life)
        return scores, decide_now(bullets, rule)

    def decisions(self, bullets: Sequence[Any], groups: Sequence[Any] | None = None) -> tuple[np.ndarray, Decision]:
        """(scores, the whole `Decision`: keep, reason, duplicate_of, rescued, pinned, protected, and with retention
        the effective scores) for `bullets`; one group unless `groups`."""
        bullets = bullet_list(bullets, self.max_bullets)
        texts = [bullet_text(b, i) for i, b in enumerate(bullets)]
        if groups is not None and len(groups) != len(texts):
            raise PruneError(f"groups ({len(groups)}) and bullets ({len(texts)}) differ in length")
        return self._decide(texts, groups, self.rule, lambda: self.lives.of_mappings(bullets, self.rule),
                            [f"bullets[{i}]" for i in range(len(texts))])

    def decide(self, bullets: Sequence[Any], groups: Sequence[Any] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(scores, keep mask) for `bullets`; all one group unless per-bullet `groups` are given."""
        scores, decision = self.decisions(bullets, groups)
        return scores, decision.keep

    def prune(self, bullets: Sequence[Any], groups: Sequence[Any] | None = None) -> list[KeptBullet]:
        """The kept bullets with their scores, in input order."""
        bullets = bullet_list(bullets, self.max_bullets)
        scores, keep = self.decide(bullets, groups)
        return [KeptBullet(int(i), bullet_text(bullets[i], int(i)), float(scores[i]), bullets[i]) for i in np.flatnonzero(keep)]

    def prune_table(self, table: pa.Table, group_by: str | None = None, pin_field: str | None = None) -> pa.Table:
        """A small bullets table with `score`, `keep`, `reason` and `duplicate_of`, decided as the batch job does.

        `group_by` and `pin_field` (a boolean column), where given, replace the rule's for this call.
        """
        given = {k: v for k, v in (("group_by", group_by), ("pin_field", pin_field)) if v is not None}
        rule = PruneRule.of(**{**self.rule.model_dump(), **given}) if given else self.rule
        missing = [c for c in ("bullet_id", "text", *rule.keys) if c not in table.column_names]
        if missing:
            raise PruneError(f"<table>: column {missing[0]!r} missing")
        check_size(table.num_rows, self.max_bullets, "<table>")
        scores, decision = self._decide(table.column("text").to_pylist(), group_keys_of(table, rule.keys), rule,
                                        lambda: self.lives.of_table(table, rule), table.column("bullet_id").to_pylist())
        return with_outputs(table, scores, decision)
