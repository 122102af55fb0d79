"""dialogue.md: the paper's Table 6 shape, one line per memory condition, then the paired differences."""

from __future__ import annotations

from typing import Any

from memprune.dialogue.scoring import METRICS
from memprune.memory.report import delta_cell, value_cell
from memprune.decision import rule_label

LABELS = {"none": "No memory", "all": "All memory", "retrieval": "Retrieval", "pruned": "Pruned memory"}
METRIC_NAMES = {"bleu": "BLEU", "rouge_l": "ROUGE-L", "bertscore_f1": "BERTScore F1", "mauve": "MAUVE"}
DIGITS = {"bleu": 2, "rouge_l": 4, "bertscore_f1": 4, "mauve": 4}


def condition_label(condition: str, summary: dict[str, Any]) -> str:
    """Row label of the Table 6 shape, with the retrieval k and the pruning rule."""
    if condition == "retrieval" and summary.get("retrieval"):
        k = summary["retrieval"]["k"]
        return f"Retrieval (top-{k}, LD-Agent-style)" if k != "pruned" else "Retrieval (k = pruned count)"
    if condition == "pruned" and (summary.get("pruned") or {}).get("rule"):
        rule = summary["pruned"]["rule"]
        return f"Pruned memory ({rule_label(rule)})"
    return LABELS[condition]


def render_markdown(summary: dict[str, Any]) -> str:
    """dialogue.md: one line per memory condition (metrics with intervals, cost), then paired differences."""
    t = summary["targets"]
    boot = summary["metric_settings"]["bootstrap"]
    level = int(round(100 * boot["confidence"]))
    lines = [
        "# Dialogue evaluation: replies with memory conditions",
        "",
        f"Generator `{summary['generator']}` on `{summary['data']}`: {t['sampled']} target turns (seed {t['seed']}, "
        f"{t['eligible']} eligible) from {t['sessions']} sessions of {t['conversations']} conversations; "
        f"{t['paired']} have a reply under every condition and are scored (paired). "
        f"Intervals: {level}% percentile bootstrap over targets ({boot['samples']} resamples, seed {boot['seed']}).",
        "",
        "| Memory | bullets / turn | prompt tokens / turn | memory tokens / turn | BLEU | ROUGE-L | BERTScore F1 | MAUVE | errors |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in summary["conditions"]:
        m = summary["metrics"].get(c, {})
        cost = summary["cost"][c]
        errors = summary["llm_outcome"][c]["errors"]
        mean = lambda k: "n/a" if cost[k]["mean"] is None else f"{cost[k]['mean']:.1f}"  # noqa: E731
        pct = cost.get("prompt_tokens_vs_all_pct")
        tokens = mean("prompt_tokens") + (f" ({pct:+.0f}% vs all)" if pct is not None and c != "all" else "")
        lines.append(f"| {condition_label(c, summary)} | {mean('bullets')} | {tokens} | {mean('memory_tokens')} | "
                     + " | ".join(value_cell(m.get(k), DIGITS[k]) for k in METRICS) + f" | {errors} |")
    if summary["comparisons"]:
        lines += ["", "Paired differences (A - B; bootstrap interval; P>0 = share of resamples where A is higher):", "",
                  "| A - B | " + " | ".join(METRIC_NAMES[k] for k in METRICS) + " |",
                  "|---|" + "---|" * len(METRICS)]
        for name, comp in summary["comparisons"].items():
            lines.append(f"| {name} | " + " | ".join(delta_cell(comp.get(k), DIGITS[k]) for k in METRICS) + " |")
    ms = summary["metric_settings"]
    lines += ["", "Metrics: " + "; ".join(f"{METRIC_NAMES[k]}: {ms[k]}" for k in METRICS if ms.get(k)) + ".",
              f"Prompt tokens: {summary['tokens']}. Errors: replies that stayed empty or unusable after retries "
              f"(`rejects.jsonl`); scored targets exclude them under every condition."]
    for note in summary["notes"]:
        lines.append(f"- {note}")
    tm = summary["timing"]
    lines += ["", f"Time: {tm['total_s']} s (generation {tm['generation_s']} s, scoring {tm['scoring_s']} s); "
              f"generation chunks {summary['chunks']['chunks']} ({summary['chunks']['reused']} reused).", ""]
    return "\n".join(lines)
