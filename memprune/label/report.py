"""label.md: the counts of a label run (judge or source) that reconcile, as a short table (from label.json)."""

from __future__ import annotations

from typing import Any

from memprune.label.judges import JUDGES
from memprune.label.sources.common import SOURCES
from memprune.markdown import fmt, table, time_line


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
        f"| time | {time_line(s['timing'])}; compute = {s['timing']['compute']} |",
        f"| counts reconcile | {s['reconciles']} |",
        "",
    ]
    return "\n".join(lines + _judge_sections(s))


def _judge_sections(s: dict[str, Any]) -> list[str]:
    """Cost, listwise, likelihood and agreement sections of a model-judge run (when present)."""
    lines: list[str] = []
    if "cost" in s:
        m, p = s["cost"]["measured"], s["cost"]["planned"]
        lines += ["## Cost", "", f"Tokenizer of the plan: {', '.join(s['cost']['tokenizer'])}.", ""]
        lines += table(["", "LLM calls", "prompt tokens", "generated tokens", "prompt tokens / labelled pair",
                        "prefix-cache reusable"],
                       [["measured (engine)", m["llm_calls"], m["prompt_tokens"], m["generated_tokens"],
                         fmt(m["prompt_tokens_per_labelled_pair"], 1), "—"],
                        ["planned (tokenizer)", p["calls"], p["prompt_tokens"], p["generated_tokens"],
                         fmt(p["prompt_tokens_per_pair"], 1), fmt(p["prefix_cache_reusable_share"], 3)]])
        lines.append("")
    for kind, judge in JUDGES.items():  # each judge kind's own section (label.json[kind])
        if judge.render is not None and kind in s:
            lines += judge.render(s[kind])
    if "agreement" in s:
        a = s["agreement"]
        lines += ["## Judge agreement", ""]
        lines += table(["level", "mean Spearman", "Krippendorff's alpha (interval)", "units with every judge"],
                       [[lvl, fmt(a[lvl]["mean_spearman"]), fmt(a[lvl]["krippendorff_alpha_interval"]),
                         a[lvl]["units_all_judges"]] for lvl in ("pairs", "labels")])
        lines.append("")
    return lines


def plan_rows(s: dict[str, Any]) -> list[list[str]]:
    """One table row per judge mode of a `plan.json`."""
    rows = []
    for mode, m in s["modes"].items():
        share = fmt(m["prefix_cache_reusable_share"], 3) if m["prefix_cache_used"] else "0 (not used)"
        row = [mode + (" (chosen)" if mode == s["chosen"] else ""), f"{m['calls']:,}", f"{m['prompt_tokens']:,}",
               f"{m['generated_tokens']:,}", fmt(m["prompt_tokens_per_pair"], 1), share,
               f"{m['effective_tokens']:,}", fmt(m["gpu_hours"], 2)]
        rows.append(row + [fmt(m.get("hours_at_measured"), 3)] if "measured" in s else row)
    return rows


def render_plan(s: dict[str, Any]) -> str:
    """plan.md: what each judge mode would cost on this corpus (from plan.json)."""
    tp, dtp = s["throughput_tokens_per_s"], s.get("decode_throughput_tokens_per_s")
    at = f"{fmt(tp, 0)} / {fmt(dtp, 0)} tok/s" if tp else "— (give --throughput)"
    lines = [
        f"# Labeling plan: {s['pairs']:,} pairs, {s['target_turns']:,} target turns, {s['bullets']:,} bullets",
        "",
        f"Tokenizer: {s['tokenizer']}. Prefix cache: whole {s['block_size']}-token blocks shared with the previous "
        "prompt. Effective tokens = prompt tokens not served from the cache + generated tokens. GPU-hours = "
        "(uncached prompt tokens / prefill throughput + generated tokens / decode throughput) / 3600.",
        "",
        *table(["mode", "LLM calls", "prompt tokens", "generated tokens", "prompt tokens / pair",
                "prefix-cache reusable", "effective tokens", f"GPU-hours @ {at}"]
               + (["hours @ measured"] if "measured" in s else []), plan_rows(s)),
        "",
        f"Listwise needs {fmt(s['listwise_saving'], 1)}x fewer prompt tokens per pair than pairwise.",
        "",
    ]
    m = s.get("measured")
    if m:
        how = ("the measured pairs over the measured seconds, engine start-up included (the passes did not separate "
               "start-up from rate)" if m["rate_includes_startup"] else
               f"a line through its {len(m['passes'])} passes: {fmt(m['startup_s_per_pass'], 1)} s of start-up per "
               f"pass + {fmt(m['items_per_s'], 2)} judged rows/s")
        lines += [
            f"## Measured on this hardware: the {m['judge']} judge on {m['pairs']:,} pairs",
            "",
            f"{fmt(m['pairs_per_s'], 2)} pairs/s from {how}; {fmt(m['prompt_tokens_per_s'], 0)} prompt and "
            f"{fmt(m['generated_tokens_per_s'], 0)} generated tokens/s; error rate {fmt(m['error_rate'], 3)}; "
            f"{m['wall_s']} s in all.",
            "",
            f"**The whole run ({s['pairs']:,} pairs, {m['planned_passes']} passes): "
            f"{fmt(m['planned_hours'], 3)} hours** on this hardware, planned from the measured throughput, not an "
            "assumed one. The other modes' `hours @ measured` are their effective tokens at the chosen judge's "
            "measured effective tokens/s.",
            "",
        ]
    return "\n".join(lines)


def render_source_markdown(s: dict[str, Any]) -> str:
    """A short human-readable report of the `label.json` of a source that is not the judges (its entry's `intro`
    and `rows`)."""
    c, lab = s["counts"], s["labels"]
    lines = [
        f"# Labels (source: {s['source']}, rule `{s['rule']}`)",
        "",
        f"> {SOURCES[s['source']].intro or SOURCES[s['source']].description}",
        "",
        "| what | value |",
        "|---|---|",
        f"| bullets | {c['bullets']} |",
        f"| labelled | {c['bullets_labelled']} |",
        *[f"| unlabelled: {k.removeprefix('unlabelled_').replace('_', ' ')} | {v} |"
          for k, v in c.items() if k.startswith("unlabelled_")],
        *[f"| {what} | {value} |" for what, value in SOURCES[s["source"]].rows(c)],
    ]
    lines += [
        f"| label mean / min / max | {fmt(lab['mean'])} / {fmt(lab['min'])} / {fmt(lab['max'])} |",
        f"| labels >= 0.5 | {lab['at_least_0.5']} |",
        f"| wall time (s) | {s['throughput']['wall_s']} |",
        f"| counts reconcile | {s['reconciles']} |",
        "",
    ]
    return "\n".join(lines)
