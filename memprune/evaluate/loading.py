"""Reading what evaluation needs: the run's predictions (plain or k-fold) and the corpus side.

A run directory RUN holds RUN/<stage>/seed<k>/predictions.parquet (stages among vanilla,
stage1, stage2; columns bullet_id, split, label, score, conversation_id, session_index);
stages and seeds are discovered from the tree. A k-fold run (`memprune train --folds K`) has
RUN/fold<i>/<stage>/seed<k>/predictions.parquet: the test rows of every fold (its held-out
conversations) are pooled per (stage, seed) into one out-of-fold prediction set; folds must
hold disjoint conversations, and a fold's `fold.json` manifest, when present, must show that
none of its test conversations was in its training or validation data. The corpus directory
(optional) gives token counts and, when it has a qa table, which bullets QA items cite.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow.parquet as pq

from memprune import stages as registry
from memprune.encoders import DEFAULT_ENCODER
from memprune.evaluate.baselines import HEURISTICS, TURN_SUFFIX
from memprune.evaluate.config import SPLIT_ALIASES, EvaluationError
from memprune.io import read_table
from memprune.rejects import Ledger
from memprune.schema import SchemaError
from memprune.tokens import token_counter

STAGE_ORDER: tuple[str, ...] = registry.stage_names()  # method order (memprune/stages.py)
REQUIRED_COLUMNS: tuple[str, ...] = ("bullet_id", "split", "label", "score", "conversation_id", "session_index")
SEED_DIR = re.compile(r"^seed(\d+)$")
FOLD_DIR = re.compile(r"^fold(\d+)$")
FOLD_MANIFEST = "fold.json"


def stage_sort_key(stage: str) -> tuple[int, str]:
    """Vanilla, Stage 1, Stage 2 first (method order), any other stage after, alphabetically."""
    return registry.sort_key(stage)


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



@dataclass
class Corpus:
    """What evaluation needs from a corpus dir: tokens per bullet, QA citation and recency."""

    data_dir: Path
    tokens: pd.Series  # bullet_id -> token count
    tokenizer: str
    cited: pd.Series | None = None  # bullet_id -> bool (evidence turn cited by a QA item)
    recency: pd.Series | None = None  # bullet_id -> position of its latest evidence turn (-1 unknown)
    recency_source: str = ""
    heuristics: dict[str, pd.Series] = field(default_factory=dict)  # name -> bullet_id -> score (evaluate.baselines)
    n_qa: int = 0
    n_qa_without_evidence: int = 0




def run_encoder(run_dir: str | Path) -> str:
    """The encoder named by the run's scorer artifacts (the first scorer.json found), else the default encoder."""
    for path in sorted(Path(run_dir).glob("**/seed*/scorer.json")):
        try:
            return str(json.loads(path.read_text(encoding="utf-8"))["encoder"])
        except (ValueError, KeyError, OSError):
            continue
    return DEFAULT_ENCODER


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


def load_corpus(data_dir: str | Path, tokenizer: str = "encoder", encoder: str | None = None) -> Corpus:
    """Read bullets (and qa, sessions when present) of a corpus dir written by `memprune ingest`."""
    root = Path(data_dir)
    bullets = read_table(root / "bullets.parquet", "bullets").select(["bullet_id", "text", "evidence"]).to_pandas()
    count, unit = token_counter(tokenizer, encoder=encoder)
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
        corpus.heuristics = {name: pd.Series(rule(bullets), index=bullets["bullet_id"].to_numpy())
                             for name, rule in HEURISTICS.items()}
    return corpus

