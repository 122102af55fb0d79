"""Benchmark the `budget` policy on a labelled corpus: relevant bullets kept against random same-budget pruning.

Runs `memprune prune --budget-tokens B --min-keep 1` (the Ray job) on a corpus with a trained scorer,
where B is `--share` (default 40%) of the corpus tokens per session (tokens: the scorer's encoder
tokenizer, as prune.json counts them). Then, on the same bullets, tokens and groups:

- the job's decision (duplicates merged, the scorer's ranking);
- the scorer's ranking without duplicate merging (`decision.decide` on the job's own scores);
- random pruning at the same budget and min-keep: the same policy with uniform random scores, over
  `--random-seeds` seeds (mean and std);
- the paper's rule (threshold 0.5, top-k 5) on the same scores, for the share of sessions it empties.

Relevant = label >= `--relevant` (default 0.5) in the labels table; unlabelled bullets count as not
relevant and are reported. The headline is relevant bullets kept by the job / by random.

    python bench/budget_bench.py --scorer runs/train/stage1/seed0 --data runs/msc --labels runs/msc-labels-sim \\
        --out runs/bench-budget
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def kept_stats(keep: np.ndarray, relevant: np.ndarray, tokens: np.ndarray, codes: np.ndarray) -> dict[str, Any]:
    """Relevant bullets, bullets and tokens kept, and sessions emptied, for one keep mask."""
    n_groups = int(codes.max()) + 1
    return {"relevant_kept": int((keep & relevant).sum()), "bullets_kept": int(keep.sum()),
            "tokens_kept": int(tokens[keep].sum()), "token_share_kept": float(tokens[keep].sum() / tokens.sum()),
            "precision": float((keep & relevant).sum() / keep.sum()) if keep.any() else None,
            "recall": float((keep & relevant).sum() / relevant.sum()) if relevant.any() else None,
            "groups_emptied": int((np.bincount(codes[keep], minlength=n_groups) == 0).sum())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scorer", required=True)
    ap.add_argument("--data", required=True, help="corpus dir (bullets.parquet)")
    ap.add_argument("--labels", required=True, help="dir with labels.parquet")
    ap.add_argument("--out", required=True)
    ap.add_argument("--share", type=float, default=0.4)
    ap.add_argument("--relevant", type=float, default=0.5)
    ap.add_argument("--min-keep", type=int, default=1)
    ap.add_argument("--random-seeds", type=int, default=20)
    ap.add_argument("--splits", default=None, help="a training run's splits.parquet: also report the test split alone")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import pyarrow.parquet as pq

    from memprune.decision import Bullets, PruneRule, decide
    from memprune.prune import PruneConfig, group_keys_of, read_pruned, run_prune
    from memprune.scorer import read_scorer_config
    from memprune.tokens import token_counter

    out = Path(args.out)
    bullets = pq.read_table(Path(args.data) / "bullets.parquet", columns=["bullet_id", "conversation_id",
                                                                          "session_index", "text"])
    count, unit = token_counter("encoder", encoder=read_scorer_config(args.scorer).encoder)
    tokens_all = count(bullets.column("text").to_pylist())
    sessions = len(set(group_keys_of(bullets, ["conversation_id", "session_index"])))
    budget = int(round(args.share * tokens_all.sum() / sessions))
    rule = PruneRule.of(policy="budget", budget_tokens=budget, min_keep=args.min_keep)
    done = out / "prune" / "prune.json"
    previous = json.loads(done.read_text()) if done.is_file() else None
    if previous and previous["fingerprint"] and previous["rule"]["name"] == rule.name and \
            previous["config"]["rule"] == rule.model_dump(mode="json") and previous["scorer"]["path"] == \
            str(Path(args.scorer).resolve()):
        summary = previous  # the same job already ran into this directory: reuse it
    else:
        summary = run_prune(PruneConfig(scorer=args.scorer, input=args.data, out=str(out / "prune"), rule=rule,
                                        progress=False))
    pruned = read_pruned(out / "prune")
    labels = pq.read_table(Path(args.labels) / "labels.parquet", columns=["bullet_id", "label"]).to_pydict()
    label_of = dict(zip(labels["bullet_id"], labels["label"]))
    ids = pruned.column("bullet_id").to_pylist()
    label = np.array([label_of.get(b, np.nan) for b in ids], dtype=np.float64)
    relevant = label >= args.relevant  # NaN (unlabelled) -> False
    tokens = count(pruned.column("text").to_pylist())
    scored = Bullets.of(pruned.column("score").to_numpy(), group_keys_of(pruned, ["conversation_id", "session_index"]),
                        tokens=tokens)
    codes, scores = scored.groups, scored.scores
    keep = pruned.column("keep").to_numpy(zero_copy_only=False)
    alone = rule.scores_only()  # the scorer's ranking without duplicate merging

    def random_keep(rng: np.random.Generator) -> np.ndarray:
        return decide(scored.with_(scores=rng.random(len(scores))), alone).keep

    no_dedup = decide(scored, alone).keep
    rng = np.random.default_rng(0)
    randoms = [kept_stats(random_keep(rng), relevant, tokens, codes) for _ in range(args.random_seeds)]
    paper = decide(scored, PruneRule.of(threshold=0.5, top_k=5, dedup=False, min_keep=0)).keep
    rand_rel = np.array([r["relevant_kept"] for r in randoms], dtype=np.float64)
    job = kept_stats(keep, relevant, tokens, codes)
    result = {
        "scorer": args.scorer, "data": args.data, "labels": args.labels, "bullets": len(ids), "sessions": sessions,
        "labelled": int(np.isfinite(label).sum()), "relevant": int(relevant.sum()), "relevant_threshold": args.relevant,
        "token_unit": unit, "corpus_tokens": int(tokens.sum()), "budget_tokens_per_session": budget,
        "share": args.share, "min_keep": args.min_keep,
        "job": {**job, "duplicates_merged": summary["duplicates"],
                "groups_over_budget": summary["result"]["groups_over_budget"],
                "kept_by_min_keep": summary["result"]["kept_by_min_keep"],
                "bullets_per_s": summary["timing"]["bullets_per_s"]},
        "scorer_without_dedup": kept_stats(no_dedup, relevant, tokens, codes),
        "random": {"seeds": args.random_seeds, "relevant_kept_mean": float(rand_rel.mean()),
                   "relevant_kept_std": float(rand_rel.std(ddof=1)),
                   "token_share_kept_mean": float(np.mean([r["token_share_kept"] for r in randoms])),
                   "bullets_kept_mean": float(np.mean([r["bullets_kept"] for r in randoms]))},
        "paper_rule_t0.5_k5": kept_stats(paper, relevant, tokens, codes),
    }
    if args.splits:  # the same decisions, counted on the test split's sessions only (bullets the scorer never saw)
        split = dict(zip(*pq.read_table(args.splits, columns=["conversation_id", "split"]).to_pydict().values()))
        test = np.array([split.get(c) == "test" for c in pruned.column("conversation_id").to_pylist()])
        rng = np.random.default_rng(1)
        rand_test = [int((random_keep(rng) & relevant & test).sum()) for _ in range(args.random_seeds)]
        result["test_split"] = {
            "bullets": int(test.sum()), "relevant": int((relevant & test).sum()),
            "job_relevant_kept": int((keep & relevant & test).sum()),
            "job_tokens_share_kept": float(tokens[keep & test].sum() / tokens[test].sum()),
            "random_relevant_kept_mean": float(np.mean(rand_test)), "random_relevant_kept_std": float(np.std(rand_test, ddof=1)),
        }
        result["test_split"]["ratio_vs_random"] = (result["test_split"]["job_relevant_kept"]
                                                   / result["test_split"]["random_relevant_kept_mean"])
    result["ratio_relevant_kept_vs_random"] = job["relevant_kept"] / result["random"]["relevant_kept_mean"]
    result["ratio_without_dedup_vs_random"] = (result["scorer_without_dedup"]["relevant_kept"]
                                               / result["random"]["relevant_kept_mean"])
    (out / "budget_bench.json").write_text(json.dumps(result, indent=2) + "\n")
    r = result
    print(f"{r['bullets']} bullets in {r['sessions']} sessions, {r['relevant']} relevant (label >= {args.relevant}); "
          f"budget {budget} tokens/session = {args.share:.0%} of the corpus's {r['corpus_tokens']} tokens / {sessions} sessions; "
          f"min-keep {args.min_keep}")
    print(f"job (scorer + dedup): {job['relevant_kept']} relevant kept, {job['bullets_kept']} bullets, "
          f"{job['token_share_kept']:.1%} of tokens, {job['groups_emptied']} sessions emptied, "
          f"{r['job']['duplicates_merged']} duplicates merged")
    print(f"scorer without dedup: {r['scorer_without_dedup']['relevant_kept']} relevant kept, "
          f"{r['scorer_without_dedup']['token_share_kept']:.1%} of tokens")
    print(f"random ({args.random_seeds} seeds): {r['random']['relevant_kept_mean']:.1f} ± "
          f"{r['random']['relevant_kept_std']:.1f} relevant kept, {r['random']['token_share_kept_mean']:.1%} of tokens")
    print(f"ratio job / random: {r['ratio_relevant_kept_vs_random']:.3f} (without dedup "
          f"{r['ratio_without_dedup_vs_random']:.3f})")
    if "test_split" in r:
        t = r["test_split"]
        print(f"test split only ({t['bullets']} bullets, {t['relevant']} relevant): job {t['job_relevant_kept']} vs "
              f"random {t['random_relevant_kept_mean']:.1f} ± {t['random_relevant_kept_std']:.1f}; ratio "
              f"{t['ratio_vs_random']:.3f}")
    p = r["paper_rule_t0.5_k5"]
    print(f"paper rule t0.5 k5 on the same scores: {p['groups_emptied']} of {sessions} sessions emptied "
          f"({100 * p['groups_emptied'] / sessions:.0f}%)")


if __name__ == "__main__":
    main()
