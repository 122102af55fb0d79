"""Benchmark near-duplicate merging: precision and recall of the injected duplicates, over a threshold sweep.

A corpus from `memprune synth --duplicates P` (kept under --out and reused) knows which bullets are
injected copies (`dup_source`: the bullet copied; `dup_kind`: verbatim or paraphrase). The scorer's
encoder embeds every bullet once (`score_and_embed`, as `memprune prune` does), then for each cosine
threshold the decision's duplicate step (`find_duplicates`, exact normalised text + cosine, per
session, transitive) marks bullets as duplicates of a representative. A marked bullet is a true
positive when its representative belongs to the same injected cluster (the original and its copies).

- precision = true positives / bullets marked as duplicates
- recall    = true positives / injected copies (per kind too)

The default `--dedup-threshold` of `memprune prune` is the threshold of the sweep with the highest F1
among those with precision >= 0.95 and recall >= 0.9 (F1 within 0.001 of the best: the higher, more
cautious threshold wins, since a wrong merge loses a fact and a missed one only wastes a slot).

    python bench/dedup_bench.py --conversations 200 --duplicates 0.2 --out runs/bench-dedup
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
THRESHOLDS = [0.75, 0.8, 0.82, 0.84, 0.86, 0.88, 0.9, 0.92, 0.94, 0.96, 0.98]


def measure(table: Any, scores: np.ndarray, emb: np.ndarray, thresholds: list[float]) -> list[dict[str, Any]]:
    """Precision and recall of the duplicates found at each threshold (exact-text merging always on)."""
    from memprune.decision import Bullets, find_duplicates
    from memprune.prune import group_keys_of

    ids = np.array(table.column("bullet_id").to_pylist(), dtype=object)
    source = table.column("dup_source").to_pylist()
    kinds = table.column("dup_kind").to_pylist()
    root = np.array([s if s is not None else i for i, s in zip(ids, source)], dtype=object)
    bullets = Bullets.of(scores, group_keys_of(table, ["conversation_id", "session_index"]),
                         texts=table.column("text").to_pylist(), embeddings=emb)
    injected = np.array([k is not None for k in kinds])
    rows = []
    for t in thresholds:
        dup = find_duplicates(bullets, t)
        marked = dup >= 0
        tp = marked & (root == root[np.where(marked, dup, 0)])
        row = {"threshold": t, "marked": int(marked.sum()), "true_positives": int(tp.sum()),
               "precision": float(tp.sum() / marked.sum()) if marked.any() else 1.0,
               "recall": float(tp.sum() / injected.sum()) if injected.any() else 1.0}
        # a copy is found when it is merged with its cluster: marked (correctly), or the representative of a member
        found = tp | np.isin(np.arange(len(ids)), dup[tp])
        for kind in ("verbatim", "paraphrase"):
            of_kind = np.array([k == kind for k in kinds])
            row[f"recall_{kind}"] = float((found & of_kind).sum() / of_kind.sum()) if of_kind.any() else None
        rows.append(row)
    return rows


def cost(scorer: Any, table: Any, rows: int, repeats: int) -> dict[str, Any]:
    """CPU seconds per bullet of scoring + deciding with and without merging, interleaved repeats, one thread.

    CPU time of this process (not wall time), so that other load on the machine moves it less.
    """
    import torch

    from memprune.decision import Bullets, PruneRule, decide
    from memprune.prune import group_keys_of, score_and_embed

    torch.set_num_threads(1)
    part = table.slice(0, rows)
    texts = part.column("text").to_pylist()
    groups = group_keys_of(part, ["conversation_id", "session_index"])
    rules = {True: PruneRule.of(), False: PruneRule.of(dedup=False)}
    spent: dict[bool, list[float]] = {True: [], False: []}
    decide_s: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(repeats):
        for dedup in (True, False):
            t0 = time.process_time()
            scores, emb = score_and_embed(scorer, texts, batch_size=128, embed=dedup)
            t1 = time.process_time()
            decide(Bullets.of(scores, groups, texts=texts, embeddings=emb), rules[dedup])
            t2 = time.process_time()
            spent[dedup].append(t2 - t0)
            decide_s[dedup].append(t2 - t1)
    med = {d: float(np.median(v)) for d, v in spent.items()}
    return {"rows": rows, "repeats": repeats, "cpu_s_median": {"dedup": med[True], "no_dedup": med[False]},
            "decide_ms_per_bullet": {"dedup": 1000 * float(np.median(decide_s[True])) / rows,
                                     "no_dedup": 1000 * float(np.median(decide_s[False])) / rows},
            "slowdown_pct": 100 * (med[True] / med[False] - 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conversations", type=int, default=200)
    ap.add_argument("--duplicates", type=float, default=0.2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--scorer", default=None, help="scorer artifact (default: a vanilla MiniLM scorer built here)")
    ap.add_argument("--out", default="runs/bench-dedup")
    ap.add_argument("--cost-rows", type=int, default=0, help="also time scoring + deciding with/without merging "
                                                              "on this many bullets (CPU time, one thread)")
    ap.add_argument("--cost-repeats", type=int, default=5)
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import pyarrow.parquet as pq

    from memprune.prune import score_and_embed
    from memprune.scorer import Scorer, ScorerConfig
    from memprune.synth import generate

    out = Path(args.out)
    corpus = out / f"synth-{args.conversations}-dup{args.duplicates:g}-seed{args.seed}"
    if not (corpus / "bullets.parquet").is_file():
        generate(corpus, conversations=args.conversations, duplicates=args.duplicates, seed=args.seed)
    table = pq.read_table(corpus / "bullets.parquet")
    if args.scorer:
        scorer = Scorer.load(args.scorer)
    else:
        from memprune.encoders import minilm_path

        scorer = Scorer.build(ScorerConfig(encoder=minilm_path()), seed=0)
    t0 = time.perf_counter()
    scores, emb = score_and_embed(scorer, table.column("text").to_pylist(), batch_size=128)
    embed_s = time.perf_counter() - t0
    rows = measure(table, scores, emb, THRESHOLDS)
    for r in rows:
        p, rc = r["precision"], r["recall"]
        r["f1"] = 2 * p * rc / (p + rc) if p + rc else 0.0
    good = [r for r in rows if r["precision"] >= 0.95 and r["recall"] >= 0.9]
    best = max((r["f1"] for r in good), default=None)
    default = max((r for r in good if r["f1"] >= best - 1e-3), key=lambda r: r["threshold"]) if good else None
    result = {"corpus": str(corpus), "bullets": table.num_rows,
              "injected": int(sum(k is not None for k in table.column("dup_kind").to_pylist())),
              "encoder": scorer.config.encoder, "embed_s": round(embed_s, 1), "sweep": rows,
              "chosen_threshold": default["threshold"] if default else None}
    print(f"{'threshold':>9} {'marked':>7} {'TP':>6} {'precision':>9} {'recall':>7} {'verbatim':>8} {'paraphr.':>8}")
    for r in rows:
        print(f"{r['threshold']:>9.2f} {r['marked']:>7} {r['true_positives']:>6} {r['precision']:>9.3f} "
              f"{r['recall']:>7.3f} {r['recall_verbatim']:>8.3f} {r['recall_paraphrase']:>8.3f}")
    print(f"injected {result['injected']} duplicates in {table.num_rows} bullets; default threshold "
          f"(best F1 with precision >= 0.95, recall >= 0.9): {result['chosen_threshold']}")
    if args.cost_rows:
        c = result["cost"] = cost(scorer, table, args.cost_rows, args.cost_repeats)
        print(f"cost on {c['rows']} bullets ({c['repeats']} interleaved repeats, CPU time, 1 thread): score + decide "
              f"{c['cpu_s_median']['dedup']:.2f} s with merging vs {c['cpu_s_median']['no_dedup']:.2f} s without "
              f"({c['slowdown_pct']:+.1f}%); deciding {c['decide_ms_per_bullet']['dedup']:.4f} vs "
              f"{c['decide_ms_per_bullet']['no_dedup']:.4f} ms/bullet")
    out.mkdir(parents=True, exist_ok=True)
    (out / "dedup_bench.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
