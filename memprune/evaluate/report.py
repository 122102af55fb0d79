"""The evaluation report: Markdown tables and matplotlib figures, built from metrics.json alone.

Because the report reads only the metrics dict, it can be regenerated from a saved
metrics.json (`write_report(json.load(...), out_dir)`). Figures use the Agg canvas
directly (no pyplot state), so this works headless and in worker processes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from memprune import stages as registry
from memprune.evaluate.baselines import HEURISTICS
from memprune.evaluate.calibration import calibration_table, figure_reliability
from memprune.evaluate.worth import KEY as WORTH_KEY, worth_table
from memprune.figures import new_figure, save_png
from memprune.io import write_text
from memprune.markdown import fmt, fmt_p, mean_std, stars, table
from memprune.evaluate.pruning import evaluation_rules
from memprune.decision import PruneRule

REGRESSION_LABELS = {"mse": "MSE ↓", "mae": "MAE ↓", "rmse": "RMSE ↓", "pearson": "Pearson ↑",
                     "spearman": "Spearman (global) ↑"}
CLASSIFICATION_LABELS = {"auc": "AUC (relevant = label >= threshold) ↑", "qa_auc": "AUC (QA-cited) ↑"}
FIGURES = ("ranking_vs_k.png", "reduction_vs_threshold.png", "score_histogram.png", "calibration.png",
           "reliability.png")


def stage_label(stage: str) -> str:
    """Display name of a stage directory name."""
    return registry.label(stage)


def _start_pairs() -> str:
    """The `†` legend: each stage against the one it starts from ("Stage 2 against Stage 1")."""
    return ", ".join(f"{stage_label(s)} against {stage_label(start)}" for s, start in registry.starts())


def test_p(entry: dict[str, Any] | None) -> Any:
    """The p-value behind a table marker: the Wilcoxon test over sessions, else the paired seed test."""
    if not entry:
        return None
    w = entry.get("wilcoxon")
    if w is not None:
        return w.get("p")
    return (entry.get("seed_ttest") or {}).get("p")


def _marker(split: dict[str, Any], family: str, metric: str, stage: str, baseline: str) -> str:
    sig = split.get("significance", {})
    out = ""
    vs_base = sig.get(f"{stage}_vs_{baseline}")
    if vs_base:
        out += stars(test_p(vs_base[family].get(metric)))
    start = dict(registry.starts()).get(stage)  # the stage it starts from (stage 2: stage 1)
    if start is not None and f"{stage}_vs_{start}" in sig:
        p = test_p(sig[f"{stage}_vs_{start}"][family].get(metric))
        if p is not None and p < 0.05:
            out += "†"
    return out


def quality_tables(split: dict[str, Any], baseline: str, ks: Sequence[int]) -> list[str]:
    """Regression and session-ranking tables (mean ± std over seeds, with significance markers)."""
    stages = split["stages"]
    agg = split["aggregate"]
    header = ["Metric", *[f"{stage_label(s)} (n={agg[s]['n_seeds']})" for s in stages]]
    lines = ["**Global regression** (all bullets)", ""]
    rows = []
    for m, label in REGRESSION_LABELS.items():
        rows.append([label, *[mean_std(agg[s]["regression"][m]) + _marker(split, "regression", m, s, baseline)
                              for s in stages]])
    for m, label in CLASSIFICATION_LABELS.items():
        if all(m in agg[s].get("classification", {}) for s in stages):
            rows.append([label, *[mean_std(agg[s]["classification"][m]) for s in stages]])
    lines += table(header, rows)
    lines += ["", "**Session-level ranking** (per session, then averaged; higher is better)", ""]
    rows = []
    first = agg[stages[0]]["ranking"]
    for m in first:
        rows.append([_metric_label(m), str(first[m].get("n_sessions", "—")),
                     *[mean_std(agg[s]["ranking"][m]) + _marker(split, "ranking", m, s, baseline) for s in stages]])
    lines += table(["Metric", "sessions", *header[1:]], rows)
    return lines


def _metric_label(m: str) -> str:
    family, _, k = m.partition("@")
    names = {"spearman": "Spearman (session)", "ndcg": "NDCG", "hit": "Hit", "precision": "Precision", "recall": "Recall"}
    return names.get(family, family) + (f"@{k}" if k else "")


def significance_table(split: dict[str, Any]) -> list[str]:
    """One row per metric: difference of means and both p-values for every comparison."""
    sig = split.get("significance", {})
    if not sig:
        return ["No comparison: the run has no baseline stage to compare against."]
    names = list(sig)
    header = ["Metric"]
    for n in names:
        a, b = stage_label(sig[n]["stage"]), stage_label(sig[n]["reference"])
        header += [f"Δ {a} − {b}", "p Wilcoxon (sessions)", "p paired t (seeds)"]
    rows = []
    for family in ("regression", "ranking"):
        for m in sig[names[0]][family]:
            label = (REGRESSION_LABELS[m] if family == "regression" else _metric_label(m))
            row = [label]
            for n in names:
                e = sig[n][family][m]
                w, t = e.get("wilcoxon"), e.get("seed_ttest") or {}
                row += [
                    fmt(e.get("diff")),
                    "n/a" if w is None else f"{fmt_p(w.get('p'))} (n={w.get('n_sessions')})",
                    f"{fmt_p(t.get('p'))} (n={t.get('n_seeds')})",
                ]
            rows.append(row)
    return table(header, rows)


def per_seed_table(split: dict[str, Any], ks: Sequence[int]) -> list[str]:
    """Every seed's main numbers (the paper's per-seed appendix table)."""
    k = max(ks)
    cols = ["mse", "mae", "rmse", "pearson", "spearman"]
    rcols = ["spearman", f"ndcg@{k}", f"hit@{k}", f"precision@{k}", f"recall@{k}"]
    header = ["Stage", "Seed", "bullets", *[REGRESSION_LABELS[c] for c in cols],
              *[_metric_label(c) for c in rcols]]
    rows = []
    for s in split["stages"]:
        for seed, r in split["per_seed"][s].items():
            rows.append([stage_label(s), seed, str(r["n_bullets"]), *[fmt(r["regression"][c]) for c in cols],
                         *[fmt(r["ranking"][c]["mean"]) for c in rcols]])
    return table(header, rows)


def sessions_used_table(split: dict[str, Any]) -> list[str]:
    """How many sessions each ranking metric used and why the others were left out."""
    first = split["aggregate"][split["stages"][0]]["ranking"]
    rows = []
    for m, e in first.items():
        excl = ", ".join(f"{k.replace('_', ' ')}: {v}" for k, v in (e.get("excluded_by") or {}).items()) or "none"
        rows.append([_metric_label(m), str(e.get("n_sessions")), excl])
    return table(["Metric", "sessions used", "left out (reason: count)"], rows)


def pruning_table(split: dict[str, Any], names: Sequence[str]) -> list[str]:
    """Bullets/tokens per session before and after pruning and what is lost, per stage and setting."""
    has_tokens = any("tokens_before" in split["aggregate"][s]["pruning"][names[0]] for s in split["stages"])
    header = ["Stage", "setting", "bullets/session before", "after", "reduction %"]
    if has_tokens:
        header += ["tokens/session before", "after", "token reduction %"]
    header += ["relevant kept %", "label mass kept %", "sessions emptied %"]
    rows = []
    for s in split["stages"]:
        for n in names:
            e = split["aggregate"][s]["pruning"][n]
            row = [stage_label(s), e["setting"]["label"], fmt(e["bullets_before"]["mean"], 2), mean_std(e["bullets_after"], 2),
                   mean_std(e["bullet_reduction_pct"], 1)]
            if has_tokens:
                row += [fmt(e["tokens_before"]["mean"], 1), mean_std(e["tokens_after"], 1),
                        mean_std(e["token_reduction_pct"], 1)]
            row += [mean_std(e["relevant_kept_pct"], 1), mean_std(e["label_mass_kept_pct"], 1),
                    mean_std(e["sessions_emptied_pct"], 1)]
            rows.append(row)
    return table(header, rows)


def qa_table(split: dict[str, Any], names: Sequence[str]) -> list[str]:
    """Share of QA-evidence bullets kept: the model against random same-size and most-recent pruning and the same
    number kept by each heuristic (`memprune.evaluate.baselines`), with the lift over the best of them."""
    heuristics = [h for h in HEURISTICS if any(f"{h.replace(' ', '_')}_pct" in split["aggregate"][s]["pruning"][n]["qa"]
                                               for s in split["stages"] for n in names)]
    header = ["Stage", "setting", "bullets kept %", "cited kept % (model)",
              "random same size % (mean ± std over draws)", "random 95% interval", "most recent %",
              *(f"{h} %" for h in heuristics), "lift over random (×)",
              *(["lift over the best baseline (points)"] if heuristics else [])]
    rows = []
    for s in split["stages"]:
        for n in names:
            e = split["aggregate"][s]["pruning"][n]
            q = e["qa"]
            kept = 100.0 - e["bullet_reduction_pct"]["mean"] if e["bullet_reduction_pct"]["mean"] is not None else None
            rows.append([
                stage_label(s), e["setting"]["label"], fmt(kept, 1), mean_std(q["model_pct"], 1),
                f"{fmt(q['random_mean_pct']['mean'], 1)} ± {fmt(q['random_std_pct']['mean'], 1)}",
                f"[{fmt(q['random_p2_5_pct']['mean'], 1)}, {fmt(q['random_p97_5_pct']['mean'], 1)}]",
                mean_std(q["recency_pct"], 1),
                *(mean_std(q.get(f"{h.replace(' ', '_')}_pct"), 1) for h in heuristics),
                mean_std(q.get("lift"), 2),
                *([mean_std(q.get("lift_over_best_heuristic_pp"), 1)] if heuristics else []),
            ])
    return table(header, rows)


# ---------------------------------------------------------------- figures


def figure_ranking_vs_k(split: dict[str, Any], ks: Sequence[int], path: Path) -> None:
    """NDCG, Hit, Precision and Recall against k per stage, error bars = std over seeds (paper Fig. 4)."""
    fig = new_figure(12, 3.2)
    for i, family in enumerate(("ndcg", "hit", "precision", "recall")):
        ax = fig.add_subplot(1, 4, i + 1)
        for s in split["stages"]:
            r = split["aggregate"][s]["ranking"]
            means = [_nan(r[f"{family}@{k}"]["mean"]) for k in ks]
            stds = [_nan(r[f"{family}@{k}"]["std"], 0.0) for k in ks]
            ax.errorbar(list(ks), means, yerr=stds, marker="o", capsize=3, label=stage_label(s))
        ax.set_title(f"{_metric_label(family)}@k")
        ax.set_xlabel("k")
        ax.set_xticks(list(ks))
        ax.grid(alpha=0.3)
        if i == 0:
            ax.legend(fontsize=8)
    save_png(fig, path)


def figure_reduction(split: dict[str, Any], sweeps: dict[str, list[str]], path: Path) -> None:
    """Bullet reduction and relevant bullets kept against the threshold, per stage, for each threshold sweep."""
    fig = new_figure(10, 3.6)
    axes = [fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)]
    colors = {}
    for s in split["stages"]:
        pr = split["aggregate"][s]["pruning"]
        for i, names in enumerate(sweeps.values()):
            xs = [pr[n]["setting"]["threshold"] for n in names]
            cap = pr[names[0]]["setting"].get("top_k")
            for ax, key in zip(axes, ("bullet_reduction_pct", "relevant_kept_pct")):
                ys = [_nan(pr[n][key]["mean"]) for n in names]
                line = ax.plot(xs, ys, "-" if i == 0 else "--", marker=".", color=colors.get(s),
                               label=f"{stage_label(s)}, {f'top-{cap}' if cap is not None else 'no top-k'}")[0]
                colors[s] = line.get_color()
    axes[0].set_ylabel("bullet reduction %")
    axes[1].set_ylabel("relevant bullets kept %")
    for ax in axes:
        ax.set_xlabel("threshold")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    save_png(fig, path)


def figure_histograms(split: dict[str, Any], path: Path) -> None:
    """Predicted-score histogram per stage (pooled over seeds), beside the label histogram."""
    stages = split["stages"]
    fig = new_figure(3.2 * (len(stages) + 1), 3.0)
    panels = [(stage_label(s), split["aggregate"][s]["score_histogram"]) for s in stages]
    panels.append(("labels", split["label_histogram"]))
    for i, (title, h) in enumerate(panels):
        ax = fig.add_subplot(1, len(panels), i + 1)
        edges, counts = h["edges"], h["counts"]
        ax.bar(edges[:-1], counts, width=[b - a for a, b in zip(edges[:-1], edges[1:])], align="edge",
               color="tab:gray" if title == "labels" else None, edgecolor="white")
        ax.set_title(title if title == "labels" else f"{title} scores")
        ax.set_xlim(0, 1)
        ax.set_xlabel("value")
    save_png(fig, path)


def figure_calibration(split: dict[str, Any], path: Path) -> None:
    """Mean label per predicted-score bin, per stage, against the diagonal of perfect calibration."""
    fig = new_figure(4.5, 4.2)
    ax = fig.add_subplot(1, 1, 1)
    ax.plot([0, 1], [0, 1], ":", color="gray", label="perfect")
    for s in split["stages"]:
        bins = split["aggregate"][s]["calibration"]
        ax.plot([b["mean_score"] for b in bins], [b["mean_label"] for b in bins], marker="o", label=stage_label(s))
    ax.set_xlabel("mean predicted score (bin)")
    ax.set_ylabel("mean label")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    save_png(fig, path)


def _nan(v: Any, default: float = math.nan) -> float:
    return default if v is None else float(v)


# ---------------------------------------------------------------- the document


def write_report(metrics: dict[str, Any], out_dir: str | Path, figures: bool = True) -> Path:
    """Write OUT/report.md (and the PNG figures of the test split); return the report path."""
    out = Path(out_dir)
    cfg = metrics["config"]
    ks, baseline = cfg["ks"], cfg["baseline"]
    rule = PruneRule.of(**cfg["rule"])
    lists = {name: [r.name for r in rules] for name, rules in
             evaluation_rules(rule, tuple(ks), tuple(cfg["thresholds"])).items()}
    table_names, sweep_names = lists["table"], lists["sweep"]
    sweeps = {name: names for name, names in lists.items() if name.startswith("sweep") and names}

    lines = ["# memprune evaluation report", ""]
    lines += [f"- Run: `{metrics['run_dir']}`", f"- Corpus: `{metrics['data_dir']}`" if metrics["data_dir"] else
              "- Corpus: not given (no token counts, no QA section)"]
    if metrics.get("tokenizer"):
        lines.append(f"- Token unit: {metrics['tokenizer']}")
    p = metrics["predictions"]
    rejected = sum(p["rejected"].values())
    lines.append(f"- Prediction rows: {sum(p['seen'].values())} read, {rejected} rejected"
                 + (" (see rejects.jsonl)" if rejected else ""))
    lines.append(f"- Relevant: label >= {cfg['relevance_threshold']}; pruning: {rule.describe()}")
    if metrics.get("folds"):
        f = metrics["folds"]
        lines.append(f"- k-fold run: {f['k']} folds; the test split below pools the out-of-fold predictions of "
                     f"{f['n_conversations']} held-out conversations ({f['manifests_checked']} fold manifests "
                     "checked: no test conversation in its fold's training data)")
    lines += [f"- Note: {note}" for note in metrics.get("notes", [])]
    lines.append("")

    for split_name, split in metrics["splits"].items():
        main = split_name == "test"
        seeds = ", ".join(f"{stage_label(s)}: {len(v)}" for s, v in split["seeds"].items())
        lines += [f"## {'Test' if main else 'Validation'} split", "",
                  f"{split['n_bullets']} bullets in {split['n_sessions']} sessions; "
                  f"{100 * (split['relevant_share'] or 0):.1f}% relevant. Seeds per stage: {seeds}.", ""]
        for note in split.get("notes", []):
            lines += [f"> Note: {note}", ""]
        lines += [f"### Scorer quality (mean ± std over seeds){' — the paper’s Tables 2 and 3' if main else ''}", ""]
        lines += quality_tables(split, baseline, ks)
        lines += ["", f"Markers: `*` p < 0.05, `**` p < 0.01, `***` p < 0.001 against {stage_label(baseline)}; "
                  f"`†` {_start_pairs()} at p < 0.05. The marker uses the two-sided Wilcoxon signed-rank "
                  "test over sessions (per-session value averaged over seeds) where the metric exists per "
                  "session, else the paired t-test over seeds (global Pearson, Spearman). Uncorrected for "
                  "multiple comparisons.", ""]
        if not main:
            continue
        lines += ["### Significance", ""] + significance_table(split) + [""]
        if metrics.get(WORTH_KEY):
            stage, start = (stage_label(s) for s in registry.verdict_pair())
            lines += [f"### Is {stage.lower()} worth it? {stage} against {start}", ""] + worth_table(metrics[WORTH_KEY])
            lines += [""]
        lines += ["### Sessions used per ranking metric", ""] + sessions_used_table(split) + [""]
        lines += ["### Per seed", ""] + per_seed_table(split, ks) + [""]
        if split.get("relevance_calibration"):
            lines += ["### Probability calibration (raw vs calibrated)", ""]
            lines += calibration_table(split["relevance_calibration"], stage_label) + [""]
        lines += [f"### Pruning: {rule.label}{' — the paper’s Table 4' if len(table_names) > 1 else ''}", ""]
        lines += pruning_table(split, table_names) + [""]
        if sweep_names:
            lines += ["### Sensitivity", ""] + pruning_table(split, sweep_names) + [""]
        if "qa" in split:
            q = split["qa"]
            lines += ["### QA-evidence retention (external check)", "",
                      f"{q['n_qa']} QA items ({q['n_qa_without_evidence']} without evidence); "
                      f"{q['n_cited_bullets']} of {split['n_bullets']} bullets "
                      f"({100 * (q['cited_share'] or 0):.1f}%) are cited: one of their evidence turns is evidence "
                      f"of a QA item. Random pruning keeps the same number of bullets per session "
                      f"({q['draws']} draws); 'most recent' keeps that many bullets with the latest evidence "
                      f"turn ({q['recency_source']}). Model and most-recent columns: mean ± std over seeds; random columns: "
                      f"the per-seed mean, std and 95% interval over draws, averaged over seeds.", ""]
            lines += qa_table(split, table_names) + [""]
            if sweep_names:
                lines += qa_table(split, sweep_names) + [""]
        if figures:
            figure_ranking_vs_k(split, ks, out / "ranking_vs_k.png")
            if sweeps:
                figure_reduction(split, sweeps, out / "reduction_vs_threshold.png")
            figure_histograms(split, out / "score_histogram.png")
            figure_calibration(split, out / "calibration.png")
            if split.get("relevance_calibration"):
                figure_reliability(split["relevance_calibration"], stage_label, out / "reliability.png")
                lines += ["Reliability of P(relevant), raw scores vs calibrated (pooled over seeds):", "",
                          "![reliability](reliability.png)", ""]
            lines += ["### Figures", "",
                      "Ranking metrics against k (the paper’s Figure 4):", "", "![ranking vs k](ranking_vs_k.png)", "",
                      "Reduction and relevant bullets kept against the threshold:", "",
                      "![reduction vs threshold](reduction_vs_threshold.png)", "",
                      "Score histograms per stage (pooled over seeds) and the labels:", "",
                      "![score histogram](score_histogram.png)", "",
                      "Calibration (mean label per predicted-score bin):", "", "![calibration](calibration.png)", ""]
    path = out / "report.md"
    write_text(path, "\n".join(lines) + "\n")
    return path
