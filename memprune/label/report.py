"""label.md: the counts of a label run (judge or source) that reconcile, as a short table (from label.json)."""

from __future__ import annotations

from typing import Any

from memprune.markdown import fmt


def render_markdown(s: dict[str, Any]) -> str:
    """A short human-readable report of `label.json`."""
    c, t, lab = s["counts"], s["throughput"], s["labels"]
    lines = [
        f"# Labels ({s['judge']})",
        "",
        ("> Similarity judge: a cosine-similarity **proxy** of the paper's LLM judge, not the judge itself."
         if s["proxy"] else "> LLM-as-a-judge labels."),
        "",
        "| what | value |",
        "|---|---|",
        f"| bullets | {c['bullets']} |",
        f"| labelled | {c['bullets_labelled']} |",
        f"| unlabelled: no next session | {c['unlabelled_no_next_session']} |",
        f"| unlabelled: no speaker | {c['unlabelled_no_speaker']} |",
        f"| unlabelled: no target turns | {c['unlabelled_no_target_turns']} |",
        f"| unlabelled: all pairs failed | {c['unlabelled_all_pairs_failed']} |",
        f"| pairs | {c['pairs']} |",
        f"| pairs errored | {c['pairs_error']} ({s['error_rate']:.2%}) |",
        f"| label mean / min / max | {fmt(lab['mean'])} / {fmt(lab['min'])} / {fmt(lab['max'])} |",
        f"| labels >= 0.5 | {lab['at_least_0.5']} |",
        f"| pairs/s (this run) | {fmt(t['pairs_per_s'])} |",
        f"| wall time (s) | {t['wall_s']} |",
        f"| counts reconcile | {s['reconciles']} |",
        "",
    ]
    return "\n".join(lines)


def render_source_markdown(s: dict[str, Any]) -> str:
    """A short human-readable report of a qa/usage `label.json`."""
    c, lab = s["counts"], s["labels"]
    lines = [
        f"# Labels (source: {s['source']}, rule `{s['rule']}`)",
        "",
        ("> QA-evidence labels: a bullet is positive when questions cite its evidence turns."
         if s["source"] == "qa" else "> Usage labels: from a log of the memory items replies drew on."),
        "",
        "| what | value |",
        "|---|---|",
        f"| bullets | {c['bullets']} |",
        f"| labelled | {c['bullets_labelled']} |",
        *[f"| unlabelled: {k.removeprefix('unlabelled_').replace('_', ' ')} | {v} |"
          for k, v in c.items() if k.startswith("unlabelled_")],
    ]
    if s["source"] == "qa":
        lines += [f"| QA items used / total | {c['qa_used']} / {c['qa']} |",
                  f"| QA items without evidence | {c['qa_without_evidence']} |",
                  f"| bullets cited | {c['bullets_cited']} |"]
    else:
        lines += [f"| events counted / total | {c['events_counted']} / {c['events']} |",
                  f"| events outside the time window | {c['events_outside_window']} |",
                  f"| events rejected (rejects.jsonl) | {c['events_rejected']} |",
                  f"| bullets used | {c['bullets_used']} |"]
    lines += [
        f"| label mean / min / max | {fmt(lab['mean'])} / {fmt(lab['min'])} / {fmt(lab['max'])} |",
        f"| labels >= 0.5 | {lab['at_least_0.5']} |",
        f"| wall time (s) | {s['throughput']['wall_s']} |",
        f"| counts reconcile | {s['reconciles']} |",
        "",
    ]
    return "\n".join(lines)
