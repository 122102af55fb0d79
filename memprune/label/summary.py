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
from memprune.label.judges import JUDGES
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


def value_stats(values: np.ndarray) -> dict[str, Any]:
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
    entry = cfg.judge_entry()
    summary: dict[str, Any] = {
        "stage": "label",
        "source": "judge",
        "judge": judge_name,
        "judge_mode": entry.kind,
        "proxy": entry.proxy,
        "config": json.loads(cfg.model_dump_json()),
        "inputs": {"sessions.parquet": inputs["sessions"], "bullets.parquet": inputs["bullets"]},
        "counts": counts,
        "reconciles": reconciles,
        "error_rate": (n_err / counts["pairs"]) if counts["pairs"] else 0.0,
        "errors_by_message": dict(Counter(e for e in pairs.column("error").to_pylist() if e is not None).most_common(10)),
        "labels": {"aggregation": cfg.aggregation, "decay": cfg.decay, **value_stats(label_vals),
                   "at_least_0.5": int((label_vals >= 0.5).sum())},
        "throughput": {
            "pairs_judged_this_run": judged,
            "judge_s": round(judge_s, 3),
            "pairs_per_s": round(judged / judge_s, 1) if judged and judge_s > 0 else None,
            "wall_s": round(wall_s, 3),
            "texts_encoded": stats.get("texts"),
            "shards_total": stats.get("shards_total", 0),
            "shards_reused": stats.get("shards_reused", 0),
            "executor": entry.executor(cfg) if entry.executor else "ray",
        },
        # similarity: the encoder passes and the pair scoring; LLM judges: the judging passes, engine start-up
        # included (the engines do not report their busy time); the rest is reading, planning, Ray, writing
        "timing": time_split(wall_s, stats.get("compute_s", judge_s),
                             compute=entry.compute),
        "tokens": {"in": c.get("tokens_in"), "out": c.get("tokens_out"), "attempts": c.get("calls")},
        "work_dir": work_dirs[0] if work_dirs else None,
        "work_dirs": work_dirs,
        "outputs": ["pairs.parquet", "labels.parquet", "unlabelled.jsonl", "label.json", "label.md"],
    }
    judged_runs = extra.get("judged")
    if judged_runs is not None and judged_runs.specs:  # model judges: what they cost, what each kind reports
        specs = judged_runs.specs
        summary["judges"] = judged_runs.names
        summary["cost"] = cost_section(cfg, plan, specs, c, counts["pairs_scored"])
        for kind, judge in JUDGES.items():
            if judge.report is not None and any(s.mode == kind for s in specs):
                summary[kind] = judge.report(cfg, stats, judged_runs.tables)
    if "agreement" in extra:
        summary["agreement"] = extra["agreement"]
        summary["labels"]["agreement"] = value_stats(labels.column("agreement").to_numpy()) if labels.num_rows else None
        summary["outputs"].insert(2, "pairs_by_judge.parquet")
    return summary
