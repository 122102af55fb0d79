"""prune.md: the before/after table per pruning setting, why bullets go, and how the job ran (from prune.json alone)."""

from __future__ import annotations

from typing import Any

from memprune.markdown import fmt, table, time_line

EMPTIED_WARNING_PCT = 20.0


def emptied_warning(summary: dict[str, Any]) -> str | None:
    """One line when more than 20% of the (non-empty) groups end up empty under the written setting, else None."""
    r = summary["result"]
    pct = r.get("groups_emptied_pct")
    if pct is None or pct <= EMPTIED_WARNING_PCT:
        return None
    unit = summary["rule"]["group_by"]
    return (f"{pct:.0f}% of the {unit}s ({r['groups_emptied']} of {summary['groups']}) end up empty under "
            f"{summary['rule']['name']}; consider --min-keep 1, a budget or a lower threshold")


def render_markdown(summary: dict[str, Any]) -> str:
    """prune.md: bullets and tokens per group before/after pruning, per setting, and the reasons for dropping."""
    g = summary["grouping"]
    unit = summary["rule"]["group_by"]
    written = summary["rule"]["name"]
    ordered = list(summary["settings"].items())  # the written setting first, then its policy's sweep
    rows = [
        [f"{name} (written)" if name == written else name, fmt(s["bullets_before"], 2), fmt(s["bullets_after"], 2),
         fmt(s["bullet_reduction_pct"], 1), fmt(s["tokens_before"], 1), fmt(s["tokens_after"], 1),
         fmt(s["token_reduction_pct"], 1), fmt(s["groups_emptied_pct"], 1)]
        for name, s in ordered
    ]
    result = summary["result"]
    why = [[r, str(n)] for r, n in result["dropped_by_reason"].items()]
    t = summary["timing"]
    warning = emptied_warning(summary)
    if summary.get("dry_run"):
        store_line = (f"Dry run: no store written; {summary['emitted']['preview']['rows']} bullets of sampled "
                      f"{unit}s in `preview.jsonl`.")
    else:
        out = summary["output"]
        store_line = f"Rows in = rows out = {out['rows']}; store `{out['store']}`"
        if summary["emitted"].get("kept"):
            e = summary["emitted"]
            store_line += (f"; kept store `{e['kept']['path']}` ({e['kept']['rows']} bullets), archive "
                           f"`{e['dropped']['path']}` ({e['dropped']['rows']} bullets; `memprune restore` puts them back)")
        store_line += "."
    return "\n".join([
        "# Pruning report",
        "",
        f"Input `{summary['input']['path']}`: {summary['input']['rows']} bullets in {summary['groups']} {unit} groups; "
        f"scorer `{summary['scorer']['path']}` (stage {summary['scorer']['stage'] or 'n/a'}, "
        f"encoder {summary['scorer']['encoder']}).",
        f"Decision: {summary['rule']['description']}. Run fingerprint `{summary['fingerprint']}`.",
        f"Tokens: {summary['tokenizer']}. Grouping: {g['mode']} ({g['reason']}).",
        *score_line(summary.get("score")),
        *lifecycle_lines(summary.get("lifecycle"), result),
        *(["", f"**Warning:** {warning}."] if warning else []),
        "",
        *table(["setting", f"bullets/{unit} before", "after", "reduction %", f"tokens/{unit} before", "after",
                "reduction %", f"{unit}s emptied %"], rows),
        "",
        f"Why bullets go ({written}; {result['kept_by_min_keep']} kept only by min-keep"
        + (f", {result['groups_over_budget']} {unit}s over budget because of min-keep" if result["groups_over_budget"] else "")
        + (f", {result['kept_by_pin']} kept only because pinned" if result.get("kept_by_pin") else "")
        + "):",
        "",
        *table(["reason", "bullets"], why),
        "",
        f"{store_line} {t['wall_s']} s ({t['bullets_per_s']} bullets/s); {time_line(t)}.",
        *parts_line(t),
        "",
    ])


PART_NAMES = {"checks_s": "checks", "ray_init_s": "Ray start", "plan_s": "plan", "actor_start_s": "actor start",
              "compute_s": "compute", "stall_s": "stalls", "drain_s": "drain", "finish_s": "finish",
              "other_s": "other"}


def parts_line(t: dict[str, Any]) -> list[str]:
    """Where the wall time went (prune.json `timing.parts`), in the job's order, and the compute lost to idle actors."""
    if not t.get("parts"):
        return []
    parts = ", ".join(f"{name} {t['parts'][k]:.1f} s" for k, name in PART_NAMES.items() if k in t["parts"])
    return ["", f"Time: {parts}; of the compute, {t.get('underused_s', 0):.1f} s with an actor idle beside a busy one."]


def score_line(score: dict[str, Any] | None) -> list[str]:
    """Which scores the rule saw: calibrated P(relevant) (with the method) or raw, and why."""
    if not score:
        return []
    cal = score.get("calibration")
    what = (f"calibrated P(label >= {cal['relevance_threshold']}) ({cal['method']})" if score["used"] == "calibrated"
            else "raw scorer outputs")
    return [f"Scores: {what}; requested `{score['requested']}`." + (f" Note: {score['note']}." if score.get("note") else "")]


def lifecycle_lines(life: dict[str, Any] | None, result: dict[str, Any]) -> list[str]:
    """Pins, forgetting and expiry in words: the settings, the `now` ages were measured at, and the counts."""
    if not life:
        return []
    lines = []
    if life.get("pin_field"):
        lines.append(f"Pins: column `{life['pin_field']}`; {life['pinned']} pinned bullets, all kept "
                     f"({result.get('kept_by_pin', 0)} of them a step would have dropped).")
    if life.get("keep_ids"):
        lines.append(f"Kept ids: `{life['keep_ids']['file']}`, {life['keep_ids']['ids']} bullets kept whatever the "
                     "decision said (pinned for this run; `--keep-ids`).")
    if life.get("supersede"):
        sup = life["supersede"]
        high = "the dedup threshold" if sup["high"] is None else f"{sup['high']:g}"
        lines.append(f"Supersession: judge `{sup['judge']}` within each {sup['scope']}, same `{sup['subject']}`, "
                     f"cosine in [{sup['low']:g}, {high}); {result['dropped_by_reason'].get('superseded', 0)} bullets "
                     "superseded by a later update (column `superseded_by`).")
        if "supersede_pairs" in life:
            lines.append(f"Update judge: {life['supersede_pairs']} candidate pairs judged, {life['supersede_updates']} "
                         f"updates, {life['supersede_no_verdict']} without a verdict (an LLM answer that never "
                         "parsed: not an update).")
    if life.get("now"):
        steps = []
        if life.get("half_life"):
            steps.append(f"forgetting with half-life {life['half_life']} and recall boost {life['recall_boost']:g} "
                         "(the policy ranks score x retention; `effective_score` and `retention` columns)")
        if life.get("max_age"):
            steps.append(f"expiry after {life['max_age']} ({result['dropped_by_reason'].get('expired', 0)} expired)")
        source = "the usage log's last access, else " if life.get("usage_log") else ""
        lines.append(f"Time: {'; '.join(steps)}; ages at {life['now']}"
                     f"{'' if life.get('now_given') else ' (the run start)'}, from {source}the bullet's `time`, else "
                     f"its session's time; {life['age_unknown']} bullets without a time are neither forgotten nor "
                     "expired." + (f" Usage log `{life['usage_log']}`: {life['usage_events']} events, "
                                   f"{life['recalled_bullets']} bullets recalled." if life.get("usage_log") else ""))
    return lines
