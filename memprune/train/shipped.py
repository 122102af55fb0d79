"""`memprune scorers build`: the recipe of a shipped scorer (issue 54), seeded and from data in `../shared` only.

Labels: an MSC session's bullet *comes up again* when what comes later is close to it (cosine of the two MiniLM
embeddings at least `label_threshold`): the follow-up question that opens the next session (MSC's human-written
`followup` field, asked about an earlier fact), or a bullet of the same speaker in a later session. Only sessions
that have a next session are labelled; about half of their bullets come up again. The scorer is the installed
MiniLM (frozen, L2-normalised mean pooling) and a logistic head (`head.hidden: 0`), fitted by scikit-learn with L2
penalty `c` on the training episodes; its calibration is fitted on the calibration episodes and its MSC figures are
measured on the test episodes (a seeded split by episode).

LoCoMo (CC BY-NC 4.0) never trains the artifact: with `locomo` set, the recipe measures on it what a decision keeps
of the observations that later questions cite, beside the heuristic baselines and the probe the issue names (a
logistic probe on the embeddings and three counts, trained on LoCoMo's own question-cited labels, leave one
conversation out): a reference the MSC-only artifact is compared with, never a part of it.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
from pydantic import Field

from memprune.adapters import get_adapter
from memprune.adapters.msc import find_session_files
from memprune.calibration import ece, fit_calibration
from memprune.config import ConfigModel
from memprune.errors import MemPruneError
from memprune.evaluate.baselines import BUDGETS, baseline_retention, lift, retention
from memprune.evaluate.metrics import roc_auc, session_spearman
from memprune.io import jsonable, temp_name, write_json, write_text
from memprune.rejects import Ledger
from memprune.scorer import HeadSettings, Scorer, ScorerConfig


class RecipeError(MemPruneError):
    """The recipe's data or settings cannot build a scorer; the message names the file or setting."""


class ShippedRecipe(ConfigModel):
    """How a shipped scorer is built (configs/default-scorer.yaml)."""

    name: str = "default"
    version: str = "1"
    msc: str = Field("../shared/data/msc/msc_personasummary", description="MSC persona-summary directory")
    split: str = "valid"
    episodes: int | None = Field(None, ge=10, description="use only the first N episodes (a quick build)")
    label_threshold: float = Field(0.5, gt=0.0, lt=1.0, description="cosine of bullet and next session's follow-up")
    c: float = Field(0.1, gt=0.0, description="inverse L2 penalty of the logistic head")
    calibration_share: float = Field(0.2, gt=0.0, lt=0.5)
    test_share: float = Field(0.2, gt=0.0, lt=0.5)
    seed: int = 0
    locomo: str | None = Field("../shared/data/locomo-dev/locomo_dev.json",
                               description="LoCoMo file to measure question-evidence retention on (never trained on)")
    out: str = Field(description="artifact directory to write")


def msc_frame(cfg: ShippedRecipe) -> tuple[pd.DataFrame, dict[tuple[str, int], str], dict[str, int]]:
    """MSC bullets (through the MSC adapter), each session's follow-up question, and the adapter's rejects."""
    root, ledger = Path(cfg.msc), Ledger()
    bullets = [b for conv in get_adapter("msc").read(root, ledger, cfg.split) for b in conv.bullets]
    followups: dict[tuple[str, int], str] = {}
    for k, file in find_session_files(root, cfg.split):
        for line in file.read_bytes().splitlines():
            try:
                rec = json.loads(line)
                if isinstance(rec.get("followup"), str) and rec["followup"].strip():
                    followups[(rec["initial_data_id"], k)] = rec["followup"]
            except (ValueError, AttributeError, KeyError, TypeError):
                continue  # the adapter has rejected and counted such a line
    frame = pd.DataFrame(bullets)
    if frame.empty:
        raise RecipeError(f"{root}: no MSC bullets in split {cfg.split!r}")
    if cfg.episodes is not None:
        keep = sorted(frame["conversation_id"].unique(), key=lambda c: int(c.rsplit("_", 1)[-1]))[:cfg.episodes]
        frame = frame[frame["conversation_id"].isin(keep)]
    # the follow-up of session k is asked when session k + 1 opens: only sessions with a next one are labelled
    sessions = set(zip(frame["conversation_id"], frame["session_index"]))
    keys = list(zip(frame["conversation_id"], frame["session_index"]))
    frame = frame.reset_index(drop=True).assign(
        labelled=[k in followups and (k[0], k[1] + 1) in sessions for k in keys])
    return frame, followups, dict(ledger.rejected)


def comes_up_again(frame: pd.DataFrame, emb: np.ndarray, followup: dict[tuple[str, int], np.ndarray]) -> np.ndarray:
    """Per labelled bullet, the largest cosine with what comes up later: the follow-up question that opens the next
    session, or a bullet of the same speaker in a later session (NaN where the bullet is not labelled)."""
    out = np.full(len(frame), np.nan)
    for cid, idx in frame.groupby("conversation_id").indices.items():
        ses, spk = frame["session_index"].to_numpy()[idx], frame["speaker"].to_numpy()[idx]
        later = (ses[None, :] > ses[:, None]) & (spk[None, :] == spk[:, None])
        restated = np.where(later, emb[idx] @ emb[idx].T, -1.0).max(axis=1)
        for j, i in enumerate(idx):
            if frame["labelled"].iat[i]:
                out[i] = max(restated[j], float(followup[(cid, int(ses[j]))] @ emb[i]))
    return out


def locomo_frame(path: str) -> pd.DataFrame:
    """LoCoMo observations with `cited`: a question cites their evidence turn."""
    convs = list(get_adapter("locomo").read(Path(path), Ledger()))
    rows = []
    for conv in convs:
        cited = {t for q in conv.qa for t in q["evidence"]}
        rows += [{**b, "cited": bool(cited.intersection(b["evidence"]))} for b in conv.bullets]
    if not rows:
        raise RecipeError(f"{path}: no LoCoMo observations")
    return pd.DataFrame(rows)


def split_episodes(ids: np.ndarray, cfg: ShippedRecipe) -> np.ndarray:
    """0 train, 1 calibration, 2 test per row, by a seeded permutation of the episodes."""
    episodes = np.random.default_rng(cfg.seed).permutation(sorted(set(ids)))
    n_cal, n_test = (max(1, round(s * len(episodes))) for s in (cfg.calibration_share, cfg.test_share))
    part = {e: 1 if i < n_cal else 2 if i < n_cal + n_test else 0 for i, e in enumerate(episodes)}
    return np.array([part[e] for e in ids])


def fit_head(scorer: Scorer, x: np.ndarray, y: np.ndarray, c: float) -> None:
    """Fit the logistic head (scikit-learn lbfgs: deterministic) and write it into the scorer's head."""
    from sklearn.linear_model import LogisticRegression

    if y.min() == y.max():
        raise RecipeError(f"all {len(y)} training labels are {bool(y[0])}: lower or raise label_threshold")
    model = LogisticRegression(C=c, max_iter=5000).fit(x, y)
    linear = scorer.head.net[-1]
    with torch.no_grad():
        linear.weight.copy_(torch.from_numpy(model.coef_.astype(np.float32)))
        linear.bias.copy_(torch.from_numpy(model.intercept_.astype(np.float32)))


def counts(texts: pd.Series) -> np.ndarray:
    """The probe's three counts: log length, digits, capitalised words after the first."""
    return np.array([[math.log1p(len(t)), sum(ch.isdigit() for ch in t), sum(w[:1].isupper() for w in t.split()[1:])]
                     for t in texts], dtype=np.float64)


def locomo_figures(scorer: Scorer, path: str, seed: int) -> dict[str, Any]:
    """Question-evidence retention on LoCoMo of the scorer, the baselines and the LOCO probe, and the lift."""
    from sklearn.linear_model import LogisticRegression

    frame = locomo_frame(path)
    emb = scorer.embed(frame["text"].tolist())
    raw = scorer.score_embeddings(emb)
    x, y, conv = np.hstack([emb, counts(frame["text"])]), frame["cited"].to_numpy(), frame["conversation_id"].to_numpy()
    probe = np.zeros(len(frame))
    for c in sorted(set(conv)):  # leave one conversation out
        held = conv == c
        probe[held] = LogisticRegression(C=1.0, max_iter=5000).fit(x[~held], y[~held]).decision_function(x[held])
    ours = {f"q={q}": retention(frame, raw, q) for q in BUDGETS}
    baselines = baseline_retention(frame, BUDGETS, seed=seed)
    return {"data": str(path), "conversations": int(len(set(conv))), "observations": int(len(frame)),
            "cited": int(y.sum()), "scorer": ours, "baselines": baselines,
            "lift_over_best_baseline": lift(ours, baselines),
            "probe_loco": {f"q={q}": retention(frame, probe, q) for q in BUDGETS}}


def msc_figures(frame: pd.DataFrame, raw: np.ndarray, cosine: np.ndarray, label: np.ndarray, part: np.ndarray,
                calibrated: np.ndarray) -> dict[str, Any]:
    """The MSC half of the card: counts, the split, and the test episodes' AUC, ECE and session Spearman."""
    test = part == 2
    sessions = frame[test].assign(s=raw[test], c=cosine[test]).groupby(["conversation_id", "session_index"])
    y = label[test].astype(float)
    return {"bullets": int(len(frame)), "comes_up_again_share": float(label.mean()),
            "episodes": {name: int(frame["conversation_id"][part == i].nunique())
                         for i, name in enumerate(("train", "calibration", "test"))},
            "test": {"auc": roc_auc(label[test], raw[test]), "ece_calibrated": ece(calibrated, y),
                     "ece_raw": ece(raw[test], y),
                     "session_spearman_vs_label_cosine": float(np.nanmean([session_spearman(g["c"], g["s"])
                                                                           for _, g in sessions]))}}


def run(cfg: ShippedRecipe) -> dict[str, Any]:
    """Build the artifact at `cfg.out` (scorer.json, head.safetensors, calibration.json, card.json, card.md)."""
    start = time.monotonic()
    out = Path(cfg.out)
    if out.exists() and not (out / "card.json").is_file():
        raise RecipeError(f"{out}: exists and is not a built scorer (no card.json): choose another out")
    frame, followups, rejects = msc_frame(cfg)
    config = ScorerConfig(normalize=True, head=HeadSettings(hidden=0, dropout=0.0), stage="shipped", threshold=None)
    scorer = Scorer.build(config, seed=cfg.seed)
    print(f"memprune scorers build: embedding {len(frame)} MSC bullets and their follow-ups", flush=True)
    emb = scorer.embed(frame["text"].tolist())
    on = frame["labelled"].to_numpy()
    keys = sorted(set(zip(frame["conversation_id"][on], frame["session_index"][on])))
    cosine = comes_up_again(frame, emb, dict(zip(keys, scorer.embed([followups[k] for k in keys]))))[on]
    frame, emb = frame[on].reset_index(drop=True), emb[on]
    label = cosine >= cfg.label_threshold
    part = split_episodes(frame["conversation_id"].to_numpy(), cfg)
    fit_head(scorer, emb[part == 0], label[part == 0], cfg.c)
    raw = scorer.score_embeddings(emb)
    scorer.calibration = fit_calibration(raw[part == 1], label[part == 1].astype(float), seed=cfg.seed,
                                         groups=frame["conversation_id"][part == 1].to_numpy())
    card: dict[str, Any] = {
        "name": cfg.name, "version": cfg.version, "encoder": scorer.config.encoder,
        "labels": f"comes up again (MSC): the follow-up question that opens the next session, or a later session's "
                  f"bullet of the same speaker, is within cosine {cfg.label_threshold} of the bullet",
        "data": {"trained_on": f"MSC {cfg.split} (persona-summary layout)", "licences": {
            "MSC": "released by Meta AI with ParlAI (MIT-licensed code); the data states no licence of its own: check "
                   "its terms for your use",
            "LoCoMo": "CC BY-NC 4.0: measured on, never trained on; the artifact holds nothing of it"}},
        "recipe": cfg.model_dump(exclude={"out"}),
        "msc": {**msc_figures(frame, raw, cosine, label, part, scorer.calibrate(raw[part == 2])), "rejects": rejects},
    }
    if cfg.locomo:
        print(f"memprune scorers build: measuring question-evidence retention on {cfg.locomo}", flush=True)
        card["locomo"] = locomo_figures(scorer, cfg.locomo, cfg.seed)
    card["build_seconds"] = round(time.monotonic() - start, 1)
    tmp = out.parent / temp_name(out.name)
    try:
        scorer.save(tmp)
        write_json(tmp / "card.json", jsonable(card))
        write_text(tmp / "card.md", card_markdown(card))
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return card


def _pct(x: float) -> str:
    return "n/a" if x is None or math.isnan(x) else f"{100 * x:.1f}%"


def card_markdown(card: dict[str, Any]) -> str:
    """The card's figures as Markdown tables (the human half of card.json)."""
    t = card["msc"]["test"]
    lines = [f"# Scorer `{card['name']}` version {card['version']}", "", f"- encoder: {card['encoder']}",
             f"- labels: {card['labels']}", f"- trained on: {card['data']['trained_on']}",
             f"- MSC test episodes: AUC {t['auc']:.3f}, ECE calibrated {t['ece_calibrated']:.3f} "
             f"(raw {t['ece_raw']:.3f}), session Spearman vs the label's cosine "
             f"{t['session_spearman_vs_label_cosine']:.3f}", ""]
    if "locomo" in card:
        lo = card["locomo"]
        budgets = sorted(lo["scorer"], reverse=True)

        def row(name: str, shares: dict[str, float]) -> str:
            return f"| {name} | " + " | ".join(_pct(shares[b]) for b in budgets) + " |"

        lift_row = " | ".join(f"{100 * lo['lift_over_best_baseline'][b]:+.1f} points" for b in budgets)
        lines += [f"Question-evidence retention on {lo['conversations']} LoCoMo conversations ({lo['cited']} of "
                  f"{lo['observations']} observations cited):", "", "| decision | " + " | ".join(budgets) + " |",
                  "|---|" + "---|" * len(budgets), row(f"**{card['name']}**", lo["scorer"]),
                  *(row(name, v) for name, v in lo["baselines"].items()),
                  row("probe on LoCoMo's own labels (leave one conversation out)", lo["probe_loco"]),
                  f"| lift over the best baseline | {lift_row} |", ""]
    return "\n".join(lines)
