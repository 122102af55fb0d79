"""train.md: what was trained on which data, validation numbers per stage and seed, wall times (from run.json)."""

from __future__ import annotations

from typing import Any

from memprune.markdown import fmt, table, time_line


def _mean_std(entry: dict[str, Any] | None) -> str:
    return fmt(None) if entry is None else f"{fmt(entry['mean'])} ± {fmt(entry['std'])}"


def render_report(summary: dict[str, Any]) -> str:
    """The Markdown summary of a training run on one split (OUT/train.md)."""
    split = summary["split"]
    mixed = len(summary["labels"]) > 1 or summary.get("label_weights")
    lines = [
        "# memprune train",
        "",
        f"- data: `{summary['data']}`, labels: {', '.join(f'`{x}`' for x in summary['labels'])}"
        + (f" (source weights {summary['label_weights']}; labels by source {split.get('labels_by_source')}, "
           f"{split.get('labels_superseded', 0)} superseded)" if mixed else ""),
        f"- encoder: `{summary['encoder']}`; stages {', '.join(summary['stages'])}; seeds {summary['seeds']}",
        f"- bullets: {split['bullets']} ({split['labeled_bullets']} labelled, {split['unlabeled_bullets']} unlabelled); "
        f"label rows rejected: {split['labels_rejected']}",
        f"- conversations train/valid/test: {split['conversations']['train']}/{split['conversations']['valid']}/"
        f"{split['conversations']['test']}; bullets {split['bullets_per_split']['train']}/"
        f"{split['bullets_per_split']['valid']}/{split['bullets_per_split']['test']}",
        f"- total wall time: {summary['wall_s']:.1f} s; {time_line(summary['timing'])}",
        "",
        *table(["stage", "seeds", "val MSE (mean ± std)", "val Spearman (mean ± std)", "wall s (sum)"],
               [[stage, len(e["seeds"]), _mean_std(e.get("val_mse")), _mean_std(e.get("val_spearman")),
                 fmt(e["wall_s"], 1)] for stage, e in summary["stage_summary"].items()]),
        "",
        *table(["stage", "seed", "best epoch", "epochs run", "best val loss", "set-up s", "epochs s", "predict s",
                "wall s"],
               [[r["stage"], r["seed"], fmt(r["best_epoch"]), r["epochs_run"], fmt(r["best_val_loss"]),
                 *(("reused",) * 3 if r.get("reused") else (fmt(r.get(k), 1) for k in ("setup_s", "epochs_s",
                                                                                        "predict_s"))),
                 fmt(r["wall_s"], 1)] for r in summary["runs"]]),
        "",
        "Set-up is the Ray Train run's start (controller, worker group, datasets) and checkpoint I/O, shared by the "
        "seeds of one run; stage 1 trains every seed in one run, stage 2 one run per seed.",
        "",
        *calibration_lines(summary["runs"]),
    ]
    return "\n".join(lines)


def calibration_lines(runs: list[dict[str, Any]]) -> list[str]:
    """The calibration of each trained (stage, seed): method and validation Brier/ECE, raw vs calibrated."""
    rows = []
    for r in runs:
        c = r.get("calibration")
        if not c:
            continue
        if "skipped" in c:
            rows.append([r["stage"], r["seed"], "none: " + c["skipped"], "", "", "", ""])
            continue
        raw, cal = c.get("valid_raw") or {}, c.get("valid_calibrated") or {}
        rows.append([r["stage"], r["seed"], c["method"], fmt(raw.get("brier")), fmt(cal.get("brier")),
                     fmt(raw.get("ece")), fmt(cal.get("ece"))])
    if not rows:
        return []
    thr = next((r["calibration"].get("relevance_threshold") for r in runs
                if r.get("calibration") and "method" in r["calibration"]), None)
    return ["## Calibration (validation split)", "",
            f"Raw score -> P(label >= {'the relevance threshold' if thr is None else f'{thr:g}'}), fitted on the validation split; the kept method has the lowest "
            "cross-fitted validation Brier (one_se: Platt unless isotonic is lower by more than one standard error; "
            "calibration.json in each artifact). The calibrated numbers "
            "below are in-sample; `memprune evaluate` reports them on the test split.", "",
            *table(["stage", "seed", "method", "Brier raw", "Brier calibrated", "ECE raw", "ECE calibrated"], rows),
            ""]


def render_fold_report(result: dict[str, Any]) -> str:
    """The Markdown summary of a k-fold run (OUT/train.md)."""
    counts = result["labels_counts"]
    rows = []
    for f in result["per_fold"]:
        c = f["conversations"]
        rows.append([f["fold"], f"{c['test']} / {c['train']} / {c['valid']}", f["bullets_per_split"]["test"],
                     fmt(f["wall_s"], 1)])
    return "\n".join([
        "# memprune train (k-fold by conversation)", "",
        f"- {result['folds']} folds over {len(result['fold_of'])} labelled conversations "
        f"(seed {result['config']['split']['seed']}); each fold is the test split of one run and never in its "
        "training or validation data",
        f"- labels: {', '.join(f'`{x}`' for x in result['labels'])}; by source {counts['labels_by_source']}; "
        f"{counts['labels_superseded']} superseded, {counts['labels_rejected']} rejected",
        f"- total wall time: {result['wall_s']:.1f} s; {time_line(result['timing'])}", "",
        *table(["fold", "test / train / valid conversations", "test bullets", "wall s"], rows),
        "", "Pooled evaluation of the out-of-fold predictions: `memprune evaluate --run OUT`.", "",
    ])
