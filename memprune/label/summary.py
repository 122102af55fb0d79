"""`label.json` of a judged run: counts that reconcile, error rate, throughput, cost, and what each judge mode adds
(listwise lists and fallbacks, order agreement and position bias; likelihood gains; consensus agreement)."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from memprune.label.aggregate import ALL_PAIRS_FAILED
from memprune.label.config import LabelConfig
from memprune.label.pairs import NO_NEXT_SESSION, NO_SPEAKER, NO_TARGET_TURNS, PairPlan
from memprune.timing import time_split

UNLABELLED_REASONS = (NO_NEXT_SESSION, NO_SPEAKER, NO_TARGET_TURNS, ALL_PAIRS_FAILED)
PLANNED_SUMS = ("calls", "prompt_tokens", "generated_tokens", "effective_tokens")


def _counts(plan: PairPlan, pairs: pa.Table, labels: pa.Table, unlabelled: list[dict[str, Any]]) -> dict[str, Any]:
    n_pairs = pairs.num_rows
    n_err = n_pairs - pairs.column("error").null_count
    reasons = Counter(u["reason"] for u in unlabelled)
    partially = 0
    if n_err:
        per_bullet = Counter(b for b, e in zip(pairs.column("bullet_id").to_pylist(),
                                               pairs.column("error").to_pylist()) if e is not None)
        labelled_ids = set(labels.column("bullet_id").to_pylist())
        partially = sum(1 for b in per_bullet if b in labelled_ids)
    return {
        "bullets": plan.n_bullets,
        "bullets_labelled": labels.num_rows,
        "bullets_unlabelled": len(unlabelled),
        **{f"unlabelled_{r}": reasons.get(r, 0) for r in UNLABELLED_REASONS},
        "bullets_partially_failed": partially,
        "pairs": n_pairs,
        "pairs_scored": n_pairs - n_err,
        "pairs_error": n_err,
        "pairs_by_horizon": {str(h): c for h, c in sorted(Counter(pairs.column("horizon").to_pylist()).items())},
        "pairs_by_mode": dict(sorted(Counter(pairs.column("judge_mode").to_pylist()).items())),
    }


def _stats(values: np.ndarray) -> dict[str, Any]:
    return {
        "mean": float(values.mean()) if values.size else None,
        "std": float(values.std()) if values.size else None,
        "min": float(values.min()) if values.size else None,
        "max": float(values.max()) if values.size else None,
    }


def planned_cost(cfg: LabelConfig, plan: PairPlan, specs: list[Any]) -> dict[str, Any]:
    """The `--plan` numbers of the judges that ran (each with its own tokenizer), summed."""
    from memprune.label.cost import PromptCounter, plan_mode

    per_judge = []
    for spec in specs:
        counter = PromptCounter(spec.llm.model, cfg.cost.tokenizer, spec.llm.trust_remote_code)
        entry = plan_mode(spec.mode, plan, counter, spec.llm, cfg.listwise, cfg.cost, spec.samples)
        per_judge.append({"judge": spec.name, "tokenizer": counter.name, **entry})
    total = {k: sum(p[k] for p in per_judge) for k in PLANNED_SUMS}
    pairs = plan.pairs.num_rows
    cached = sum(p["prefix_cache_reusable_share"] * p["prompt_tokens"] for p in per_judge
                 if p["prefix_cache_reusable_share"] is not None)
    total.update(prompt_tokens_per_pair=total["prompt_tokens"] / pairs if pairs else None,
                 prefix_cache_reusable_share=cached / total["prompt_tokens"] if total["prompt_tokens"] else None,
                 gpu_hours=sum(p["gpu_hours"] for p in per_judge) if cfg.cost.throughput else None)
    return {"total": total, "per_judge": per_judge}


def cost_section(cfg: LabelConfig, plan: PairPlan, specs: list[Any], counters: dict[str, int],
                 pairs_scored: int) -> dict[str, Any]:
    """What the run cost (engine-reported calls and tokens, retries and fallbacks included) and its plan."""
    planned = planned_cost(cfg, plan, specs)
    calls, t_in, t_out = counters.get("calls", 0), counters.get("tokens_in", 0), counters.get("tokens_out", 0)
    return {
        "tokenizer": sorted({p["tokenizer"] for p in planned["per_judge"]}),
        "measured": {
            "llm_calls": calls,
            "prompt_tokens": t_in,
            "generated_tokens": t_out,
            "calls_per_labelled_pair": calls / pairs_scored if pairs_scored else None,
            "prompt_tokens_per_labelled_pair": t_in / pairs_scored if pairs_scored else None,
            "tokens_per_labelled_pair": (t_in + t_out) / pairs_scored if pairs_scored else None,
            "source": "engine-reported token counts (the judge model's tokenizer), all attempts and fallbacks",
        },
        "planned": planned["total"],
        "planned_per_judge": planned["per_judge"],
    }


def listwise_section(stats: dict[str, Any], tables: list[pa.Table]) -> dict[str, Any]:
    """Lists sent and failed, chunks that fell back to pairwise, order agreement and position bias."""
    from memprune.label.listwise import order_agreement, position_bias

    c = stats.get("counters", {})
    table = pa.concat_tables(tables) if tables else None
    return {
        "lists_planned": stats.get("lists_planned"),
        "lists_sent": c.get("lists", 0),
        "lists_failed": c.get("lists_failed", 0),
        "lists_parsed_strictly": c.get("lists_strict", 0),
        "chunks_fallback": c.get("chunks_fallback", 0),
        "pairs_fallback": c.get("pairs_fallback", 0),
        "order_agreement": order_agreement(table) if table is not None else None,
        "position_bias": position_bias(table) if table is not None else None,
    }


def likelihood_section(cfg: LabelConfig, stats: dict[str, Any], tables: list[pa.Table]) -> dict[str, Any]:
    """Baselines scored (one per target turn), the gain distribution (all judges) and the squashing used."""
    gains = np.concatenate([t.column("gain").to_numpy(zero_copy_only=False).astype(np.float64) for t in tables]) \
        if tables else np.zeros(0)
    gains = gains[np.isfinite(gains)]
    c = stats.get("counters", {})
    served = c.get("replicas_served", 0) / c["engine_passes"] if c.get("engine_passes") and c.get("replicas_served") \
        else None
    return {"baselines": c.get("baselines", 0), "replicas_served_per_pass": served, "mapping": cfg.likelihood.mapping,
            "scale": cfg.likelihood.scale, "gain_nats_per_token": _stats(gains),
            "gain_positive_share": float((gains > 0).mean()) if gains.size else None}


def judge_summary(cfg: LabelConfig, plan: PairPlan, pairs: pa.Table, labels: pa.Table,
                  unlabelled: list[dict[str, Any]], judge_name: str, inputs: dict[str, str], work_dirs: list[str],
                  stats: dict[str, Any], wall_s: float, extra: dict[str, Any]) -> dict[str, Any]:
    """The `label.json` content of a judged run."""
    counts = _counts(plan, pairs, labels, unlabelled)
    n_err = counts["pairs_error"]
    label_vals = labels.column("label").to_numpy() if labels.num_rows else np.zeros(0)
    reconciles = (
        counts["bullets"] == counts["bullets_labelled"] + counts["bullets_unlabelled"]
        and counts["pairs"] == counts["pairs_scored"] + counts["pairs_error"]
        and int(pc.sum(labels.column("n_pairs")).as_py() or 0) == counts["pairs_scored"]
    )
    judge_s = stats.get("judge_s") or 0.0
    judged = stats.get("pairs_judged", 0)
    c = stats.get("counters", {})
    mode = "similarity" if cfg.judge == "similarity" else ("likelihood" if cfg.judge == "likelihood" else cfg.judge_mode)
    summary: dict[str, Any] = {
        "stage": "label",
        "source": "judge",
        "judge": judge_name,
        "judge_mode": mode,
        "proxy": cfg.judge == "similarity",
        "config": json.loads(cfg.model_dump_json()),
        "inputs": {"sessions.parquet": inputs["sessions"], "bullets.parquet": inputs["bullets"]},
        "counts": counts,
        "reconciles": reconciles,
        "error_rate": (n_err / counts["pairs"]) if counts["pairs"] else 0.0,
        "errors_by_message": dict(Counter(e for e in pairs.column("error").to_pylist() if e is not None).most_common(10)),
        "labels": {"aggregation": cfg.aggregation, "decay": cfg.decay, **_stats(label_vals),
                   "at_least_0.5": int((label_vals >= 0.5).sum())},
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
        # similarity: the encoder passes and the pair scoring; LLM judges: the judging passes, engine start-up
        # included (the engines do not report their busy time); the rest is reading, planning, Ray, writing
        "timing": time_split(wall_s, stats.get("compute_s", judge_s),
                             compute="encoder passes" if cfg.judge == "similarity"
                             else "judging passes (engine start-up included)"),
        "tokens": {"in": c.get("tokens_in"), "out": c.get("tokens_out"), "attempts": c.get("calls")},
        "work_dir": work_dirs[0] if work_dirs else None,
        "work_dirs": work_dirs,
        "outputs": ["pairs.parquet", "labels.parquet", "unlabelled.jsonl", "label.json", "label.md"],
    }
    judged_runs = extra.get("judged")
    if judged_runs is not None:
        specs = extra["specs"]
        summary["judges"] = judged_runs.names
        summary["cost"] = cost_section(cfg, plan, specs, c, counts["pairs_scored"])
        if any(s.mode == "listwise" for s in specs):
            summary["listwise"] = listwise_section(stats, judged_runs.tables)
        if cfg.judge == "likelihood":
            summary["likelihood"] = likelihood_section(cfg, stats, judged_runs.tables)
    if "agreement" in extra:
        summary["agreement"] = extra["agreement"]
        summary["labels"]["agreement"] = _stats(labels.column("agreement").to_numpy()) if labels.num_rows else None
        summary["outputs"].insert(2, "pairs_by_judge.parquet")
    return summary
