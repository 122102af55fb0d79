"""`memprune evaluate`: metrics, significance, pruning view and QA-evidence retention of a trained run.

Output: OUT/metrics.json (every number, per seed and aggregated), OUT/report.md with PNG
figures, OUT/session_metrics.parquet (per-session values behind the tests) and
OUT/rejects.jsonl (prediction rows that could not be used, with the reason).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa

from memprune.evaluate import metrics as M
from memprune.evaluate.calibration import relevance_calibration
from memprune.evaluate.config import EvalConfig, EvalSettings, EvaluationError
from memprune.evaluate.loading import (
    Corpus,
    discover_folds,
    discover_run,
    load_corpus,
    load_folds,
    load_predictions,
    run_encoder,
)
from memprune.evaluate.pruning import RandomKeep, pruning_view
from memprune.evaluate.report import write_report
from memprune.evaluate.significance import (
    aggregate,
    comparisons,
    paired_seed_test,
    wilcoxon_sessions,
)
from memprune.evaluate.worth import KEY as WORTH_KEY
from memprune.evaluate.worth import run_labels, stage2_worth, training_seconds
from memprune.io import JsonlSink, jsonable, write_json, write_table
from memprune.outputs import OutputSet, check_out_location
from memprune.decision import group_codes, rank_within_groups
from memprune.rejects import Ledger
from memprune.storage import fetch_dir, is_uri
from memprune.tokens import check_unit


def evaluate_frame(df: pd.DataFrame, config: EvalSettings) -> tuple[dict[str, Any], pd.DataFrame]:
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


def _evaluate_split(
    split: str,
    frames: dict[str, dict[int, pd.DataFrame]],
    config: EvalSettings,
    corpus: Corpus | None,
) -> tuple[dict[str, Any], pd.DataFrame]:
    """Everything for one split: per seed, aggregated, significance, pruning, QA retention, figure data."""
    stages = list(frames)
    reference, notes = _reference_labels(frames)
    qa_cache: dict[tuple[str, ...], RandomKeep] = {}  # the random QA baseline: drawn once, reused by every model
    per_seed: dict[str, dict[str, Any]] = {}
    session_tables: list[pd.DataFrame] = []
    session_means: dict[str, pd.DataFrame] = {}
    cols = [*M.SESSION_ERROR_METRICS, *M.ranking_metric_names(config.ks)]
    for stage, seeds in frames.items():
        per_seed[stage], stage_sessions = _evaluate_stage(stage, seeds, split, config, corpus, qa_cache)
        session_tables.append(stage_sessions)
        session_means[stage] = stage_sessions.groupby(level="session")[cols].mean()
    missing_text = max((r.get("n_bullets_without_text", 0) for st in per_seed.values() for r in st.values()), default=0)
    if missing_text:
        notes.append(f"{missing_text} bullet(s) of the run are not in the corpus bullets.parquet: "
                     "left out of token counts")
    agg = {stage: _aggregate_seeds(per_seed[stage], pd.concat(frames[stage].values()), config) for stage in stages}
    labels_all = reference["label"].to_numpy()
    split_out: dict[str, Any] = {
        "stages": stages,
        "seeds": {s: [int(k) for k in frames[s]] for s in stages},
        "n_bullets": int(len(reference)),
        "n_sessions": int(reference["session"].nunique()),
        "label_histogram": M.histogram(labels_all, config.histogram_bins),
        "relevant_share": float((labels_all >= config.relevance_threshold).mean()) if len(labels_all) else math.nan,
        "per_seed": per_seed,
        "aggregate": agg,
        "significance": _significance(stages, per_seed, agg, session_means, config),
        "notes": notes,
    }
    if corpus is not None and corpus.cited is not None:
        split_out["qa"] = _qa_summary(reference, corpus, config)
    return split_out, pd.concat(session_tables)


def _reference_labels(frames: dict[str, dict[int, pd.DataFrame]]) -> tuple[pd.DataFrame, list[str]]:
    """Each bullet once (bullet_id, session, label), and a note when stages or seeds disagree on a label."""
    all_rows = pd.concat([f for seeds in frames.values() for f in seeds.values()])
    reference = all_rows.drop_duplicates("bullet_id")[["bullet_id", "session", "label"]]
    mismatch = all_rows.groupby("bullet_id")["label"].agg(lambda v: v.max() - v.min())
    n_mismatch = int((mismatch > 1e-9).sum())
    notes = [f"{n_mismatch} bullet(s) have different labels across stages/seeds"] if n_mismatch else []
    return reference, notes


# ------------------------------------------------------------------ per seed


def _evaluate_stage(stage: str, seeds: dict[int, pd.DataFrame], split: str, config: EvalSettings,
                    corpus: Corpus | None, qa_cache: dict[tuple[str, ...], RandomKeep]
                    ) -> tuple[dict[str, Any], pd.DataFrame]:
    """One stage's seeds: each seed's result (by seed name) and their per-session rows, tagged."""
    results: dict[str, Any] = {}
    tables = []
    for seed, df in seeds.items():
        results[str(seed)], sessions = _evaluate_seed(df, config, corpus, qa_cache)
        tables.append(sessions.assign(stage=stage, seed=seed, split=split))
    return results, pd.concat(tables)


def _evaluate_seed(df: pd.DataFrame, config: EvalSettings, corpus: Corpus | None,
                   qa_cache: dict[tuple[str, ...], RandomKeep]) -> tuple[dict[str, Any], pd.DataFrame]:
    """One (stage, seed) frame: metrics, classification and the pruning view (tokens and QA evidence from
    the corpus, where given); with its per-session table."""
    result, sessions = evaluate_frame(df, config)
    tokens = cited = recency_rank = random_keep = None
    if corpus is not None:
        tokens = df["bullet_id"].map(corpus.tokens).to_numpy(dtype=np.float64)
        result["n_bullets_without_text"] = int(np.isnan(tokens).sum())
        if corpus.cited is not None:
            cited, recency_rank, random_keep = _qa_inputs(df, config, corpus, qa_cache)
    result["classification"] = M.classification_metrics(
        df["label"].to_numpy(), df["score"].to_numpy(), config.relevance_threshold, cited)
    heuristic_ranks = None
    if cited is not None:
        codes = group_codes(df["session"].to_numpy())
        heuristic_ranks = {name: rank_within_groups(df["bullet_id"].map(h).fillna(-np.inf).to_numpy(dtype=np.float64),
                                                    codes, order=df["position"].to_numpy())
                           for name, h in corpus.heuristics.items()}
    result["pruning"] = pruning_view(df, config, tokens, cited, recency_rank, random_keep, heuristic_ranks)
    return result, sessions


def _qa_inputs(df: pd.DataFrame, config: EvalSettings, corpus: Corpus, qa_cache: dict[tuple[str, ...], RandomKeep]
               ) -> tuple[np.ndarray, np.ndarray, RandomKeep]:
    """Which bullets QA cites, their recency ranks and the random baseline (shared by frames of the same bullets)."""
    cited = df["bullet_id"].map(corpus.cited).fillna(False).to_numpy(dtype=bool)
    rec = df["bullet_id"].map(corpus.recency).fillna(-1).to_numpy(dtype=np.float64)
    codes = group_codes(df["session"].to_numpy())
    # Most recent first; ties (same latest turn) -> later bullet first.
    recency_rank = rank_within_groups(rec, codes, order=-df["position"].to_numpy())
    key = tuple(df["bullet_id"])
    if key not in qa_cache:
        qa_cache[key] = RandomKeep(codes, cited, config.qa_draws, config.random_seed)
    return cited, recency_rank, qa_cache[key]


# ------------------------------------------------------------------ over seeds


def _aggregate_seeds(runs: dict[str, Any], pooled: pd.DataFrame, config: EvalSettings) -> dict[str, Any]:
    """One stage over its seeds: mean and spread of every metric, and the pooled score histogram and calibration."""
    a: dict[str, Any] = {"n_seeds": len(runs), "regression": {}, "ranking": {}, "classification": {}, "pruning": {}}
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
        a["pruning"][name] = _aggregate_pruning({int(k): r["pruning"][name] for k, r in runs.items()})
    a["score_histogram"] = M.histogram(pooled["score"].to_numpy(), config.histogram_bins)
    a["calibration"] = M.calibration(pooled["label"].to_numpy(), pooled["score"].to_numpy(), config.calibration_bins)
    return a


def _aggregate_pruning(rows: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """One pruning setting over seeds: its setting, each number (and each QA retention number) aggregated."""
    first = next(iter(rows.values()))
    entry: dict[str, Any] = {"setting": first["setting"]}
    for field_name, v in first.items():
        if field_name == "setting":
            continue
        if field_name == "qa":
            entry["qa"] = {q: aggregate({s: rows[s]["qa"][q] for s in rows}) for q in v}
        else:
            entry[field_name] = aggregate({s: rows[s][field_name] for s in rows})
    return entry


# ------------------------------------------------------------------ significance


def _significance(stages: list[str], per_seed: dict[str, dict[str, Any]], agg: dict[str, Any],
                  session_means: dict[str, pd.DataFrame], config: EvalSettings) -> dict[str, Any]:
    """Each compared pair (stage vs its reference): per metric, the difference, the session Wilcoxon test and
    the paired seed t-test."""
    sig: dict[str, Any] = {}
    for stage, ref in comparisons(stages, config.baseline):
        entry: dict[str, Any] = {"regression": {}, "ranking": {}}
        for family, names in (("regression", M.REGRESSION_METRICS), ("ranking", M.ranking_metric_names(config.ks))):
            for m in names:
                entry[family][m] = _compare(family, m, stage, ref, per_seed, agg, session_means)
        sig[f"{stage}_vs_{ref}"] = {"stage": stage, "reference": ref, **entry}
    return sig


def _compare(family: str, m: str, stage: str, ref: str, per_seed: dict[str, dict[str, Any]], agg: dict[str, Any],
             session_means: dict[str, pd.DataFrame]) -> dict[str, Any]:
    """One metric of `stage` against `ref`: the difference of the seed means and both tests."""
    seed_vals = {
        s: {int(k): (r[family][m] if family == "regression" else r[family][m]["mean"]) for k, r in per_seed[s].items()}
        for s in (stage, ref)
    }
    test_m = m if (family == "ranking" or m in M.SESSION_ERROR_METRICS) else None
    return {
        "diff": agg[stage][family][m]["mean"] - agg[ref][family][m]["mean"],
        "wilcoxon": wilcoxon_sessions(session_means[stage][test_m], session_means[ref][test_m]) if test_m else None,
        "seed_ttest": paired_seed_test(seed_vals[stage], seed_vals[ref]),
    }


def _qa_summary(reference: pd.DataFrame, corpus: Corpus, config: EvalSettings) -> dict[str, Any]:
    """The split's QA evidence: questions, cited bullets, the recency source and the random baseline's draws."""
    cited = reference["bullet_id"].map(corpus.cited).fillna(False).to_numpy(dtype=bool)
    return {
        "n_qa": corpus.n_qa,
        "n_qa_without_evidence": corpus.n_qa_without_evidence,
        "n_cited_bullets": int(cited.sum()),
        "cited_share": float(cited.mean()) if len(cited) else math.nan,
        "recency_source": corpus.recency_source,
        "draws": config.qa_draws,
    }


def run(cfg: EvalConfig) -> dict[str, Any]:
    """Evaluate every stage and seed of `cfg.run`; write metrics.json, report.md, figures; return the metrics.

    A k-fold run (RUN/fold<i>/...) is evaluated on its pooled out-of-fold test predictions (`load_folds`).
    """
    out_dir = cfg.out
    # a run or corpus on object storage is read from this node's copy of it (a run's Ray Train checkpoints left out)
    run_dir = fetch_dir(cfg.run, "run", skip=("ray/",)) if is_uri(cfg.run) else Path(cfg.run)
    data_dir = None if cfg.data is None else fetch_dir(cfg.data, "corpus") if is_uri(cfg.data) else Path(cfg.data)
    folds = discover_folds(run_dir)
    fold_info: dict[str, Any] | None = None
    fold_notes: list[str] = []
    if folds:
        if cfg.splits != ("test",):
            fold_notes.append("k-fold run: only the pooled out-of-fold test predictions are evaluated "
                              "(validation rows are not pooled)")
            cfg = cfg.model_copy(update={"splits": ("test",)})
        layout: dict[str, dict[int, Any]] = {}
    else:
        layout = discover_run(run_dir)
    check_out_location(out_dir, "evaluate")
    check_unit(cfg.tokenizer)
    with OutputSet(out_dir, "evaluate") as outputs:

        with JsonlSink(outputs.path("rejects.jsonl")) as sink:
            ledger = Ledger(sink)
            if folds:
                loaded, fold_info, more = load_folds(folds, ledger)
                fold_notes += more
                layout = {s: {k: run_dir / f"fold*/{s}/seed{k}/predictions.parquet" for k in seeds}
                          for s, seeds in loaded.items()}
            else:
                loaded = {s: {k: load_predictions(p, ledger, cfg.splits) for k, p in seeds.items()}
                          for s, seeds in layout.items()}

        corpus = load_corpus(data_dir, cfg.tokenizer, run_encoder(run_dir)) if data_dir is not None else None

        result: dict[str, Any] = {
            "run_dir": cfg.run,
            "data_dir": cfg.data,
            "config": cfg.model_dump(mode="json"),
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
            if not folds:  # k-fold runs: each fold has its own calibration; not pooled here
                artifacts = {s: {k: Path(p).parent for k, p in seeds.items()} for s, seeds in layout.items()}
                result["splits"][split]["relevance_calibration"] = relevance_calibration(
                    frames, artifacts, cfg.relevance_threshold, cfg.calibration_bins)
            tables.append(table)

        if "test" in result["splits"]:
            result[WORTH_KEY] = stage2_worth(result["splits"]["test"], training_seconds(layout),
                                                      run_labels(run_dir), cfg.stage2_min_gain, cfg.stage2_alpha)
        sessions = pd.concat(tables).reset_index()
        write_table(pa.Table.from_pandas(sessions, preserve_index=False), outputs.path("session_metrics.parquet"))
        clean = jsonable(result)
        write_json(outputs.path("metrics.json"), clean)
        write_report(clean, outputs.staging, figures=cfg.figures)
    clean["outputs"] = {name.split(".")[0]: outputs.final(name) for name in
                        ("metrics.json", "report.md", "session_metrics.parquet", "rejects.jsonl")}
    return clean


def evaluate_run(run_dir: str | Path, out_dir: str | Path, data_dir: str | Path | None = None,
                 settings: EvalSettings | None = None, **fields: Any) -> dict[str, Any]:
    """`run(cfg)` for Python callers: the paths, then `settings` (optional) with `fields` replaced."""
    from memprune.config import validate

    base = settings.model_dump() if settings is not None else {}
    return run(validate(EvalConfig, {**base, **fields, "run": run_dir, "out": str(out_dir), "data": data_dir},
                        "evaluate"))
