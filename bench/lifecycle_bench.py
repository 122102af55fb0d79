"""Benchmark supersession: the built-in update judge on synthetic fact updates, over the similarity band.

A corpus of `memprune synth --updates P` conversations (generated in memory) knows, per bullet, its persona
fact (slot) and, for the first bullet of a new value, the bullet of the old value it replaces (`update_of`).
The scorer's encoder embeds every bullet once; then, for each lower edge of the band, the decision's
supersession step (`MemoryPruner`, scope = conversation, subject = speaker, judge `slot`) marks bullets
`superseded`. A superseded bullet is stale when its slot got a new value in a later session than its own.

- precision = stale superseded / superseded; recall = stale bullets superseded / stale bullets
  (the old values of updated slots)
- false supersession = unchanged (current-value) bullets superseded / unchanged bullets
- newest kept: per updated slot, under a token budget per session, the slot's kept bullets all state its newest
  value (and one is kept), with supersession vs the same decision without it

`--fit` fits the `slot` judge's logistic model on the candidate pairs of another seed and prints its
coefficients (to paste into memprune/prune/updates/slot.py), then measures with them.

    python bench/lifecycle_bench.py --conversations 120 --updates 0.3 --seed 1 [--fit]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
LOWS = [0.4, 0.5, 0.6, 0.7, 0.8]


def corpus(conversations: int, updates: float, seed: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Bullets as mappings (the columns the decision reads) and per-bullet ground truth."""
    from memprune.synth.config import SynthSettings
    from memprune.synth.generator import synth_conversation

    settings = SynthSettings(conversations=conversations, updates=updates, seed=seed)
    rows, slot, stale, newest = [], [], [], []
    for i in range(conversations):
        conv = synth_conversation(i, settings)
        times = {s.session_index: s.time for s in conv.sessions}
        upd = {b.slot: b.session_index for b in conv.bullets if b.update_of is not None}
        for b in conv.bullets:
            rows.append({"bullet_id": b.bullet_id, "text": b.text, "speaker": b.speaker,
                         "conversation_id": conv.conversation_id, "session_index": b.session_index,
                         "time": times[b.session_index]})
            key = None if b.slot is None else (conv.conversation_id, b.slot)
            slot.append(key)
            stale.append(b.slot in upd and b.session_index < upd[b.slot])
            newest.append(b.slot in upd and b.session_index >= upd[b.slot])
    return rows, {"slot": slot, "stale": np.array(stale), "newest": np.array(newest)}


def pairs_of(rows: list[dict[str, Any]], truth: dict[str, Any], emb: np.ndarray, low: float, high: float) -> Any:
    """The step's candidate pairs (every bullet a representative, none pinned) and whether each is an update."""
    from memprune.prune.lifecycle import life_of_mappings
    from memprune.prune.lifecycle import Retention
    from memprune.prune.supersede import Supersede, candidates

    life = life_of_mappings(rows, None, Retention(), supersede=Supersede(judge="slot"))
    a, b, c = candidates((low, high), life.scope, life.subject, life.when, life.session, emb, None, None)
    slot, stale, newest = truth["slot"], truth["stale"], truth["newest"]
    y = np.array([slot[i] is not None and slot[i] == slot[j] and stale[i] and newest[j] for i, j in zip(a, b)])
    return a, b, c, y


def fit(rows: list[dict[str, Any]], truth: dict[str, Any], emb: np.ndarray, encode: Any, low: float,
        high: float) -> tuple[np.ndarray, float]:
    from sklearn.linear_model import LogisticRegression

    from memprune.prune.updates import Pairs
    from memprune.prune.updates.slot import features

    a, b, c, y = pairs_of(rows, truth, emb, low, high)
    x = features(Pairs([rows[i]["text"] for i in a], [rows[j]["text"] for j in b], c, encode))
    model = LogisticRegression(C=10.0, max_iter=5000).fit(x, y)
    return model.coef_[0], float(model.intercept_[0])


def measure(pruner_for: Any, rows: list[dict[str, Any]], truth: dict[str, Any], low: float) -> dict[str, Any]:
    _, d = pruner_for(low).decisions(rows, groups=[(r["conversation_id"], r["session_index"]) for r in rows])
    sup = d.superseded_by >= 0
    stale = truth["stale"]
    unchanged = ~stale
    tp = int((sup & stale).sum())
    return {"low": low, "superseded": int(sup.sum()), "stale": int(stale.sum()), "true": tp,
            "precision": tp / sup.sum() if sup.any() else 1.0, "recall": tp / stale.sum() if stale.any() else 1.0,
            "false_supersession_pct": 100.0 * (sup & unchanged).sum() / unchanged.sum()}


def newest_kept(keep: np.ndarray, truth: dict[str, Any]) -> float:
    """Share of updated slots whose kept bullets all state the newest value (and at least one is kept)."""
    slots: dict[Any, list[int]] = {}
    for i, s in enumerate(truth["slot"]):
        if s is not None and (truth["stale"][i] or truth["newest"][i]):
            slots.setdefault(s, []).append(i)
    ok = [any(keep[i] for i in idx if truth["newest"][i]) and not any(keep[i] for i in idx if truth["stale"][i])
          for idx in slots.values()]
    return float(np.mean(ok)) if ok else 1.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--conversations", type=int, default=120)
    ap.add_argument("--updates", type=float, default=0.3)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--fit", action="store_true", help="fit the slot judge on seed 0 first and use it")
    ap.add_argument("--budget", type=int, default=40, help="tokens per session for the newest-kept comparison")
    ap.add_argument("--scorer", default=None, help="a scorer artifact (default: an untrained all-MiniLM-L6-v2 head)")
    ap.add_argument("--out", default="runs/bench-lifecycle")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from memprune.prune import MemoryPruner, score_and_embed
    from memprune.prune.config import DEDUP_THRESHOLD
    from memprune.prune.updates import slot
    from memprune.scorer import Scorer, ScorerConfig

    if args.scorer:
        scorer = Scorer.load(args.scorer)
    else:
        from memprune.encoders import minilm_path

        scorer = Scorer.build(ScorerConfig(encoder=minilm_path()), seed=0)

    def encode(texts: list[str]) -> np.ndarray:
        return scorer.embed(texts, batch_size=128)

    result: dict[str, Any] = {"encoder": scorer.config.encoder, "conversations": args.conversations,
                              "updates": args.updates, "seed": args.seed}
    if args.fit:
        rows, truth = corpus(args.conversations, args.updates, 0)
        _, emb = score_and_embed(scorer, [r["text"] for r in rows], 128)
        coef, intercept = fit(rows, truth, emb, encode, min(LOWS), DEDUP_THRESHOLD)
        slot.COEF, slot.INTERCEPT = coef, intercept
        print(f"fitted on seed 0: COEF = np.array({[round(float(x), 4) for x in coef]}); INTERCEPT = {intercept:.4f}")
        result["fitted"] = {"coef": coef.tolist(), "intercept": intercept}
    rows, truth = corpus(args.conversations, args.updates, args.seed)
    t0 = time.perf_counter()
    _, emb = score_and_embed(scorer, [r["text"] for r in rows], 128)
    a, b, c, y = pairs_of(rows, truth, emb, min(LOWS), DEDUP_THRESHOLD)
    from memprune.prune.updates import Pairs

    verdict = slot.judge(Pairs([rows[i]["text"] for i in a], [rows[j]["text"] for j in b], c, encode))
    tp = int((verdict & y).sum())
    result["pairs"] = {"candidates": int(len(y)), "updates": int(y.sum()), "judged_updates": int(verdict.sum()),
                       "precision": tp / max(int(verdict.sum()), 1), "recall": tp / max(int(y.sum()), 1)}

    def pruner(low: float, on: bool = True, **rule: Any) -> MemoryPruner:
        return MemoryPruner(scorer, supersede={"judge": "slot", "low": low} if on else {}, min_keep=0, threshold=0.0,
                            **rule)

    result["band"] = [measure(pruner, rows, truth, low) for low in LOWS]
    groups = [(r["conversation_id"], r["session_index"]) for r in rows]
    kept = {}
    for name, on in (("with", True), ("without", False)):
        p = MemoryPruner(scorer, supersede={"judge": "slot", "low": 0.4} if on else {}, budget_tokens=args.budget,
                         tokenizer="whitespace")
        kept[name] = newest_kept(p.decisions(rows, groups)[1].keep, truth)
    result["newest_kept"] = {"budget_tokens_per_session": args.budget, "with_supersession": kept["with"],
                             "without": kept["without"]}
    result["seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(result, indent=2, default=float))
    print("\n| band low | superseded | precision | recall | false supersession % |\n|---|---|---|---|---|")
    for r in result["band"]:
        print(f"| {r['low']:.1f} | {r['superseded']} | {r['precision']:.3f} | {r['recall']:.3f} | "
              f"{r['false_supersession_pct']:.2f} |")
    pr = result["pairs"]
    print(f"\ncandidate pairs (band [{min(LOWS)}, {DEDUP_THRESHOLD})): {pr['candidates']}, updates {pr['updates']}; "
          f"judge precision {pr['precision']:.3f}, recall {pr['recall']:.3f}")
    nk = result["newest_kept"]
    print(f"newest value kept (budget {args.budget} tokens/session): {nk['with_supersession']:.3f} with supersession, "
          f"{nk['without']:.3f} without")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "lifecycle_bench.json").write_text(json.dumps(result, indent=2, default=float) + "\n")


if __name__ == "__main__":
    main()
