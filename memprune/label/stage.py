"""`memprune label`: pseudo labels for bullets from a judge over bullet x next-session turn pairs (DESIGN step 2).

Reads `DATA/sessions.parquet` and `DATA/bullets.parquet` (written by `memprune ingest` or
`memprune summarize`), builds the pairs (`memprune.label.pairs`), judges them (similarity proxy
or LLM judge), aggregates them into labels (`memprune.label.aggregate`) and writes into `OUT`:

- `pairs.parquet`   bullet_id, turn_id, score, judge, error (+ horizon), sorted by (bullet_id, turn_id);
- `labels.parquet`  bullet_id, label, n_pairs, aggregation, source, sorted by bullet_id;
- `unlabelled.jsonl` every bullet without a label and why;
- `label.json` / `label.md` counts that reconcile, error rate, pairs/s, tokens.

Other label sources (`source: qa | usage`, `memprune.label.sources`) skip the judge.

Resumable: the work is cut into deterministic shards, each written atomically under
`OUT/.work/<fingerprint>/` (the fingerprint hashes the inputs and every option that changes
the judged values, not decay or aggregation). A rerun of the same command reuses finished
shards, redoes the rest and assembles byte-identical tables.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from memprune.io import JsonlSink, OutputSet, check_out, read_table, write_jsonl, write_summary, write_table
from memprune.label import sources
from memprune.label.aggregate import ALL_PAIRS_FAILED, aggregate
from memprune.label.config import LabelConfig, LabelError
from memprune.label.pairs import (
    NO_NEXT_SESSION,
    NO_SPEAKER,
    NO_TARGET_TURNS,
    PairPlan,
    build_pairs,
)
from memprune.label.report import render_markdown, render_source_markdown
from memprune.rejects import Ledger
from memprune.schema import PAIRS
from memprune.work import WorkDir, file_digest

WORK_VERSION = 1
UNLABELLED_REASONS = (NO_NEXT_SESSION, NO_SPEAKER, NO_TARGET_TURNS, ALL_PAIRS_FAILED)

# pairs.parquet: the PAIRS contract plus the horizon, so labels can be recomputed from it alone.
PAIRS_OUT = PAIRS.append(pa.field("horizon", pa.int32(), nullable=False))


def _work_payload(cfg: LabelConfig, inputs: dict[str, str], judge_settings: dict[str, Any]) -> dict[str, Any]:
    """What the shards depend on: inputs, pair set, judge settings, sharding. Not decay/aggregation."""
    payload: dict[str, Any] = {
        "version": WORK_VERSION,
        "inputs": inputs,
        "judge": cfg.judge,
        "speaker": cfg.speaker,
        "horizon": cfg.horizon,
        "order": cfg.order,
        "shard_size": cfg.effective_shard_size(),
        "judge_settings": judge_settings,
    }
    if cfg.judge == "llm":
        payload["context_turns"] = cfg.context_turns
    return payload



def run_judge(cfg: LabelConfig) -> dict[str, Any]:
    """Run the labeling stage described by `cfg`; return the `label.json` summary."""
    started = time.perf_counter()
    data, out = Path(cfg.data), check_out(cfg.out, "label")
    sessions_path, bullets_path = data / "sessions.parquet", data / "bullets.parquet"
    sessions = read_table(sessions_path, "sessions")
    bullets = read_table(bullets_path, "bullets")
    inputs = {"sessions": file_digest(sessions_path), "bullets": file_digest(bullets_path)}
    options = cfg.pair_options()

    if cfg.judge == "similarity":
        from memprune.label.similarity import SimilarityJudge

        sim = cfg.similarity
        judge: Any = SimilarityJudge(sim.model, batch_size=sim.batch_size, max_length=sim.max_length,
                                     mapping=sim.mapping, device=sim.device)
        # The shards hold embeddings: the cosine -> score mapping is applied afterwards, on every run.
        settings = {"model": judge.model_name, "max_length": sim.max_length}
    else:
        from memprune.label.llm_judge import LLMJudge

        llm_config = cfg.llm_settings()
        llm_config.check_model()
        judge = LLMJudge(llm_config)
        settings = {"llm": llm_config.model_dump(mode="json")}

    plan = build_pairs(sessions, bullets, options, with_context=cfg.judge == "llm")
    work = WorkDir(out, _work_payload(cfg, inputs, settings))
    stats: dict[str, Any] = {}
    if cfg.judge == "similarity":
        from memprune.label.similarity import judge_similarity

        scores, errors = judge_similarity(cfg, plan, work, judge, stats)
    else:
        from memprune.label.llm_judge import judge_llm

        scores, errors = judge_llm(cfg, plan, work, judge, stats)

    n = plan.pairs.num_rows
    score_arr = pa.array([None if (e is not None or np.isnan(s)) else float(s) for s, e in zip(scores, errors)],
                         type=pa.float64()) if n else pa.array([], type=pa.float64())
    pairs = pa.table(
        {
            "bullet_id": plan.pairs.column("bullet_id"),
            "turn_id": plan.pairs.column("turn_id"),
            "score": score_arr,
            "judge": pa.array([judge.name] * n, type=pa.string()),
            "error": pa.array(errors, type=pa.string()),
            "horizon": plan.pairs.column("horizon"),
        },
        schema=PAIRS_OUT,
    ).sort_by([("bullet_id", "ascending"), ("turn_id", "ascending")]).combine_chunks()
    labels, failed = aggregate(pairs, cfg.decay, cfg.aggregation)

    unlabelled = sorted(
        [{"bullet_id": b, "reason": r, "n_pairs": 0, "n_errors": 0} for b, r in plan.unpaired] + failed,
        key=lambda d: d["bullet_id"],
    )
    summary = _summary(cfg, plan, pairs, labels, unlabelled, judge.name, inputs, work, stats,
                       time.perf_counter() - started)
    with OutputSet(out, "label") as outputs:
        write_table(pairs, outputs.path("pairs.parquet"), "pairs")
        write_table(labels, outputs.path("labels.parquet"), "labels")
        write_jsonl(outputs.path("unlabelled.jsonl"), unlabelled)
        write_summary(outputs.staging, "label", summary, render_markdown(summary))
    return summary


def _summary(cfg: LabelConfig, plan: PairPlan, pairs: pa.Table, labels: pa.Table, unlabelled: list[dict[str, Any]],
             judge_name: str, inputs: dict[str, str], work: WorkDir, stats: dict[str, Any],
             wall_s: float) -> dict[str, Any]:
    """The `label.json` content: counts that reconcile, error rate, throughput, tokens."""
    n_pairs = pairs.num_rows
    n_err = n_pairs - pairs.column("error").null_count
    reasons = Counter(u["reason"] for u in unlabelled)
    label_vals = labels.column("label").to_numpy() if labels.num_rows else np.zeros(0)
    errors_by_message = Counter(e for e in pairs.column("error").to_pylist() if e is not None)
    partially = 0
    if n_err:
        per_bullet = Counter(b for b, e in zip(pairs.column("bullet_id").to_pylist(),
                                               pairs.column("error").to_pylist()) if e is not None)
        labelled_ids = set(labels.column("bullet_id").to_pylist())
        partially = sum(1 for b in per_bullet if b in labelled_ids)
    counts = {
        "bullets": plan.n_bullets,
        "bullets_labelled": labels.num_rows,
        "bullets_unlabelled": len(unlabelled),
        **{f"unlabelled_{r}": reasons.get(r, 0) for r in UNLABELLED_REASONS},
        "bullets_partially_failed": partially,
        "pairs": n_pairs,
        "pairs_scored": n_pairs - n_err,
        "pairs_error": n_err,
        "pairs_by_horizon": {str(h): c for h, c in sorted(Counter(pairs.column("horizon").to_pylist()).items())},
    }
    reconciles = (
        counts["bullets"] == counts["bullets_labelled"] + counts["bullets_unlabelled"]
        and counts["pairs"] == counts["pairs_scored"] + counts["pairs_error"]
        and int(pc.sum(labels.column("n_pairs")).as_py() or 0) == counts["pairs_scored"]
    )
    judge_s = stats.get("judge_s") or 0.0
    judged = stats.get("pairs_judged", 0)
    return {
        "stage": "label",
        "source": "judge",
        "judge": judge_name,
        "proxy": cfg.judge == "similarity",
        "config": json.loads(cfg.model_dump_json()),
        "inputs": {"sessions.parquet": inputs["sessions"], "bullets.parquet": inputs["bullets"]},
        "counts": counts,
        "reconciles": reconciles,
        "error_rate": (n_err / n_pairs) if n_pairs else 0.0,
        "errors_by_message": dict(errors_by_message.most_common(10)),
        "labels": {
            "aggregation": cfg.aggregation,
            "decay": cfg.decay,
            "mean": float(label_vals.mean()) if label_vals.size else None,
            "std": float(label_vals.std()) if label_vals.size else None,
            "min": float(label_vals.min()) if label_vals.size else None,
            "max": float(label_vals.max()) if label_vals.size else None,
            "at_least_0.5": int((label_vals >= 0.5).sum()),
        },
        "throughput": {
            "pairs_judged_this_run": judged,
            "judge_s": round(judge_s, 3),
            "pairs_per_s": round(judged / judge_s, 1) if judged and judge_s > 0 else None,
            "wall_s": round(wall_s, 3),
            "texts_encoded": stats.get("texts"),
            "shards_total": stats.get("shards_total", 0),
            "shards_reused": stats.get("shards_reused", 0),
            "executor": cfg.similarity.executor if cfg.judge == "similarity" else "ray",
        },
        "tokens": {"in": stats.get("tokens_in"), "out": stats.get("tokens_out"), "attempts": stats.get("attempts")},
        "work_dir": str(work.path),
        "outputs": ["pairs.parquet", "labels.parquet", "unlabelled.jsonl", "label.json", "label.md"],
    }


def run_source(cfg: LabelConfig) -> dict[str, Any]:
    """Labels from the `qa` or `usage` source (no judge); write labels.parquet, unlabelled.jsonl, label.json/md.

    One pass over the inputs, cheap next to judging: a rerun recomputes everything and
    writes the same tables (every output is written atomically). Usage events that cannot
    be used are written to `OUT/rejects.jsonl` with file, record, field and reason.
    """
    started = time.perf_counter()
    data, out = Path(cfg.data), check_out(cfg.out, "label")
    bullets_path = data / "bullets.parquet"
    bullets = read_table(bullets_path, "bullets")
    inputs: dict[str, str] = {"bullets.parquet": file_digest(bullets_path)}
    with OutputSet(out, "label") as outputs:
        return _run_source(cfg, data, bullets, inputs, outputs, started)


def _run_source(cfg: LabelConfig, data: Path, bullets: pa.Table, inputs: dict[str, str], outputs: OutputSet,
                started: float) -> dict[str, Any]:
    ledger_summary: dict[str, Any] | None = None
    if cfg.source == "qa":
        qa_path, sessions_path = data / "qa.parquet", data / "sessions.parquet"
        if not qa_path.is_file():
            raise LabelError(f"{qa_path}: no such file; source qa needs a corpus with a qa table "
                             "(e.g. `memprune ingest --format locomo`)")
        qa = read_table(qa_path, "qa")
        sessions = read_table(sessions_path, "sessions") if sessions_path.is_file() else None
        inputs["qa.parquet"] = file_digest(qa_path)
        if sessions is not None:
            inputs["sessions.parquet"] = file_digest(sessions_path)
        q = cfg.qa
        try:
            options = sources.QAOptions(grading=q.grading, grade_cap=q.grade_cap, later_only=q.later_only,
                                        categories=tuple(q.categories) if q.categories is not None else None)
        except ValueError as exc:
            raise LabelError(str(exc)) from exc
        result = sources.qa_labels(bullets, qa, sessions, options)
        rule = options.rule()
    else:
        u = cfg.usage
        assert u.log is not None  # checked by the config
        try:
            options_u = sources.UsageOptions(aggregation=u.aggregation, missing=u.missing, since=u.since, until=u.until)
        except ValueError as exc:
            raise LabelError(str(exc)) from exc
        bullet_conv = dict(zip(bullets.column("bullet_id").to_pylist(), bullets.column("conversation_id").to_pylist()))
        with JsonlSink(outputs.path("rejects.jsonl")) as sink:
            ledger = Ledger(sink)
            files = sources.usage_files(u.log)
            totals, log_counts = sources.read_usage_log(u.log, bullet_conv, ledger, options_u)
        for f in files:
            inputs[f"usage:{f}"] = file_digest(f)
        result = sources.usage_labels(bullets, totals, options_u, log_counts)
        ledger_summary = ledger.summary()
        rule = options_u.rule()

    write_table(result.labels, outputs.path("labels.parquet"), "labels")
    write_jsonl(outputs.path("unlabelled.jsonl"), result.unlabelled)

    c = result.counts
    reconciles = c["bullets"] == c["bullets_labelled"] + c["bullets_unlabelled"]
    if ledger_summary is not None:
        reconciles = reconciles and ledger_summary["conservation"] == "ok" and (
            c["events"] == c["events_counted"] + c["events_outside_window"] + c["events_rejected"])
    vals = result.labels.column("label").to_numpy() if result.labels.num_rows else np.zeros(0)
    files = ["labels.parquet", "unlabelled.jsonl", "label.json", "label.md"]
    if ledger_summary is not None:
        files.insert(2, "rejects.jsonl")
    summary: dict[str, Any] = {
        "stage": "label",
        "source": cfg.source,
        "judge": None,
        "rule": rule,
        "proxy": False,
        "config": json.loads(cfg.model_dump_json()),
        "inputs": inputs,
        "counts": c,
        "reconciles": bool(reconciles),
        "labels": {
            "aggregation": rule,
            "mean": float(vals.mean()) if vals.size else None,
            "std": float(vals.std()) if vals.size else None,
            "min": float(vals.min()) if vals.size else None,
            "max": float(vals.max()) if vals.size else None,
            "at_least_0.5": int((vals >= 0.5).sum()),
        },
        "throughput": {"wall_s": round(time.perf_counter() - started, 3)},
        "outputs": files,
    }
    if ledger_summary is not None:
        summary["ledger"] = ledger_summary
    write_summary(outputs.staging, "label", summary, render_source_markdown(summary))
    return summary


def run(cfg: LabelConfig) -> dict[str, Any]:
    """Run the labeling stage described by `cfg` (judge, qa or usage source); return the `label.json` summary."""
    return run_judge(cfg) if cfg.source == "judge" else run_source(cfg)
