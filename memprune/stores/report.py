"""Markdown for the store runs: the store section of prune.md, and score.md."""

from __future__ import annotations

from typing import Any

from memprune.markdown import fmt


def store_section(summary: dict[str, Any]) -> str:
    """The store part of prune.md: which store, how many records, the decision, the fingerprint."""
    s, d = summary["store"], summary["decision"]
    lines = ["", "## Store", "",
             f"- store: `{s['kind']}:{s['location']}`, map {', '.join(f'{k}={v}' for k, v in s['map'].items())}",
             f"- records: {s['records']} (usable {s['usable']}, rejected {s['rejected']}: kept untouched, see rejects.jsonl)",
             f"- decision: kept {d['kept']}, dropped {d['dropped']} of {d['decided']} (decision.parquet)",
             f"- fingerprint: `{s['fingerprint']}` (`--apply` refuses a store that no longer matches it)",
             f"- read / scan / sort: {', '.join(f'{k} {fmt(v)}' for k, v in s['export_timing'].items())}", ""]
    g = d.get("groups")
    if g:
        lines += ["## Per group", "",
                  f"{g['groups']} groups; kept per group {g['kept_min']}-{g['kept_max']}; {g['emptied']} left empty. "
                  f"The {len(g['most_dropped'])} that lose the most:", "",
                  "| group | records | kept | dropped |", "|---|---:|---:|---:|"]
        lines += [f"| {r['group']} | {r['records']} | {r['kept']} | {r['records'] - r['kept']} |" for r in g["most_dropped"]]
        lines.append("")
    return "\n".join(lines)


def group_lines(summary: dict[str, Any], show: int = 5) -> list[str]:
    """What `memprune prune` prints of a store decision's groups, so a dry run is read before `--apply`."""
    g = summary.get("decision", {}).get("groups")
    if not g:
        return []
    worst = ", ".join(f"{r['group']} {r['records']}->{r['kept']}" for r in g["most_dropped"][:show])
    return [f"{g['groups']} groups: kept {g['kept_min']}-{g['kept_max']} each, {g['emptied']} left empty; "
            f"most dropped: {worst}"]


def render_score(summary: dict[str, Any]) -> str:
    """score.md from score.json."""
    s = summary["store"]
    sc = summary["scores"]
    return "\n".join([
        "# memprune score", "",
        f"- store: `{s['kind']}:{s['location']}` ({s['records']} records, {s['rejected']} rejected)",
        f"- scored: {summary['scored']}; calibrated column: {'yes' if summary['calibrated'] else 'no (scorer has none)'}",
        f"- written to the store: {summary['written_to_store']} ({', '.join(summary['columns'][1:])})",
        f"- scores: mean {fmt(sc['mean'])}, min {fmt(sc['min'])}, max {fmt(sc['max'])}",
        f"- total: {fmt(summary['timing']['total_s'])} s", ""])
