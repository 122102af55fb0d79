"""qa.md and qa.png, rendered from qa.json alone: accuracy and tokens per memory condition, per category."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from memprune.figures import new_figure, save_png
from memprune.markdown import fmt, table
from memprune.memory.report import delta_cell, value_cell
from memprune.decision import rule_label
from memprune.qa.scoring import ANSWERABLE, OVERALL

METRIC_NAMES = {"f1": "F1", "bleu1": "BLEU-1", "judge": "J (judge)"}
LABELS = {"none": "No memory", "all": "All memory", "pruned": "Pruned memory", "retrieval": "Retrieval",
          "dialogue": "Dialogue"}


def condition_label(condition: str, summary: dict[str, Any]) -> str:
    """Row label: the pruning rule, the retrieval size and the dialogue budget where they apply."""
    memory = summary["memory"]
    if condition == "pruned" and (summary.get("pruned") or {}).get("rule"):
        rule = summary["pruned"]["rule"]
        return f"Pruned memory ({rule_label(rule)})"
    if condition == "retrieval" and memory.get("retrieval"):
        k = memory["retrieval"]["k"]
        return {"pruned": "Retrieval (k = pruned count)", "pruned_tokens": "Retrieval (pruned token budget)"}.get(
            k, f"Retrieval (top-{k})")
    if condition == "dialogue":
        budget = memory.get("dialogue_tokens")
        return "Dialogue (every turn)" if budget is None else f"Dialogue (last {budget} tokens)"
    return LABELS[condition]


def _metrics(summary: dict[str, Any]) -> list[str]:
    return ["f1", "bleu1"] + (["judge"] if summary.get("judge") else [])


def group_table(summary: dict[str, Any], group: str) -> list[str]:
    """One line per condition: accuracy with intervals and memory/prompt tokens (mean, p95) of a question group."""
    metrics = _metrics(summary)
    header = ["Memory", "n", *(METRIC_NAMES[m] for m in metrics), "memory tokens (mean / p95)",
              "prompt tokens (mean / p95)", "errors"]
    rows = []
    for c in summary["conditions"]:
        e = summary["metrics"][group][c]
        mem, prompt = e["memory_tokens"], e["prompt_tokens"]
        errors = str(e["errors"]) + (f" + {e['judge_errors']} verdicts" if e.get("judge_errors") else "")
        rows.append([condition_label(c, summary), e["n"], *(value_cell(e.get(m), 3) for m in metrics),
                     f"{fmt(mem['mean'], 1)} / {fmt(mem['p95'], 0)}", f"{fmt(prompt['mean'], 1)} / {fmt(prompt['p95'], 0)}",
                     errors])
    return table(header, rows)


def comparison_table(summary: dict[str, Any], group: str) -> list[str]:
    """The paired differences of a group (A - B with bootstrap interval and P>0)."""
    metrics = _metrics(summary)
    comps = summary["comparisons"].get(group) or {}
    return table(["A - B", *(METRIC_NAMES[m] for m in metrics)],
                 [[name, *(delta_cell(comp.get(m), 3) for m in metrics)] for name, comp in comps.items()])


def render_markdown(summary: dict[str, Any]) -> str:
    """qa.md: headline tables (all questions, answerable ones), one table per category, differences, notes."""
    q, boot = summary["questions"], summary["metric_settings"]["bootstrap"]
    level = int(round(100 * boot["confidence"]))
    judge = f"judge `{summary['judge']}`" if summary["judge"] else "no judge (F1 and BLEU-1 only; add --judge-llm)"
    memory = summary["memory"]
    scope = ("every session of the conversation (asked after the last session)" if memory["scope"] == "last_session"
             else "the sessions up to the question's latest evidence session")
    lines = [
        "# QA evaluation: answer accuracy against memory tokens",
        "",
        f"Generator `{summary['generator']}` on `{summary['data']}`: {q['evaluated']} questions ({q['answerable']} "
        f"answerable, {q['unanswerable']} unanswerable) from {q['conversations']} conversations, each answered "
        f"under every memory condition with the same prompt; {judge}. Memory in scope: {scope}. Intervals: "
        f"{level}% percentile bootstrap over questions ({boot['samples']} resamples, seed {boot['seed']}), paired "
        f"across conditions.",
        "",
    ]
    sections = [(OVERALL, "All questions"),
                (ANSWERABLE, "Answerable questions (published LoCoMo numbers usually leave the adversarial ones out)")]
    for group, title in sections:
        if summary["groups"].get(group):
            lines += [f"## {title}", "", *group_table(summary, group), ""]
    lines += ["## Per category", ""]
    for group, n in summary["groups"].items():
        if group in (OVERALL, ANSWERABLE) or not n:
            continue
        lines += [f"### {group} ({n} questions)", "", *group_table(summary, group), ""]
    for group in (ANSWERABLE, OVERALL):
        if summary["comparisons"].get(group):
            lines += [f"## Paired differences ({group} questions; P>0 = share of resamples where A is higher)", "",
                      *comparison_table(summary, group), ""]
    ms = summary["metric_settings"]
    acct = summary["accounting"]
    lines += [
        "## How to read this",
        "",
        "- " + "; ".join(f"{METRIC_NAMES[m]}: {ms[m]}" for m in _metrics(summary)) + ".",
        f"- Unanswerable questions: {ms['unanswerable']}. Failures: {ms['failures']}.",
        f"- Tokens: {summary['token_unit']}. Memory tokens: {memory['memory_tokens']}; prompt tokens: the whole "
        f"answer prompt.",
        "- Accounted answers per condition (seen = answered + errors): "
        + ", ".join(f"{c} {a['seen']} = {a['answered']} + {a['errors']}" for c, a in acct.items()) + ".",
        "- Next to published numbers (Mem0, Zep, MemOS, Letta, LightMem, Cognee): comparable only with the same "
        "answering model, the same judge model and prompt, and tokens counted the same way; otherwise compare the "
        "conditions within this report.",
    ]
    lines += [f"- {note}" for note in summary["notes"]]
    tm, ch = summary["timing"], summary["chunks"]
    chunks = f"answer chunks {ch['answers']['chunks']} ({ch['answers']['reused']} reused)"
    if ch.get("verdicts"):
        chunks += f", verdict chunks {ch['verdicts']['chunks']} ({ch['verdicts']['reused']} reused)"
    lines += ["", f"Time: {tm['total_s']} s (generation {tm['generation_s']} s, scoring {tm['scoring_s']} s); "
              f"{chunks}. Figure: `qa.png` (accuracy against mean memory tokens per condition).", ""]
    return "\n".join(lines)


def write_figure(summary: dict[str, Any], path: Path) -> None:
    """qa.png: accuracy (F1, and J with a judge) against mean memory tokens per condition, 95% intervals."""
    group = ANSWERABLE if summary["groups"].get(ANSWERABLE) else OVERALL
    metrics = ["f1"] + (["judge"] if summary.get("judge") else [])
    fig = new_figure(5.0 * len(metrics), 4.0)
    for i, m in enumerate(metrics):
        ax = fig.add_subplot(1, len(metrics), i + 1)
        for c in summary["conditions"]:
            e = summary["metrics"][group][c]
            x, y = e["memory_tokens"]["mean"] or 0.0, (e.get(m) or {}).get("value")
            if y is None:
                continue
            ci = (e.get(m) or {}).get("ci")
            err = [[y - ci[0]], [ci[1] - y]] if ci else None
            ax.errorbar([x], [y], yerr=err, fmt="o", capsize=3, label=condition_label(c, summary))
        ax.set_xscale("symlog", linthresh=10)
        ax.set_xlabel("memory tokens per question (mean)")
        ax.set_ylabel(f"{METRIC_NAMES[m]} ({group} questions)")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
        if i == 0:
            ax.legend(fontsize=7, loc="best")
    save_png(fig, path)
