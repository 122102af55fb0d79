"""prune.md: the before/after table per pruning setting, and how the job ran (from prune.json alone)."""

from __future__ import annotations

from typing import Any

from memprune.markdown import fmt, table, time_line
from memprune.prune.rule import setting_name


def render_markdown(summary: dict[str, Any]) -> str:
    """prune.md: bullets and tokens per group before/after pruning, per setting."""
    g = summary["grouping"]
    unit = summary["rule"]["group_by"]
    written = setting_name(summary["rule"]["threshold"], summary["rule"]["top_k"])
    ordered = sorted(summary["settings"].items(), key=lambda kv: (kv[1]["top_k"] is None, kv[1]["top_k"] or 0))
    rows = [
        [f"{name} (written)" if name == written else name, fmt(s["bullets_before"], 2), fmt(s["bullets_after"], 2),
         fmt(s["bullet_reduction_pct"], 1), fmt(s["tokens_before"], 1), fmt(s["tokens_after"], 1),
         fmt(s["token_reduction_pct"], 1), fmt(s["groups_emptied_pct"], 1)]
        for name, s in ordered
    ]
    t = summary["timing"]
    return "\n".join([
        "# Pruning report",
        "",
        f"Input `{summary['input']['path']}`: {summary['input']['rows']} bullets in {summary['groups']} {unit} groups; "
        f"scorer `{summary['scorer']['path']}` (stage {summary['scorer']['stage'] or 'n/a'}, "
        f"encoder {summary['scorer']['encoder']}).",
        f"Tokens: {summary['tokenizer']}. Grouping: {g['mode']} ({g['reason']}).",
        *score_line(summary.get("score")),
        "",
        *table(["setting", f"bullets/{unit} before", "after", "reduction %", f"tokens/{unit} before", "after",
                "reduction %", f"{unit}s emptied %"], rows),
        "",
        f"Rows in = rows out = {summary['output']['rows']}; store `{summary['output']['store']}`; "
        f"{t['wall_s']} s ({t['bullets_per_s']} bullets/s); {time_line(t)}.",
        "",
    ])


def score_line(score: dict[str, Any] | None) -> list[str]:
    """Which scores the rule saw: calibrated P(relevant) (with the method) or raw, and why."""
    if not score:
        return []
    cal = score.get("calibration")
    what = (f"calibrated P(label >= {cal['relevance_threshold']}) ({cal['method']})" if score["used"] == "calibrated"
            else "raw scorer outputs")
    return [f"Scores: {what}; requested `{score['requested']}`." + (f" Note: {score['note']}." if score.get("note") else "")]
