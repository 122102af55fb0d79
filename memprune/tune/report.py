"""tune.md, tune.png and train-tuned.yaml, rendered from the tune.json summary alone."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from memprune.markdown import fmt, table
from memprune.train.stages import trained_chain
from memprune.tune.config import METRIC

STATUS_MARK = {"completed": "completed", "stopped early": "stopped early (ASHA)", "error": "error",
               "interrupted": "interrupted"}


def _settings_cell(settings: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v if not isinstance(v, float) else f'{v:.3g}'}" for k, v in sorted(settings.items()))


def _trial_rows(records: list[dict[str, Any]]) -> list[list[Any]]:
    ranked = sorted(records, key=lambda r: (r["status"] != "completed", -(r["metric"] if r["metric"] is not None
                                                                           else -9.0)))
    return [[r["trial_id"], STATUS_MARK.get(r["status"], r["status"]) + (" (reused)" if r.get("reused") else ""),
             fmt(r["metric"]), fmt(r.get("val_mse")), fmt(r.get("epochs_run")), fmt(r["cost_s"], 1),
             _settings_cell(r["settings"])] for r in ranked]


def render_report(summary: dict[str, Any]) -> str:
    """The Markdown summary of a search (OUT/tune.md)."""
    s1, best2, gain = summary["stage1_chosen"], summary["best_stage2"], summary["stage2_gain_valid"]
    sched = summary["scheduler"]
    kept = summary["split"].get("tune_train_conversations")
    header = ["trial", "status", f"valid {METRIC}", "val MSE", "epochs", "cost s", "settings"]
    lines = [
        "# memprune tune", "",
        f"- data: `{summary['data']}`, labels: {', '.join(f'`{x}`' for x in summary['labels'])}",
        f"- selection metric: the validation split's session-level Spearman (mean over sessions with varying labels); "
        f"trial seed {summary['seed']}",
        f"- bullets train/valid/test: {summary['bullets_per_split']['train']}/{summary['bullets_per_split']['valid']}/"
        f"{summary['bullets_per_split']['test']}"
        + (f"; the trials train on {kept['kept']} of {kept['of']} train conversations (train_fraction "
           f"{summary['train_fraction']}), the validation split is whole" if kept else ""),
        f"- stage-2 scheduler: ASHA on each epoch's {METRIC} (grace {sched['grace_period']} epoch(s), reduction "
        f"factor {sched['reduction_factor']}); {summary['stopped_early']} trial(s) stopped early",
        f"- total wall time: {summary['wall_s']:.1f} s", "",
        "## Stage 1", "",
    ]
    if summary["stage1_trials"]:
        lines += table(header, _trial_rows(summary["stage1_trials"])) + [""]
    lines += [f"Chosen stage 1 (trained once for the stage-2 trials): valid {METRIC} {fmt(s1['metric'])}, "
              f"val MSE {fmt(s1['val_mse'])}, {fmt(s1['train_s'], 1)} s.", "", "## Stage 2", ""]
    if summary["stage2_trials"]:
        lines += table(header, _trial_rows(summary["stage2_trials"])) + [""]
        lines += ["Cost is the trial's wall time (a stopped trial: until it was stopped), including its own stage 1 "
                  "when its loss differs from the chosen stage 1's. The first trial of each search is the base "
                  "settings.", ""]
    if best2 is not None:
        verdict = "above" if gain is not None and gain > 0 else "not above"
        lines += [f"**Best stage 2** ({best2['trial_id']}): valid {METRIC} {fmt(best2['metric'])}, {verdict} "
                  f"the chosen stage 1 ({fmt(s1['metric'])}): difference {fmt(gain)} on the validation split, at "
                  f"{fmt(best2['cost_s'], 1)} s against {fmt(s1['train_s'], 1)} s. Whether stage 2 is worth it is "
                  "decided on the test split over seeds: `memprune train --config train-tuned.yaml` then "
                  "`memprune evaluate` (its 'Is stage 2 worth it' table).", ""]
    else:
        lines += ["No stage-2 trial completed with a metric: train-tuned.yaml keeps the base stage-2 settings.", ""]
    lines += ["![metric against cost](tune.png)", ""]
    return "\n".join(lines)


def render_train_yaml(summary: dict[str, Any], cfg: Any) -> str:
    """The chosen settings as a `memprune train` config (paths of this search; replace them freely)."""
    body = {"data": str(cfg.data), "labels": [str(p) for p in cfg.labels], "out": str(cfg.out / "train"),
            **summary["tuned_settings"]}
    best2 = summary["best_stage2"]
    head = [
        "# memprune train settings chosen by `memprune tune` on validation session Spearman",
        f"#   data {summary['data']}, labels {', '.join(summary['labels'])}, train_fraction {summary['train_fraction']}",
        f"#   chosen stage 1: valid {METRIC} {fmt(summary['stage1_chosen']['metric'])}; best stage 2: "
        + (f"{fmt(best2['metric'])} (trial {best2['trial_id']})" if best2 else "none completed"),
        "#   memprune train --config train-tuned.yaml --data DATA --labels LABELS --out OUT",
    ]
    return "\n".join(head) + "\n" + yaml.safe_dump(body, sort_keys=False)


def write_figure(summary: dict[str, Any], path: Path) -> None:
    """Validation session Spearman against cost (s) of every trial; the chosen stage 1 as a line."""
    from memprune.figures import new_figure, save_png

    fig = new_figure(6.5, 4.2)
    ax = fig.add_subplot(1, 1, 1)
    first, second = trained_chain()
    one, two = first.display.lower(), second.display.lower()
    styles = {(first.name, "completed"): ("o", "tab:blue", one), (second.name, "completed"): ("s", "tab:orange", two),
              (second.name, "stopped early"): ("x", "tab:red", f"{two}, stopped early (last epoch's value)")}
    for (stage, status), (marker, color, label) in styles.items():
        rows = [r for r in summary[f"{stage}_trials"] if r["status"] == status and r["metric"] is not None]
        if rows:
            ax.scatter([r["cost_s"] for r in rows], [r["metric"] for r in rows], marker=marker, color=color,
                       label=label)
    s1 = summary["stage1_chosen"]["metric"]
    if s1 is not None:
        ax.axhline(s1, color="tab:blue", linestyle="--", linewidth=1, label="chosen stage 1")
    ax.set_xlabel("trial cost (s)")
    ax.set_ylabel(f"valid {METRIC}")
    ax.set_title("memprune tune: metric against cost")
    ax.legend(fontsize=8)
    save_png(fig, path)
