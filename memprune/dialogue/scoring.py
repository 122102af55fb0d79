"""Scoring the generated replies against the real ones: metrics per condition on paired targets, bootstrap
intervals and paired differences (`memprune.memory.bootstrap`; the cost per condition is
`memprune.memory.cost.cost_table`)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

from memprune.dialogue import metrics as M
from memprune.dialogue.config import DialogueEvalConfig
from memprune.memory import bootstrap as B

METRICS = ("bleu", "rouge_l", "bertscore_f1", "mauve")


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
    idx = B.bootstrap_indices(n, cfg.bootstrap.samples, cfg.bootstrap.seed)
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
            boots[c]["rouge_l"] = B.mean_bootstrap(rouge, idx)
    if bertscore is not None:
        flat = [h for c in conditions for h in hyps[c]]
        scores = bertscore(flat, references * len(conditions))
        for k, c in enumerate(conditions):
            part = {m: v[k * n:(k + 1) * n] for m, v in scores.items()}
            points[c]["bertscore_f1"] = float(part["f1"].mean())
            extra[c]["bertscore_precision"] = float(part["precision"].mean())
            extra[c]["bertscore_recall"] = float(part["recall"].mean())
            if len(idx):
                boots[c]["bertscore_f1"] = B.mean_bootstrap(part["f1"], idx)
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
        entry = {m: B.with_interval(points[c].get(m), boots[c].get(m), conf) for m in METRICS}
        entry.update(extra[c])
        entry["n"] = n
        result["per_condition"][c] = entry
    result["comparisons"] = B.comparisons(points, boots, conditions, METRICS, conf)
    return result
