"""Is stage 2 worth its cost? Stage 2 against stage 1 on every ranking metric, training seconds, a computed verdict.

The two stages are the last trained stage and the stage it starts from (`memprune.stages.verdict_pair`: stage 2
and its `init_from`, stage 1). The verdict is a rule, not prose: stage 2 is recommended for a run's label source
only when it beats stage 1 on the test split's session-level Spearman by at least `stage2_min_gain` with a Wilcoxon
signed-rank p-value (over sessions) below `stage2_alpha`; otherwise the recommendation is stage 1.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from memprune import stages as registry
from memprune.markdown import fmt, fmt_p, table

HEADLINE = "spearman"  # the session-level Spearman: the paper's headline metric
# The verdict's two stages: the last trained stage and the one it starts from (memprune/stages.py's init_from)
STAGE, START = registry.verdict_pair()
KEY = f"{STAGE}_vs_{START}"  # its significance entry, and its key in metrics.json
LABEL, START_LABEL = registry.label(STAGE), registry.label(START)  # "Stage 2", "Stage 1"


def training_seconds(layout: dict[str, dict[int, Any]]) -> dict[str, dict[str, Any]]:
    """Per stage: the training wall seconds of each seed (its train.json beside the predictions) and their mean."""
    out: dict[str, dict[str, Any]] = {}
    for stage, seeds in layout.items():
        per_seed: dict[str, float] = {}
        for seed, pred in seeds.items():
            train_json = Path(str(pred)).parent / "train.json"
            if train_json.is_file():
                wall = json.loads(train_json.read_text()).get("wall_s")
                if wall is not None:
                    per_seed[str(seed)] = float(wall)
        if per_seed:
            out[stage] = {"per_seed": per_seed, "mean": sum(per_seed.values()) / len(per_seed)}
    return out


def run_labels(run_dir: Path) -> list[str]:
    """The label directories the run was trained on (run.json), so the verdict names its label source."""
    run_json = Path(run_dir) / "run.json"
    if not run_json.is_file():
        return []
    return [str(x) for x in json.loads(run_json.read_text()).get("labels", [])]


def stage2_worth(split: dict[str, Any] | None, seconds: dict[str, dict[str, Any]], labels: list[str],
                 min_gain: float, alpha: float) -> dict[str, Any] | None:
    """Stage 2 vs stage 1 on one split: each ranking metric's means, difference and p-values, seconds per seed,
    and the recommendation by the rule above; None when the run lacks either stage."""
    sig = (split or {}).get("significance", {}).get(KEY)
    if sig is None:
        return None
    agg = split["aggregate"]
    rows = []
    for metric, entry in sig["ranking"].items():
        w, t = entry.get("wilcoxon") or {}, entry.get("seed_ttest") or {}
        rows.append({"metric": metric, START: agg[START]["ranking"][metric]["mean"],
                     STAGE: agg[STAGE]["ranking"][metric]["mean"], "diff": entry["diff"],
                     "p_wilcoxon": w.get("p"), "n_sessions": w.get("n_sessions"), "p_seed_ttest": t.get("p")})
    head = next(r for r in rows if r["metric"] == HEADLINE)
    gain, p = head["diff"], head["p_wilcoxon"]
    ok = gain is not None and math.isfinite(gain) and gain >= min_gain and p is not None and math.isfinite(p) and p < alpha
    s1, s2 = (seconds.get(s, {}).get("mean") for s in (START, STAGE))
    source = ", ".join(labels) if labels else "this run's labels"
    one, two = START_LABEL.lower(), LABEL.lower()
    statement = (f"Recommended for {source}: {two if ok else one}. {LABEL} − {one} on test session "
                 f"Spearman is {fmt(gain)} (Wilcoxon p = {fmt_p(p)}, {head['n_sessions']} sessions); the rule asks "
                 f"for at least +{min_gain} at p < {alpha}, which {'is' if ok else 'is not'} met. Training per seed: "
                 f"{one} {fmt(s1, 1)} s, {two} {fmt(s2, 1)} s.")
    return {"rows": rows, "seconds": seconds, "labels": labels, "min_gain": min_gain, "alpha": alpha,
            "gain": gain, "p": p, "recommend": STAGE if ok else START, "statement": statement}


def worth_table(worth: dict[str, Any]) -> list[str]:
    """The Markdown of the verdict: one row per ranking metric, a row of seconds per seed, the statement."""
    rows = [[r["metric"], fmt(r[START]), fmt(r[STAGE]), fmt(r["diff"]),
             f"{fmt_p(r['p_wilcoxon'])} (n={r['n_sessions']})", fmt_p(r["p_seed_ttest"])] for r in worth["rows"]]
    secs = worth["seconds"]

    def per_seed(stage: str) -> str:
        e = secs.get(stage)
        return "—" if not e else f"{fmt(e['mean'], 1)} ({', '.join(fmt(v, 1) for v in e['per_seed'].values())})"

    rows.append(["training s per seed (mean; seeds)", per_seed(START), per_seed(STAGE),
                 fmt((secs.get(STAGE) or {}).get("mean", math.nan) - (secs.get(START) or {}).get("mean", math.nan),
                     1), "", ""])
    return [*table(["Metric", START_LABEL, LABEL, f"Δ {LABEL} − {START_LABEL}", "p Wilcoxon (sessions)",
                    "p paired t (seeds)"], rows), "", f"**{worth['statement']}**"]
