"""Scoring the generated replies against the real ones: metrics per condition on paired targets, bootstrap
intervals, paired differences, and the cost (bullets and tokens) of each memory condition."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from memprune.dialogue import metrics as M
from memprune.dialogue.config import DialogueEvalConfig

METRICS = ("bleu", "rouge_l", "bertscore_f1", "mauve")


def token_stats(values: Sequence[float]) -> dict[str, float | None]:
    """Mean, median, 95th percentile (linear interpolation) and total of per-row counts."""
    if not len(values):
        return {"mean": None, "median": None, "p95": None, "total": 0}
    arr = np.asarray(values, dtype=np.float64)
    return {"mean": float(arr.mean()), "median": float(np.median(arr)), "p95": float(np.percentile(arr, 95)),
            "total": float(arr.sum())}


def cost_table(gen: pa.Table, conditions: Sequence[str], unit: str = "targets", notes: str = "bullets"
               ) -> dict[str, dict[str, Any]]:
    """Per condition: rows (`unit`), memory notes (`notes`), prompt and memory tokens per row (mean, median, p95,
    total), the engine's own token counts, and the change of the totals against `all` in percent."""
    rows = gen.select(["condition", "n_memory", "prompt_tokens", "memory_tokens", "tokens_in", "tokens_out"]).to_pylist()
    out: dict[str, dict[str, Any]] = {}
    for c in conditions:
        mine = [r for r in rows if r["condition"] == c]
        out[c] = {
            unit: len(mine),
            notes: token_stats([r["n_memory"] for r in mine]),
            "prompt_tokens": token_stats([r["prompt_tokens"] for r in mine]),
            "memory_tokens": token_stats([r["memory_tokens"] for r in mine]),
            "engine_tokens_in": sum(r["tokens_in"] or 0 for r in mine),
            "engine_tokens_out": sum(r["tokens_out"] or 0 for r in mine),
        }
    if "all" in out:
        base = out["all"]
        for c, entry in out.items():
            for key in ("prompt_tokens", "memory_tokens", notes):
                b, v = base[key]["total"], entry[key]["total"]
                entry[f"{key}_vs_all_pct"] = 100.0 * (v - b) / b if b else None
    return out


def score_replies(gen: pa.Table, conditions: list[str], cfg: DialogueEvalConfig, encoder: Any,
                  bertscore: M.BertScore | None) -> dict[str, Any]:
    """Metrics per condition on the targets that have a reply under every condition (paired), with intervals."""
    rows = gen.select(["turn_id", "condition", "reference", "reply"]).to_pylist()
    by_turn: dict[str, dict[str, str | None]] = {}
    refs: dict[str, str] = {}
    for r in rows:
        by_turn.setdefault(r["turn_id"], {})[r["condition"]] = r["reply"]
        refs[r["turn_id"]] = r["reference"]
    paired = [t for t, replies in by_turn.items() if all(replies.get(c) for c in conditions)]
    n = len(paired)
    result: dict[str, Any] = {"targets": len(by_turn), "paired": n, "per_condition": {}, "comparisons": {},
                              "notes": []}
    if n == 0:
        result["notes"].append("no target has a reply under every condition: no metrics")
        return result
    references = [refs[t] for t in paired]
    hyps = {c: [str(by_turn[t][c]) for t in paired] for c in conditions}
    conf = cfg.bootstrap.confidence
    idx = M.bootstrap_indices(n, cfg.bootstrap.samples, cfg.bootstrap.seed)
    boots: dict[str, dict[str, np.ndarray]] = {c: {} for c in conditions}
    points: dict[str, dict[str, float | None]] = {c: {} for c in conditions}
    extra: dict[str, dict[str, Any]] = {c: {} for c in conditions}

    for c in conditions:
        stats = M.bleu_stats(hyps[c], references)
        points[c]["bleu"] = M.bleu_from_stats(stats.sum(axis=0))
        rouge = M.rouge_l(hyps[c], references)
        points[c]["rouge_l"] = float(rouge.mean())
        if len(idx):
            boots[c]["bleu"] = M.bleu_bootstrap(stats, idx)
            boots[c]["rouge_l"] = M.mean_bootstrap(rouge, idx)
    if bertscore is not None:
        flat = [h for c in conditions for h in hyps[c]]
        scores = bertscore(flat, references * len(conditions))
        for k, c in enumerate(conditions):
            part = {m: v[k * n:(k + 1) * n] for m, v in scores.items()}
            points[c]["bertscore_f1"] = float(part["f1"].mean())
            extra[c]["bertscore_precision"] = float(part["precision"].mean())
            extra[c]["bertscore_recall"] = float(part["recall"].mean())
            if len(idx):
                boots[c]["bertscore_f1"] = M.mean_bootstrap(part["f1"], idx)
    else:
        result["notes"].append("BERTScore disabled")
    mauve_cfg = cfg.mauve
    if mauve_cfg.enabled and n >= mauve_cfg.min_samples:
        settings = M.MauveSettings(num_buckets=mauve_cfg.num_buckets, kmeans_num_redo=mauve_cfg.kmeans_num_redo,
                                   kmeans_max_iter=mauve_cfg.kmeans_max_iter, seed=mauve_cfg.seed)
        texts = sorted(set(references) | {h for c in conditions for h in hyps[c]})
        emb = encoder.encode(texts)
        index = {t: i for i, t in enumerate(texts)}
        p = emb[[index[t] for t in references]]
        midx = idx[:mauve_cfg.bootstrap]
        for c in conditions:
            q = emb[[index[t] for t in hyps[c]]]
            points[c]["mauve"] = M.mauve_score(p, q, settings)
            if len(midx):
                boots[c]["mauve"] = M.mauve_bootstrap(p, q, midx, settings)
        if not len(midx):
            result["notes"].append("MAUVE is a corpus-level score reported as a point value without an interval "
                                   "(set mauve.bootstrap to resample it; each resample reclusters)")
        if n < 500:
            result["notes"].append(f"MAUVE on {n} paired targets: it is a distribution-level score and is noisy "
                                   f"below a few hundred samples (num_buckets {'auto = n/10' if settings.num_buckets is None else settings.num_buckets})")
    elif mauve_cfg.enabled:
        result["notes"].append(f"MAUVE not computed: {n} paired targets < mauve.min_samples {mauve_cfg.min_samples}")
    for c in conditions:
        entry = {m: M.with_interval(points[c].get(m), boots[c].get(m), conf) for m in METRICS}
        entry.update(extra[c])
        entry["n"] = n
        result["per_condition"][c] = entry
    result["comparisons"] = M.comparisons(points, boots, conditions, METRICS, conf)
    return result
