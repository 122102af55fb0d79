"""Probability calibration on a held-out split: ECE and Brier of raw vs calibrated scores, and the reliability diagram.

Each trained (stage, seed) artifact may hold a `calibration.json` (fitted on its validation split
at training time, `memprune.train.calibrate`); here it is applied to the same run's predictions
of the evaluated split (normally test), and both the raw scores and the calibrated
probabilities are scored against the binary target label >= the calibration's relevance
threshold. A stage without calibration (vanilla, or an old run) gets its raw numbers only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from memprune.calibration import CalibrationError, brier, ece, read_calibration, relevance, reliability_bins
from memprune.evaluate.config import EvaluationError
from memprune.evaluate.significance import aggregate
from memprune.figures import new_figure, save_png
from memprune.markdown import mean_std, table


def relevance_calibration(frames: dict[str, dict[int, pd.DataFrame]], artifacts: dict[str, dict[int, Path]],
                          threshold: float, bins: int) -> dict[str, Any]:
    """Per stage: per-seed and mean ± std ECE/Brier of raw and calibrated scores, pooled reliability bins of both.

    `artifacts` maps stage -> seed -> the artifact directory that holds the frame's predictions.
    """
    out: dict[str, Any] = {"bins": bins, "stages": {}, "notes": []}
    for stage, seeds in frames.items():
        cals = {}
        for seed in seeds:
            try:
                cals[seed] = read_calibration(artifacts[stage][seed])
            except CalibrationError as exc:
                raise EvaluationError(str(exc)) from exc
        have = [s for s, c in cals.items() if c is not None]
        if have and len(have) != len(cals):
            out["notes"].append(f"{stage}: seeds {sorted(set(cals) - set(have))} have no calibration.json; "
                                "the stage's calibrated numbers use the others")
        thr = cals[have[0]].relevance_threshold if have else threshold
        if any(cals[s].relevance_threshold != thr for s in have):  # type: ignore[union-attr]
            raise EvaluationError(f"{stage}: the seeds' calibration.json files use different relevance thresholds")
        if have and thr != threshold:
            out["notes"].append(f"{stage}: calibrated for label >= {thr}, the evaluation's relevance threshold is "
                                f"{threshold}; ECE and Brier here use {thr}")
        per_seed: dict[str, Any] = {}
        pooled: dict[str, list[np.ndarray]] = {"y": [], "raw": [], "cal": [], "y_cal": []}
        for seed, df in seeds.items():
            y = relevance(df["label"].to_numpy(), thr)
            raw = df["score"].to_numpy(dtype=np.float64)
            entry: dict[str, Any] = {"raw": {"brier": brier(raw, y), "ece": ece(raw, y, bins)}}
            pooled["y"].append(y)
            pooled["raw"].append(raw)
            cal = cals[seed]
            if cal is not None:
                p = cal.apply(raw)
                entry["method"] = cal.method
                entry["calibrated"] = {"brier": brier(p, y), "ece": ece(p, y, bins)}
                pooled["cal"].append(p)
                pooled["y_cal"].append(y)
            per_seed[str(seed)] = entry
        stage_out: dict[str, Any] = {
            "relevance_threshold": thr,
            "calibrated_seeds": len(have),
            "methods": sorted({cals[s].method for s in have}),  # type: ignore[union-attr]
            "per_seed": per_seed,
            "raw": {m: aggregate({int(k): e["raw"][m] for k, e in per_seed.items()}) for m in ("ece", "brier")},
            "reliability_raw": reliability_bins(np.concatenate(pooled["raw"]), np.concatenate(pooled["y"]), bins),
        }
        if have:
            stage_out["calibrated"] = {m: aggregate({int(k): e["calibrated"][m] for k, e in per_seed.items()
                                                     if "calibrated" in e}) for m in ("ece", "brier")}
            stage_out["reliability_calibrated"] = reliability_bins(np.concatenate(pooled["cal"]),
                                                                   np.concatenate(pooled["y_cal"]), bins)
        out["stages"][stage] = stage_out
    return out


def calibration_table(rc: dict[str, Any], label: Any) -> list[str]:
    """Markdown: ECE and Brier (mean ± std over seeds) of raw and calibrated scores per stage."""
    rows = []
    for stage, e in rc["stages"].items():
        cal = e.get("calibrated") or {}
        rows.append([label(stage), f"{e['calibrated_seeds']}/{len(e['per_seed'])}", ", ".join(e["methods"]) or "—",
                     mean_std(e["raw"]["ece"]), mean_std(cal.get("ece")), mean_std(e["raw"]["brier"]),
                     mean_std(cal.get("brier"))])
    thr = {e["relevance_threshold"] for e in rc["stages"].values()}
    return [f"Target: label >= {', '.join(f'{t:g}' for t in sorted(thr))} (relevant). Calibration maps were fitted on "
            f"the validation split at training time; ECE over {rc['bins']} equal-width bins.", "",
            *table(["stage", "calibrated seeds", "method", "ECE raw", "ECE calibrated", "Brier raw",
                    "Brier calibrated"], rows),
            *[f"\n> Note: {n}" for n in rc.get("notes", [])]]


def figure_reliability(rc: dict[str, Any], label: Any, path: Path) -> None:
    """One panel per stage: observed relevance rate against mean predicted probability per bin, raw vs calibrated."""
    stages = list(rc["stages"])
    fig = new_figure(3.6 * len(stages), 3.6)
    for i, stage in enumerate(stages):
        e = rc["stages"][stage]
        ax = fig.add_subplot(1, len(stages), i + 1)
        ax.plot([0, 1], [0, 1], ":", color="gray", label="perfect")
        for key, name, style in (("reliability_raw", "raw", "o-"), ("reliability_calibrated", "calibrated", "s-")):
            if key in e:
                b = e[key]
                ece_v = (e["raw"] if name == "raw" else e["calibrated"])["ece"]["mean"]
                ax.plot([x["mean_prob"] for x in b], [x["rate"] for x in b], style, markersize=4,
                        label=f"{name} (ECE {ece_v:.3f})")
        ax.set_title(label(stage))
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ax.set_xlabel("mean predicted probability (bin)")
        if i == 0:
            ax.set_ylabel(f"observed rate of label >= {e['relevance_threshold']}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper left")
    save_png(fig, path)
